"""Is the fast (diagonal-Fisher) map a usable stand-in for the exact one?

Scans the embedded model both ways over the same calibration tokens and formats, then reports
the rank correlation of their cells and, at three budgets, the measured KLD (llama.cpp against
the reference, held-out text) of the recipe each map plans.

    python bench/fast_vs_exact.py --exact compare-out/sensitivity.json --out bench-out
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from scipy.stats import spearmanr

from cardfit.check import check
from cardfit.pack import pack, reserve_bytes
from cardfit.plan import plan
from cardfit.scan import scan
from cardfit.sources import open_model
from cardfit.units import format_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--exact", help="an exact map of the embedded model (default: scan one)")
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--formats", default="Q8_0,Q6_K,Q5_K,Q4_K,Q3_K,Q2_K")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--check-tokens", type=int, default=2048)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    exact_path = Path(args.exact) if args.exact else out / "exact.json"
    timings = {}
    if not exact_path.exists():
        start = time.perf_counter()
        scan(None, None, args.tokens, args.formats, out=exact_path, progress=False)
        timings["exact"] = time.perf_counter() - start
    exact = json.loads(exact_path.read_text())
    fast_path = out / "fast.json"
    fast_path.unlink(missing_ok=True)
    start = time.perf_counter()
    fast = scan(None, None, exact["calibration"]["tokens"], exact["formats"], out=fast_path,
                seq_len=exact["calibration"]["seq_len"], progress=False, method="fast")
    timings["fast"] = time.perf_counter() - start
    pairs = [(ge["cells"][f]["damage"], gf["cells"][f]["damage"])
             for ge, gf in zip(exact["groups"], fast["groups"]) for f in exact["formats"]
             if ge["cells"][f]["damage"] > 0]
    rho = spearmanr(*zip(*pairs)).statistic
    print(f"cells {len(pairs)}, Spearman rank correlation {rho:.3f}; scan seconds {timings}")
    source = open_model(None)
    reserve = reserve_bytes(source, "llama.cpp")
    sizes = [sum(g["bytes"][f] for g in exact["groups"]) for f in exact["formats"]]
    low, high = min(sizes), max(sizes)
    print("| budget | map | predicted damage | measured mean KLD | top-1 | file |")
    print("|---|---|---|---|---|---|")
    for fraction in (0.15, 0.35, 0.6):
        budget = reserve + int(low + fraction * (high - low))
        for name, path in (("exact", exact_path), ("fast", fast_path)):
            recipe = plan(path, budget, reserve_bytes=reserve)
            artifact = out / f"{name}-{fraction}.gguf"
            pack(recipe, None, artifact, force=True, progress=False)
            report = check(artifact, "default", None, args.check_tokens, 512)
            print(f"| {format_bytes(budget)} | {name} | {recipe['predicted_damage']:.4f} | "
                  f"{report['kld_mean']:.4f} ± {report['kld_stderr']:.4f} | {report['top1']:.2%} | "
                  f"{format_bytes(artifact.stat().st_size)} |", flush=True)


if __name__ == "__main__":
    main()
