"""Time to a recipe: for a model and file sizes, the CPU seconds and wall of each stage of fit's imatrix path,
and the held-out KLD of each file beside llama.cpp's preset of that size, for one or more paths side by side.

Paths (`--paths`, in order, each its own map and imatrix):
  fast             the Fisher under imatrix rounding prices every cell, nothing measured (fit --scan-method fast)
  adaptive         the same prices, then exact cells where the plans at the sizes are decided (fit's default)
  adaptive-weight  the weight signal's prices, then exact cells (the path before the Fisher priced imatrix
                   rounding)
Stages, each timed in this process (CPU = this process's user + system time, every thread): the scan's pricing
(over `--formats`, imatrix rounding, recording the importance matrix on the same walk: `scan --imatrix-out`) and
its exact measuring (split where the scan logs its first round), then per size plan, pack (with that importance
matrix) and check (llama.cpp against the f16 reference on the bundled held-out text). With `--presets`, the
sizes are llama.cpp's own preset files of the f16 model, quantized with an importance matrix of the same tokens
as the scan's, and each is checked the same way. `--group-by tensor` scans per matrix (files and maps named
`*-<path>-tensor*`); `--reuse-shelf` takes the preset files a run before left in `--out`.

    python bench/time_to_recipe.py --model qwen2.5-coder-1.5b --presets Q4_K_M,Q3_K_M,Q2_K,IQ2_M --paths fast \
        --out bench-out/ttr
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
from cardfit.targets.shelf import llama_quantize
from cardfit.sources import open_model, runnable
from cardfit.units import format_bytes, parse_bytes

MENU = "Q8_0,Q6_K,Q5_K,Q5_1,Q5_0,Q4_K,Q4_1,Q4_0,IQ4_XS,Q3_K,IQ3_S,IQ3_XXS,Q2_K,IQ2_S,IQ2_XXS"
PATHS = {"fast": dict(method="fast"), "adaptive": dict(method="adaptive", signal="fast"),
         "adaptive-weight": dict(method="adaptive", signal="weight")}


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
    parser.add_argument("--paths", default="fast,adaptive", help="comma-separated: " + ", ".join(PATHS))
    parser.add_argument("--group-by", default="layer", choices=("layer", "tensor"), help="the scan's groups")
    parser.add_argument("--reuse-shelf", action="store_true",
                        help="take the preset files and their imatrix already in --out (a run before made them)")
    parser.add_argument("--out", default="bench-out/time-to-recipe")
    args = parser.parse_args()
    paths = args.paths.split(",")
    if not paths or any(p not in PATHS for p in paths):
        parser.error("--paths takes " + ", ".join(PATHS))
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

    presets = args.presets.split(",") if args.presets else []
    if presets:  # the presets' sizes are the budgets: their files come first (the shelf's own imatrix walk)
        shelf = {preset: out / f"shelf-{preset}.gguf" for preset in presets}
        if not args.reuse_shelf or not all(path.is_file() for path in shelf.values()):
            f16 = out / "f16.gguf"
            pack(uniform_recipe(source, "F16"), model, f16, force=True, progress=False, smoke=False)
            shelf_imatrix = out / "shelf-imatrix.gguf"
            collect_imatrix(model, None, args.tokens, 512, shelf_imatrix, progress=False)  # the scan's tokens
            values = llama_imatrix_values(shelf_imatrix, source)
            shelf = {preset: llama_quantize(f16, path, preset, imatrix=values) for preset, path in shelf.items()}
        sizes = [p.stat().st_size for p in shelf.values()]
        stages.lap("shelf files (not cardfit's)")
    reserve = reserve_bytes(source, "llama.cpp")
    reference = ReferenceLogits(model or "default")
    preset_kld = {}
    if presets:
        for preset, path in shelf.items():
            preset_kld[preset] = check(path, model or "default", None, args.check_tokens, 512,
                                       reference_logits=reference)["kld_mean"]
        stages.lap("shelf checks (not cardfit's)")
    rows = []
    for name in paths:
        label = name if args.group_by == "layer" else f"{name}-{args.group_by}"
        map_path, imatrix = out / f"map-{label}.json", out / f"imatrix-{label}.gguf"
        for stale in (map_path, imatrix):
            stale.unlink(missing_ok=True)
        stage = f"{label}: pricing (the imatrix recorded on the way)"

        def log(line: str) -> None:
            nonlocal stage
            print(line, flush=True)
            if line.startswith("adaptive round 1:"):
                stages.lap(stage)
                stage = f"{label}: measuring (exact cells)"

        settings = PATHS[name]
        scan(model, None, args.tokens, args.formats, group_by=args.group_by, out=map_path, rounding="imatrix",
             progress=False, log=log,
             imatrix_out=imatrix, weight_budgets=sizes if settings["method"] == "adaptive" else None, **settings)
        stages.lap(stage)
        for index, size in enumerate(sizes):
            recipe = plan(map_path, size, reserve_bytes=reserve, budget_info={"file_size_bytes": size})
            stages.lap(f"{label}: plan")
            artifact = out / f"cardfit-{label}-{index}.gguf"
            pack(recipe, model, artifact, force=True, progress=False, smoke=False, imatrix=imatrix)
            stages.lap(f"{label}: pack")
            mine = check(artifact, model or "default", None, args.check_tokens, 512, reference_logits=reference)
            stages.lap(f"{label}: check")
            row = {"path": label, "size": size, "file_bytes": artifact.stat().st_size, "kld": mine["kld_mean"],
                   "predicted": recipe["predicted_damage"]}
            if presets:
                preset = presets[index]
                row.update({"preset": preset, "preset_kld": preset_kld[preset],
                            "vs_preset": 1 - mine["kld_mean"] / preset_kld[preset]})
            rows.append(row)
    (out / ("time-to-recipe.json" if args.group_by == "layer" else f"time-to-recipe-{args.group_by}.json")).write_text(json.dumps({"stages": stages.rows, "rows": rows}, indent=2))
    print("\n| stage | wall s | CPU s |\n|---|---|---|")
    for name, (wall, cpu) in stages.rows.items():
        print(f"| {name} | {wall:.1f} | {cpu:.1f} |")
    print("\n| path | size | cardfit file | predicted | KLD | preset | preset KLD | vs preset |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['path']} | {format_bytes(r['size'])} | {format_bytes(r['file_bytes'])} | {r['predicted']:.4f} | {r['kld']:.4f} | "
              f"{r.get('preset', '')} | {r.get('preset_kld', float('nan')):.4f} | {r.get('vs_preset', float('nan')):+.1%} |")


if __name__ == "__main__":
    main()
