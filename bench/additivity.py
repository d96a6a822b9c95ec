"""Additivity audit: the planner assumes the damage of a recipe is the sum of its cells. How true is that?

For budgets spread between the smallest and the largest recipe, plan from an exact map, pack, and
measure the artifact in llama.cpp on the *same* calibration tokens the map was scanned on (so only
additivity and the runtime differ from the prediction) and on held-out text.

    python bench/additivity.py --map compare-out/sensitivity.json --out bench-out
    python bench/additivity.py --map compare-out/sensitivity.json --out bench-out --refine --points 4

With --refine, each budget's recipe is also refined (cardfit.refine: in-context costs of the eight
heaviest downgrades measured over --refine-tokens calibration tokens, re-planned, kept if the whole
recipe measures better there), packed and measured on the held-out text beside the plain one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cardfit.check import check
from cardfit.pack import pack, reserve_bytes
from cardfit.plan import plan
from cardfit.sources import open_model
from cardfit.text import bundled_text
from cardfit.units import format_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--map", required=True, help="an exact llama.cpp map of the embedded model")
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--points", type=int, default=8)
    parser.add_argument("--refine", action="store_true", help="also refine each recipe and measure it")
    parser.add_argument("--refine-tokens", type=int, default=4096)
    parser.add_argument("--heldout-tokens", type=int, default=8192)
    args = parser.parse_args()
    if args.refine:
        return refine_table(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sensitivity = json.loads(Path(args.map).read_text())
    calib = sensitivity["calibration"]
    reserve = reserve_bytes(open_model(None), "llama.cpp")
    sizes = [sum(g["bytes"][f] for g in sensitivity["groups"]) for f in sensitivity["formats"]]
    low, high = min(sizes), max(sizes)
    print("| budget | predicted (sum of cells) | measured, same calibration tokens | ratio | measured, held-out |")
    print("|---|---|---|---|---|")
    ratios = []
    for k in range(args.points):
        budget = reserve + int(low + (k + 0.5) / args.points * (high - low))
        recipe = plan(args.map, budget, reserve_bytes=reserve)
        artifact = out / f"additivity-{k}.gguf"
        pack(recipe, None, artifact, force=True, progress=False, smoke=False)
        same = check(artifact, "default", bundled_text("calibration"), calib["tokens"], calib["seq_len"])
        held = check(artifact, "default", None, 2048, 512)
        ratio = same["kld_mean"] / recipe["predicted_damage"]
        ratios.append(ratio)
        print(f"| {format_bytes(budget)} | {recipe['predicted_damage']:.4f} | {same['kld_mean']:.4f} ± "
              f"{same['kld_stderr']:.4f} | {ratio:.2f} | {held['kld_mean']:.4f} ± {held['kld_stderr']:.4f} |",
              flush=True)
    print(f"measured / predicted: min {min(ratios):.2f}, max {max(ratios):.2f}")


def refine_table(args) -> None:
    from cardfit.refine import refine

    out = Path(args.out)
    sensitivity = json.loads(Path(args.map).read_text())
    reserve = reserve_bytes(open_model(None), "llama.cpp")
    sizes = [sum(g["bytes"][f] for g in sensitivity["groups"]) for f in sensitivity["formats"]]
    low, high = min(sizes), max(sizes)
    print(f"| budget | whole recipe on {args.refine_tokens} calibration tokens: plain -> refined | groups changed | "
          f"held-out KLD ({args.heldout_tokens} tokens), plain | refined | held-out top-1, plain -> refined | p99 KLD, plain -> refined |")
    print("|---|---|---|---|---|---|---|")
    for k in range(args.points):
        budget = reserve + int(low + (k + 0.5) / args.points * (high - low))
        recipe = plan(args.map, budget, reserve_bytes=reserve)
        refined = refine(recipe, sensitivity, top=8, max_tokens=args.refine_tokens)
        record = refined["refinement"]
        held = {}
        for name, r in (("plain", recipe), ("refined", refined)):
            if name == "refined" and not record["kept"]:
                held[name] = held["plain"]  # the same groups: the same file
                continue
            artifact = out / f"refine-{k}-{name}.gguf"
            pack(r, None, artifact, force=True, progress=False, smoke=False)
            held[name] = check(artifact, "default", None, args.heldout_tokens, 512)
        changed = record["history"][-1]["changed_groups"] if record["history"] else 0
        print(f"| {format_bytes(budget)} | {record['measured_before']:.4f} -> {record['measured_after']:.4f} "
              f"({'kept' if record['kept'] else 'not kept'}) | {changed} | "
              f"{held['plain']['kld_mean']:.4f} ± {held['plain']['kld_stderr']:.4f} | "
              f"{held['refined']['kld_mean']:.4f} ± {held['refined']['kld_stderr']:.4f} | "
              f"{held['plain']['top1']:.2%} -> {held['refined']['top1']:.2%} | "
              f"{held['plain']['kld_p99']:.3f} -> {held['refined']['kld_p99']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
