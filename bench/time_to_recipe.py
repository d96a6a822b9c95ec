"""Time to a recipe: for a model and file sizes, the CPU seconds and wall of each stage of fit's imatrix path,
and the held-out KLD of each file beside llama.cpp's preset of that size.

Stages, each timed in this process (CPU = this process's user + system time, every thread): the adaptive
scan's pricing (the weight signal over `--formats`, imatrix rounding, recording the importance matrix on the
same walk: `scan --imatrix-out`) and its exact measuring (split where the scan logs its first round), then per
size plan, pack (with that importance matrix) and check (llama.cpp against the f16 reference on the bundled
held-out text). With `--presets`, the sizes are llama.cpp's own preset files of the f16 model, quantized with
an importance matrix of the same tokens as the scan's, and each is checked the same way.

    python bench/time_to_recipe.py --model qwen2.5-coder-1.5b --presets Q4_K_M,Q3_K_M,Q2_K,IQ2_M --out bench-out/ttr
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cardfit.check import ReferenceLogits, check
from cardfit.compare import llama_imatrix_values
from cardfit.errors import CardfitError
from cardfit.imatrix import collect_imatrix
from cardfit.pack import pack, reserve_bytes
from cardfit.plan import plan, uniform_recipe
from cardfit.scan import scan
from cardfit.shelf import llama_quantize
from cardfit.sources import open_model, runnable
from cardfit.units import format_bytes, parse_bytes

MENU = "Q8_0,Q6_K,Q5_K,Q5_1,Q5_0,Q4_K,Q4_1,Q4_0,IQ4_XS,Q3_K,IQ3_S,IQ3_XXS,Q2_K,IQ2_S,IQ2_XXS"


class Stages:
    """Wall and CPU seconds of named stages, in order."""

    def __init__(self):
        self.rows: dict[str, list[float]] = {}
        self.mark = (time.perf_counter(), time.process_time())

    def lap(self, name: str) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        row = self.rows.setdefault(name, [0.0, 0.0])
        row[0] += wall - self.mark[0]
        row[1] += cpu - self.mark[1]
        self.mark = (wall, cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model (default: the embedded one)")
    parser.add_argument("--sizes", default=None, help="file sizes, e.g. 900MB,700MB")
    parser.add_argument("--presets", default=None, help="or: llama.cpp presets whose files' sizes are the sizes")
    parser.add_argument("--formats", default=MENU)
    parser.add_argument("--tokens", type=int, default=1024, help="calibration tokens (imatrix and scan)")
    parser.add_argument("--check-tokens", type=int, default=2048, help="held-out tokens each file is checked on")
    parser.add_argument("--out", default="bench-out/time-to-recipe")
    args = parser.parse_args()
    if (args.sizes is None) == (args.presets is None):
        parser.error("give --sizes or --presets")
    if args.tokens < 512 or args.check_tokens < 512:
        parser.error("--tokens and --check-tokens are at least one chunk of 512")
    out = Path(args.out)
    try:
        source = runnable(open_model(args.model))
        sizes = [parse_bytes(s, "--sizes") for s in args.sizes.split(",")] if args.sizes else []
    except CardfitError as error:
        parser.error(str(error))
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    stages = Stages()
    imatrix = out / "imatrix.gguf"

    def log(line: str) -> None:
        print(line, flush=True)
        if line.startswith("adaptive round 1:"):
            stages.lap("pricing (weight signal; the imatrix recorded on the way)")

    map_path = out / "map.json"
    presets = args.presets.split(",") if args.presets else []
    if presets:  # the presets' sizes are the budgets: their files come first (the shelf's own imatrix walk)
        f16 = out / "f16.gguf"
        pack(uniform_recipe(source, "F16"), model, f16, force=True, progress=False, smoke=False)
        collect_imatrix(model, None, args.tokens, 512, imatrix, progress=False)  # the same tokens as the scan's
        values = llama_imatrix_values(imatrix, source)
        shelf = {preset: llama_quantize(f16, out / f"shelf-{preset}.gguf", preset, imatrix=values) for preset in presets}
        sizes = [p.stat().st_size for p in shelf.values()]
        imatrix.unlink()  # the scan makes its own on the way: the timed path
        stages.lap("shelf files (not cardfit's)")
    scan(model, None, args.tokens, args.formats, out=map_path, rounding="imatrix", method="adaptive", signal="weight",
         weight_budgets=sizes, progress=False, log=log, imatrix_out=imatrix)
    stages.lap("measuring (exact cells)")
    reserve = reserve_bytes(source, "llama.cpp")
    reference = ReferenceLogits(model or "default")
    rows = []
    for index, size in enumerate(sizes):
        recipe = plan(map_path, size, reserve_bytes=reserve, budget_info={"file_size_bytes": size})
        stages.lap("plan")
        artifact = out / f"cardfit-{index}.gguf"
        pack(recipe, model, artifact, force=True, progress=False, smoke=False, imatrix=imatrix)
        stages.lap("pack")
        mine = check(artifact, model or "default", None, args.check_tokens, 512, reference_logits=reference)
        stages.lap("check")
        row = {"size": size, "file_bytes": artifact.stat().st_size, "kld": mine["kld_mean"],
               "predicted": recipe["predicted_damage"]}
        if presets:
            preset, path = list(shelf.items())[index]
            theirs = check(path, model or "default", None, args.check_tokens, 512, reference_logits=reference)
            stages.lap("shelf checks (not cardfit's)")
            row.update({"preset": preset, "preset_kld": theirs["kld_mean"],
                        "vs_preset": 1 - mine["kld_mean"] / theirs["kld_mean"]})
        rows.append(row)
    (out / "time-to-recipe.json").write_text(json.dumps({"stages": stages.rows, "rows": rows}, indent=2))
    print("\n| stage | wall s | CPU s |\n|---|---|---|")
    for name, (wall, cpu) in stages.rows.items():
        print(f"| {name} | {wall:.1f} | {cpu:.1f} |")
    print("\n| size | cardfit file | predicted | KLD | preset | preset KLD | vs preset |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {format_bytes(r['size'])} | {format_bytes(r['file_bytes'])} | {r['predicted']:.4f} | {r['kld']:.4f} | "
              f"{r.get('preset', '')} | {r.get('preset_kld', float('nan')):.4f} | {r.get('vs_preset', float('nan')):+.1%} |")


if __name__ == "__main__":
    main()
