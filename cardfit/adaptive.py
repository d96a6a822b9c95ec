"""The adaptive scan: price every cell with the weight signal, measure exactly only where the plan is decided.

The weight signal (weight_signal.py) ranks a group's formats well but is not in nats, and its scale
differs from group to group (a late layer's large activations inflate it; the KL it causes does not
follow). So each group's signal is scaled to KL by the cells of that group already measured exactly
(the geometric mean of their ratios), and the plan is solved on exact cells where they exist and
scaled signals elsewhere. A cell can change a plan if it is a group's chosen format or one step
either side of it in bytes: those are measured exactly, the plan is solved again, and the loop
stops when, at every budget asked for, each group's choice and its two neighbours are exact.
Round one measures the choices of the plan on the raw signal, which gives every group its scale.

A plan cannot be moved by a cell it does not choose unless that cell's estimate is off by more than
the margin to the choice; far cells are the ones the signal ranks most reliably (many bits away).
What it does not promise: a far cell whose estimate is badly too high stays unmeasured. The map says
which cells were measured (no `method`) and which estimated (`method: estimate`, with `signal`).
"""

from __future__ import annotations

import math

import numpy as np


def scaled_estimates(groups: list[dict], formats: list[str]) -> dict[tuple[int, str], float]:
    """(group, format) -> the estimated damage of every cell that has a signal but no exact value: its
    signal times its group's ratio exact/signal (geometric mean over the group's measured cells), or the
    median ratio of all groups for a group with none measured yet."""
    ratios: dict[int, list[float]] = {}
    for i, g in enumerate(groups):
        for f in formats:
            cell = g["cells"].get(f)
            if cell and cell.get("method") is None and cell["damage"] > 0 and cell.get("signal", 0) > 0:
                ratios.setdefault(i, []).append(math.log(cell["damage"] / cell["signal"]))
    pooled = [r for rs in ratios.values() for r in rs]
    fallback = float(np.median(pooled)) if pooled else 0.0
    out = {}
    for i, g in enumerate(groups):
        scale = math.exp(sum(ratios[i]) / len(ratios[i])) if i in ratios else math.exp(fallback)
        for f in formats:
            cell = g["cells"].get(f)
            if cell is not None and cell.get("method") == "estimate":
                out[(i, f)] = cell["signal"] * scale
    return out


def deciding_cells(problem, choices: list[list[int]]) -> set[tuple[int, int]]:
    """(group, format index) of each group's chosen format and its neighbours one step either side in
    bytes (formats of equal bytes count as one step), over every plan in `choices`."""
    wanted = set()
    for choice in choices:
        for g, c in enumerate(choice):
            allowed = [j for j in range(len(problem.formats)) if problem.allowed[g, j]]
            sizes = sorted({int(problem.bytes[g, j]) for j in allowed})
            k = sizes.index(int(problem.bytes[g, c]))
            near = set(sizes[max(k - 1, 0):k + 2])
            wanted |= {(g, j) for j in allowed if int(problem.bytes[g, j]) in near}
    return wanted


def check_budgets(result: dict, budgets: list[int], reserve: int) -> None:
    """Refuse, before any work, a budget no recipe of the map's formats fits (plan's own message)."""
    from .budget import no_fit_message
    from .errors import CardfitError
    from .plan import Problem, minimum_bytes

    sized = {**result, "groups": [{**g, "cells": {f: {"damage": 0.0} for f in result["formats"]}}
                                  for g in result["groups"]]}
    least = minimum_bytes(Problem.from_map(sized)) + reserve
    for budget in budgets:
        if budget < least:
            raise CardfitError(no_fit_message(budget, least), "raise --weight-budget, or scan smaller --formats")


def adaptive_rounds(result: dict, budgets: list[int], measure, log=None, max_rounds: int = 20) -> int:
    """Estimate, plan at every budget (tensor bytes, checked by check_budgets), measure the deciding cells
    not yet exact (`measure(group index, [format names])` puts exact cells into result), until none is
    left. Returns the rounds run."""
    from .errors import CardfitError
    from .plan import Problem, _solve

    formats = result["formats"]
    for rounds in range(1, max_rounds + 1):
        for (i, f), damage in scaled_estimates(result["groups"], formats).items():
            result["groups"][i]["cells"][f]["damage"] = damage
        problem = Problem.from_map(result)
        choices = []
        for budget in budgets:
            choices.append(_solve(problem, budget).choice)
        todo: dict[int, list[str]] = {}
        for g, j in sorted(deciding_cells(problem, choices)):
            if result["groups"][g]["cells"][formats[j]].get("method") == "estimate":
                todo.setdefault(g, []).append(formats[j])
        if not todo:
            return rounds
        if log:
            log(f"adaptive round {rounds}: measuring {sum(map(len, todo.values()))} cells in {len(todo)} groups")
        for g, names in todo.items():
            measure(g, names)
    raise CardfitError(f"the adaptive scan did not settle in {max_rounds} rounds", "use --method exact")
