"""The adaptive scan: price every cell with a cheap signal, measure exactly only where the plan is decided.

The signal is the streamed Fisher's predicted KL (`fast`, fisher.py) or the weight signal
(weight_signal.py, for roundings the Fisher does not price). Neither is exact, and the weight signal
is not even in nats, with a scale that differs from group to group. So each group's signal is scaled to
KL by the cells of that group already measured exactly (the geometric mean of their ratios; the pooled
median for a group with none), and the plan is solved on exact cells where they exist and scaled
signals elsewhere.

Round one measures the choices of the plans on the raw signal, which gives every group its scale and
the signal its measured error: the RMS log error of each measured cell as predicted from the others
(signal_error). Every later round measures each plan's estimated choices, and each estimated cell
that the plan would take if its damage were BAND such errors lower than estimated (found by solving
again with that one cell lowered). The loop stops when no cell is left to measure at any budget.
A round's cells are measured together (measure.measure_round): one walk through the layers for all of
them, each layer and the head read once per round rather than once per group.

Cells each within the band that together hide a better plan are caught by one more solve per budget
with every estimated cell lowered by the band at once. What it does not promise: a signal much worse
on the unmeasured cells than on the measured ones is not caught by its measured error. bench/adaptive_replay.py replays the rule on finished maps.
The map says which cells were measured (no `method`) and which estimated (`method: estimate`, with
`signal`).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..budget import no_fit_message
from ..errors import CardfitError
from ..solver import Problem, minimum_bytes, optimum


RESOLUTION = 1e-3  # a measured damage under this share of the map's largest says nothing about the signal


def measured_ratios(groups: list[dict], formats: list[str]) -> dict[int, list[float]]:
    """Group index -> log(exact / signal) of each of its cells measured exactly, with a positive signal and a
    damage above RESOLUTION times the largest measured one (groups with none left out): what scales the
    signal, and what its error is measured on. Under that share a damage cannot move a plan, and may be the
    engine's arithmetic rather than the format's (a type whose grid the weights already lie on measures ~5e-8
    nats on the embedded model, whatever its signal): with it, such ratios would swamp the error."""
    measured = [c["damage"] for g in groups for c in g["cells"].values() if c.get("method") is None]
    floor = RESOLUTION * max(measured, default=0.0)
    ratios: dict[int, list[float]] = {}
    for i, g in enumerate(groups):
        for f in formats:
            cell = g["cells"].get(f)
            if cell and cell.get("method") is None and cell["damage"] > floor and cell.get("signal", 0) > 0:
                ratios.setdefault(i, []).append(math.log(cell["damage"] / cell["signal"]))
    return ratios


def scaled_estimates(groups: list[dict], formats: list[str]) -> dict[tuple[int, str], float]:
    """(group, format) -> the estimated damage of every cell that has a signal but no exact value: its
    signal times its group's ratio exact/signal (geometric mean over the group's measured cells), or the
    median ratio of all groups for a group with none measured yet."""
    ratios = measured_ratios(groups, formats)
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


BAND = 2.0  # how many of the signal's measured log errors a cell's estimate may be off by
SOLVE_CELLS = 2000  # plans of more cells than this trust the dual bound alone (a solve each costs ~1 s there)


def signal_error(groups: list[dict], formats: list[str]) -> float | None:
    """The signal's error once scaled, measured on the map itself: the RMS log error of each exact cell
    predicted from the other exact cells of its group (the pooled median where it is its group's only one)
    — how scaled_estimates would have priced it. None below three such cells."""
    ratios = measured_ratios(groups, formats)
    residuals = []
    for i, own in ratios.items():
        pooled = [r for j, rs in ratios.items() if j != i for r in rs]
        for k, ratio in enumerate(own):
            others = own[:k] + own[k + 1:]
            if others or pooled:
                residuals.append(ratio - (sum(others) / len(others) if others else float(np.median(pooled))))
    return math.sqrt(sum(r * r for r in residuals) / len(residuals)) if len(residuals) >= 3 else None


def dual_bound(problem, budget: int) -> tuple[float, np.ndarray]:
    """(λ, each group's least damage + λ·bytes over its allowed formats) at the λ that maximises the plan's
    Lagrangian dual Σ_g min_f (damage + λ·bytes) − λ·budget. Any λ makes that sum a lower bound on every
    plan within the budget (tied formats dropped only loosen it), so it prunes without solving."""
    damage = np.where(problem.allowed, problem.damage, np.inf)
    size = problem.bytes.astype(float)
    rows = np.arange(damage.shape[0])

    def at(lam: float) -> tuple[np.ndarray, float]:
        cost = damage + lam * size
        k = cost.argmin(axis=1)
        return cost[rows, k], float(size[rows, k].sum())

    least, fitted = at(0.0)
    if fitted <= budget:
        return 0.0, least
    low, high = 0.0, 1.0
    for _ in range(200):  # the least-bytes choice fits (the budget was checked), so some λ gets there
        if at(high)[1] <= budget:
            break
        low, high = high, high * 2
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if at(middle)[1] > budget else (low, middle)
    best = max((low, high), key=lambda lam: at(lam)[0].sum() - lam * budget)
    return best, at(best)[0]


def deciding_cells(problem, budgets: list[int], choices: list[list[int]], estimated: set[tuple[int, int]],
                   error: float | None) -> set[tuple[int, int]]:
    """(group, format index) of the estimated cells that can decide a plan: each plan's own choices, and
    every cell that the plan would take if its damage were BAND measured errors lower than estimated
    (solved again with only that cell lowered, unless the dual bound already shows the plan would not
    take it; above SOLVE_CELLS cells the bound alone decides, so a few more cells are measured, never
    fewer), and the estimated choices of each plan solved with every estimated cell BAND errors lower at
    once (cells each within the band that together hide a better plan). No error measured yet: the
    choices, then every cell."""
    wanted = {(g, c) for choice in choices for g, c in enumerate(choice) if (g, c) in estimated}
    if error is None:
        return wanted or {(g, j) for g, j in estimated if problem.allowed[g, j]}
    slack = math.exp(BAND * error)
    solve = int(problem.allowed.sum()) <= SOLVE_CELLS
    for budget, choice in zip(budgets, choices):
        best = sum(problem.damage[g, c] for g, c in enumerate(choice))
        lam, least = dual_bound(problem, budget)
        floor = least.sum() - lam * budget
        for g, j in sorted(estimated - wanted):
            c = choice[g]
            low = problem.damage[g, j] / slack
            if not problem.allowed[g, j] or (problem.bytes[g, j] >= problem.bytes[g, c] and low >= problem.damage[g, c]):
                continue  # no cheaper in bytes and no better even at its optimistic damage
            if floor - least[g] + low + lam * problem.bytes[g, j] >= best:
                continue  # every plan through this cell, even at its optimistic damage, is no better
            if not solve:
                wanted.add((g, j))
                continue
            trial = replace(problem, damage=problem.damage.copy())
            trial.damage[g, j] = low
            solution = optimum(trial, budget)
            if solution is not None and solution.choice[g] == j:
                wanted.add((g, j))
    return wanted | optimist_cells(problem, budgets, estimated, slack)


def optimist_cells(problem, budgets: list[int], estimated: set[tuple[int, int]], slack: float) -> set[tuple[int, int]]:
    """The estimated cells each budget's plan takes when every estimated damage is `slack` times lower at once:
    cells each within the band that together hide a better plan (one solve per budget)."""
    optimist = replace(problem, damage=problem.damage.copy())
    for g, j in estimated:
        optimist.damage[g, j] /= slack
    found = set()
    for budget in budgets:
        solution = optimum(optimist, budget)
        if solution is not None:
            found |= {(g, c) for g, c in enumerate(solution.choice) if (g, c) in estimated}
    return found


def check_budgets(result: dict, budgets: list[int], reserve: int) -> None:
    """Refuse, before any work, a budget no recipe of the map's formats fits (plan's own message)."""

    sized = {**result, "groups": [{**g, "cells": {f: {"damage": 0.0} for f in result["formats"]}}
                                  for g in result["groups"]]}
    least = minimum_bytes(Problem.from_map(sized)) + reserve
    for budget in budgets:
        if budget < least:
            raise CardfitError(no_fit_message(budget, least), "raise --weight-budget, or scan smaller --formats")


def adaptive_rounds(result: dict, budgets: list[int], measure, log=None, max_rounds: int = 20) -> int:
    """Estimate, plan at every budget (tensor bytes, checked by check_budgets), measure the deciding cells
    not yet exact (`measure({group index: [format names]})` puts a round's exact cells into result, all
    at once so they can share walks), until none is left. Returns the rounds run."""

    formats = result["formats"]
    for rounds in range(1, max_rounds + 1):
        for (i, f), damage in scaled_estimates(result["groups"], formats).items():
            result["groups"][i]["cells"][f]["damage"] = damage
        problem = Problem.from_map(result)
        choices = []
        for budget in budgets:
            choices.append(optimum(problem, budget).choice)
        estimated = {(g, j) for g, entry in enumerate(result["groups"]) for j, f in enumerate(formats)
                     if entry["cells"][f].get("method") == "estimate"}
        error = signal_error(result["groups"], formats)
        todo: dict[int, list[str]] = {}
        for g, j in sorted(deciding_cells(problem, budgets, choices, estimated, error)):
            todo.setdefault(g, []).append(formats[j])
        if not todo:
            return rounds
        if log:
            log(f"adaptive round {rounds}: measuring {sum(map(len, todo.values()))} cells in {len(todo)} groups")
        measure(todo)
    raise CardfitError(f"the adaptive scan did not settle in {max_rounds} rounds", "use --method exact")
