"""Replay the adaptive scan's selection on finished maps: how many cells it would measure, and whether
its recipes equal the exact map's, at each band width — in seconds, without scanning again.

Takes an exact map and a cheap map (`scan --method fast` or `--method weight`) of the same model, text
and formats; "measuring" a cell copies it from the exact map. Budgets are tensor bytes at the sizes of
uniform formats (as bench/signals.py) or shares of the way from the smallest to the largest.

    python bench/adaptive_replay.py EXACT.json FAST.json --budgets Q5_K,Q4_K,Q3_K --bands 1,2,3
"""

from __future__ import annotations

import argparse
import copy
import json

import cardfit.adaptive as adaptive
from cardfit.plan import Problem, _solve


def replay(exact: dict, cheap: dict, budgets: list[int]) -> tuple[int, int, list[bool]]:
    """(cells measured, rounds, recipe equals exact's per budget)."""
    fmts = exact["formats"]
    result = copy.deepcopy(exact)
    for entry, priced in zip(result["groups"], cheap["groups"]):
        entry["cells"] = {f: {"damage": priced["cells"][f]["damage"], "stderr": None, "top1": None,
                              "method": "estimate", "signal": priced["cells"][f]["damage"]} for f in fmts}
    measured = 0

    def measure(todo: dict[int, list[str]]) -> None:
        nonlocal measured
        for index, names in todo.items():
            for name in names:
                signal = result["groups"][index]["cells"][name]["signal"]
                result["groups"][index]["cells"][name] = {**exact["groups"][index]["cells"][name], "signal": signal}
                measured += 1

    rounds = adaptive.adaptive_rounds(result, budgets, measure)
    truth, replayed = Problem.from_map(exact), Problem.from_map(result)
    return measured, rounds, [_solve(truth, b).choice == _solve(replayed, b).choice for b in budgets]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("exact")
    parser.add_argument("cheap")
    parser.add_argument("--budgets", default="Q5_K,Q4_K,Q3_K", help="format names or shares (0..1)")
    parser.add_argument("--bands", default="1,2,3")
    args = parser.parse_args()
    exact, cheap = (json.load(open(p)) for p in (args.exact, args.cheap))
    fmts = exact["formats"]
    size = {f: sum(g["bytes"][f] for g in exact["groups"]) for f in fmts}
    budgets = [size[b] if b in size else int(size[fmts[-1]] + (size[fmts[0]] - size[fmts[-1]]) * float(b))
               for b in args.budgets.split(",")]
    cells = len(fmts) * len(exact["groups"])
    print(f"{args.cheap} vs {args.exact}: {cells} cells, budgets {args.budgets}")
    print("\n| band | all budgets at once: measured, rounds, same recipe | "
          + " | ".join(f"{b} alone" for b in args.budgets.split(",")) + " |")
    print("|---|---|" + "---|" * len(budgets))
    for band in (float(b) for b in args.bands.split(",")):
        adaptive.BAND = band
        row = [f"{band:g}"]
        for chosen in [budgets] + [[b] for b in budgets]:
            measured, rounds, same = replay(exact, cheap, chosen)
            row.append(f"{measured} ({measured / cells:.0%}), {rounds}, {'yes' if all(same) else 'NO'}")
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
