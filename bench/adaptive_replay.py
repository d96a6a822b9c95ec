"""Replay the adaptive scan's selection on finished maps: how many cells it would measure, and whether
its recipes equal the exact map's, at each band width — in seconds, without scanning again.

Takes an exact map and a cheap map (`scan --method fast` or `--method weight`) of the same model, text
and formats; "measuring" a cell copies it from the exact map. Budgets are tensor bytes at the sizes of
uniform formats (as bench/signals.py), shares of the way from the smallest to the largest, or bytes.

The exact side may be several maps whose measured cells are pooled (EXACT,EXACT...: adaptive maps of the same
job, where no complete exact map exists); then a cell none of them measured is counted as unknown (it keeps
its estimate), and instead of "same recipe" each plan's damage summed over exact cells is printed.

    python bench/adaptive_replay.py EXACT.json FAST.json --budgets Q5_K,Q4_K,Q3_K --bands 1,2,3
    python bench/adaptive_replay.py A.json,B.json FAST.json --budgets 103660016,91716080 --bands 2
"""

from __future__ import annotations

import argparse
import copy
import json

import cardfit.scan.adaptive as adaptive
from cardfit.solver import Problem, optimum


def replay(exact: dict, cheap: dict, budgets: list[int]) -> tuple[int, int, list[list[int]], int]:
    """(cells measured, rounds, each budget's plan as format indices, cells asked for that `exact` lacks)."""
    fmts = exact["formats"]
    result = copy.deepcopy(exact)
    for entry, priced in zip(result["groups"], cheap["groups"]):
        entry["cells"] = {f: {"damage": priced["cells"][f]["damage"], "stderr": None, "top1": None,
                              "method": "estimate", "signal": priced["cells"][f]["damage"]} for f in fmts}
    measured = unknown = 0

    def measure(todo: dict[int, list[str]]) -> None:
        nonlocal measured, unknown
        for index, names in todo.items():
            for name in names:
                cell = result["groups"][index]["cells"][name]
                truth = exact["groups"][index]["cells"].get(name)
                if truth is None or truth.get("method") is not None:
                    unknown += 1
                    truth = {"damage": cell["damage"], "stderr": None, "top1": None}
                result["groups"][index]["cells"][name] = {**truth, "signal": cell["signal"]}
                measured += 1

    rounds = adaptive.adaptive_rounds(result, budgets, measure)
    replayed = Problem.from_map(result)
    return measured, rounds, [list(optimum(replayed, b).choice) for b in budgets], unknown


def pooled(paths: list[str]) -> dict:
    """The first map with every cell any of the maps measured exactly (the others' cells never overwrite)."""
    maps = [json.load(open(p)) for p in paths]
    out = copy.deepcopy(maps[0])
    for entry in out["groups"]:
        entry["cells"] = {f: c for f, c in entry["cells"].items() if c.get("method") is None}
    for other in maps[1:]:
        for entry, theirs in zip(out["groups"], other["groups"]):
            for f, c in theirs["cells"].items():
                if c.get("method") is None:
                    entry["cells"].setdefault(f, c)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("exact", help="an exact map, or several maps' measured cells pooled: A.json,B.json")
    parser.add_argument("cheap")
    parser.add_argument("--budgets", default="Q5_K,Q4_K,Q3_K", help="format names, shares (0..1) or tensor bytes")
    parser.add_argument("--bands", default="1,2,3")
    args = parser.parse_args()
    exact, cheap = pooled(args.exact.split(",")), json.load(open(args.cheap))
    fmts = exact["formats"]
    complete = all(f in g["cells"] for g in exact["groups"] for f in fmts)
    size = {f: sum(g["bytes"][f] for g in exact["groups"]) for f in fmts}

    def budget(word: str) -> int:
        if word in size:
            return size[word]
        share = float(word)
        return int(share) if share > 1 else int(size[fmts[-1]] + (size[fmts[0]] - size[fmts[-1]]) * share)

    names = args.budgets.split(",")
    budgets = [budget(b) for b in names]
    cells = len(fmts) * len(exact["groups"])
    known = sum(len(g["cells"]) for g in exact["groups"])
    print(f"{args.cheap} vs {args.exact}: {cells} cells ({known} measured), budgets {args.budgets}")
    truth = Problem.from_map(exact) if complete else None

    def verdict(choice: list[int], b: int) -> str:
        if truth is not None:
            return "same" if choice == list(optimum(truth, b).choice) else "NOT the exact plan"
        damage = [exact["groups"][g]["cells"].get(fmts[c], {}).get("damage") for g, c in enumerate(choice)]
        return f"exact damage {sum(damage):.6g}" if None not in damage else "a chosen cell not measured"

    print("\n| band | all budgets at once: measured, rounds, unknown | "
          + " | ".join(f"{b}" for b in names) + " |")
    print("|---|---|" + "---|" * len(budgets))
    for band in (float(b) for b in args.bands.split(",")):
        adaptive.BAND = band
        measured, rounds, choices, unknown = replay(exact, cheap, budgets)
        row = [f"{band:g}", f"{measured} ({measured / cells:.0%}), {rounds}, {unknown}"]
        row += [verdict(choice, b) for choice, b in zip(choices, budgets)]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
