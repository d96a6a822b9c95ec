"""The ways to price a map, on one model, side by side: exact, weight, fast and adaptive.

Scans the model each way over the same calibration tokens and formats (timing each), then reports each
cheap map's Spearman rank correlation with the exact map's cells and, at three budgets (the sizes of
uniform `--budget-formats`, GGUF reserve included), the plan each map makes priced by the *exact* map
(the summed measured KL of the cells it chose): how much a plan loses by trusting the cheap signal.
Adaptive measures exactly where those budgets are decided, so its plans should equal exact's: once for
all three budgets (`adaptive`), once for the middle one alone (`adaptive-one`, fit's case), each seeded
by --signal (default: both fast and weight, as `adaptive-weight`, `adaptive-one-weight`).

    python bench/signals.py --model qwen2.5-coder-0.5b --out bench-out/signals-0.5b

Maps already in --out are reused (their scan time is then not re-measured: delete them to time again).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from scipy.stats import spearmanr

from cardfit.pack import reserve_bytes
from cardfit.plan import plan
from cardfit.scan import scan
from cardfit.sources import open_model
from cardfit.units import format_bytes


def timed_scan(path: Path, timings: dict, name: str, **kwargs) -> dict:
    if path.exists() and json.loads(path.read_text()).get("complete"):
        return json.loads(path.read_text())
    start = time.perf_counter()
    result = scan(out=path, progress=False, **kwargs)
    timings[name] = time.perf_counter() - start
    return result


def exact_price(recipe: dict, exact: dict) -> float:
    """The exact map's summed damage of the cells a recipe chose."""
    cells = {g["name"]: g["cells"] for g in exact["groups"]}
    return sum(cells[g["name"]][g["format"]]["damage"] for g in recipe["groups"] if g["format"] in cells[g["name"]])


def chosen(recipe: dict) -> dict[str, str]:
    return {g["name"]: g["format"] for g in recipe["groups"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="model (default: the embedded one)")
    parser.add_argument("--out", default="bench-out/signals")
    parser.add_argument("--formats", default="Q8_0,Q6_K,Q5_K,Q4_K,Q3_K,Q2_K")
    parser.add_argument("--budget-formats", default="Q5_K,Q4_K,Q3_K")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--signals", default="fast,weight", help="what seeds the adaptive scans")
    parser.add_argument("--maps", default=None, help="only these cheap maps, e.g. fast,adaptive-one (exact always)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timings_path = out / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    common = dict(model=args.model, calibration=None, max_tokens=args.tokens, formats=args.formats,
                  seq_len=args.seq_len)
    maps = {"exact": timed_scan(out / "exact.json", timings, "exact", **common)}
    timings_path.write_text(json.dumps(timings, indent=1))
    source = open_model(args.model)
    reserve = reserve_bytes(source, "llama.cpp")
    exact = maps["exact"]
    budgets = [reserve + sum(g["bytes"][f] for g in exact["groups"]) for f in args.budget_formats.split(",")]
    runs = [("weight", {"method": "weight"}), ("fast", {"method": "fast"})]
    for signal in args.signals.split(","):
        suffix = "" if signal == "fast" else f"-{signal}"
        runs += [(f"adaptive{suffix}", {"method": "adaptive", "weight_budgets": budgets, "signal": signal}),
                 (f"adaptive-one{suffix}", {"method": "adaptive", "weight_budgets": budgets[1:2], "signal": signal})]
    if args.maps:
        runs = [(name, extra) for name, extra in runs if name in args.maps.split(",")]
    for name, extra in runs:
        maps[name] = timed_scan(out / f"{name}.json", timings, name, **common, **extra)
        timings_path.write_text(json.dumps(timings, indent=1))

    print(f"model {args.model or 'embedded'}, formats {args.formats}, {exact['calibration']['tokens']} tokens; "
          f"{len(exact['groups'])} groups")
    print("\n| map | scan time (of exact's) | Spearman vs exact | cells measured exactly (of all) |")
    print("|---|---|---|---|")
    for name, result in maps.items():
        pairs = [(ge["cells"][f]["damage"], gs["cells"][f]["damage"]) for ge, gs in zip(exact["groups"], result["groups"])
                 for f in exact["formats"] if ge["cells"][f]["damage"] > 0]
        rho = spearmanr(*zip(*pairs)).statistic
        total = sum(len(g["cells"]) for g in result["groups"])
        measured = total if name == "exact" else result.get("adaptive", {}).get("exact_cells", 0)
        seconds = timings.get(name)
        share = f" ({seconds / timings['exact']:.0%})" if seconds and timings.get("exact") else ""
        print(f"| {name} | {'%.0f s' % seconds + share if seconds else 'reused'} | {rho:.3f} | {measured} of {total} |")
    print("\n| budget | exact plan (its KL) | " + " | ".join(f"{n} plan, priced by exact" for n in maps if n != "exact")
          + " |")
    print("|---|---|" + "---|" * (len(maps) - 1))
    for fmt, budget in zip(args.budget_formats.split(","), budgets):
        recipes = {n: plan(m, budget, reserve_bytes=reserve) for n, m in maps.items()}
        base = exact_price(recipes["exact"], exact)
        row = [f"{fmt} size ({format_bytes(budget)})", f"{base:.4f}"]
        for name in maps:
            if name != "exact":
                price = exact_price(recipes[name], exact)
                same = " (same recipe)" if chosen(recipes[name]) == chosen(recipes["exact"]) else ""
                row.append(f"{price:.4f} ({price / base - 1:+.1%}){same}")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
