"""The planning problem and its exact solver: least summed damage whose bytes fit a budget.

A multiple-choice knapsack: binary x[g, f], one format per group, sum of bytes <= budget, minimise sum of
damage; solved as a MILP by HiGHS (scipy.optimize.milp) with a relative gap of 0, so a solution is proven
optimal. Pins fix a group's format, floors forbid formats with fewer bits than the floor's, and
`same_format` ties groups a runtime needs in one format (fused q/k/v, gate/up, routed experts) with
equality constraints. Numbers in, choices out: no model, no torch.
"""

from __future__ import annotations

import ctypes
import fnmatch
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .errors import CardfitError
from .formats import get_format
from .groups import expert_stack
from .targets import get_target


@dataclass
class Problem:
    groups: list[str]
    formats: list[str]
    damage: np.ndarray  # (G, F)
    bytes: np.ndarray  # (G, F) int
    allowed: np.ndarray  # (G, F) bool
    same_format: list[list[int]]
    runtime: str = "llama.cpp"  # the runtime planned for, whose served formats `allowed` keeps to

    @classmethod
    def from_map(cls, data: dict, formats: list[str] | None = None, pins: dict[str, str] | None = None,
                 floors: dict[str, str] | None = None, runtime: str | None = None) -> "Problem":
        names = [g["name"] for g in data["groups"]]
        fmts = formats or data["formats"]
        target = get_target(check_runtime(data, runtime))
        runtime = target.name
        served = set(target.formats)
        for f in fmts:
            if f not in data["formats"]:
                raise CardfitError(f"format {f} is not in the map", "scan it, or choose from " + ", ".join(data["formats"]))
        damage = np.zeros((len(names), len(fmts)))
        size = np.zeros((len(names), len(fmts)), dtype=np.int64)
        allowed = np.ones((len(names), len(fmts)), dtype=bool)
        for i, g in enumerate(data["groups"]):
            for j, f in enumerate(fmts):
                size[i, j] = g["bytes"][f]
                cell = g["cells"].get(f)
                if cell is None:
                    raise CardfitError(f"the map has no damage for {g['name']} @ {f} (scan incomplete)",
                                       "finish it with cardfit scan --resume")
                damage[i, j] = cell["damage"]
                if f not in served:
                    allowed[i, j] = False
        for pattern, fmt in (pins or {}).items():
            rows = _matching(names, pattern)
            j = _format_index(fmts, fmt)
            allowed[rows, :] = False
            allowed[rows, j] = True
        for pattern, fmt in (floors or {}).items():
            rows = _matching(names, pattern)
            floor_bits = get_format(fmt).bits
            for j, f in enumerate(fmts):
                if get_format(f).bits < floor_bits:
                    allowed[rows, j] = False
        for pattern, fmt in (floors or {}).items():  # a floor above every format the map has leaves nothing
            empty = [i for i in _matching(names, pattern) if not allowed[i].any()]
            if empty:
                raise CardfitError(f"--floor {pattern}={fmt} is above every format the map has for "
                                   f"{names[empty[0]]} ({', '.join(fmts)})",
                                   f"lower the floor, or scan a format of at least {get_format(fmt).bits:g} bits")
        experts = _expert_rules(data["groups"], fmts, target, allowed)
        if not allowed.any(axis=1).all():
            raise CardfitError(f"none of the map's formats ({', '.join(fmts)}) is served by {runtime}",
                               "scan formats it serves: " + ", ".join(target.formats))
        same = _fused_groups(names, target.fused) + experts
        return cls(names, list(fmts), damage, size, allowed, same, runtime)


def check_runtime(data: dict, runtime: str | None) -> str:
    """The runtime to plan for: the map's own, or one served from the same kind of file (vllm-cpu from a
    vLLM map)."""
    scanned = data.get("runtime", "llama.cpp")
    if runtime is None:
        return scanned
    target = get_target(runtime)
    if target.family != scanned:
        raise CardfitError(f"the map was scanned for {scanned}, not for {runtime}",
                           f"scan formats {runtime} serves: " + ", ".join(target.formats))
    return runtime


def _matching(names: list[str], pattern: str) -> list[int]:
    rows = [i for i, n in enumerate(names) if fnmatch.fnmatch(n, pattern)]
    if not rows:
        raise CardfitError(f"no group matches '{pattern}'", "groups are: " + ", ".join(names[:6]) + ", ...")
    return rows


def _format_index(fmts: list[str], fmt: str) -> int:
    name = get_format(fmt).name
    if name not in fmts:
        raise CardfitError(f"format {fmt} is not among the planned formats", "choose from " + ", ".join(fmts))
    return fmts.index(name)


def _expert_rules(groups: list[dict], fmts: list[str], target, allowed: np.ndarray) -> list[list[int]]:
    """The target's rules for routed experts (Target.expert_format, one_expert_format), applied to `allowed`
    in place; returns the groups holding experts when they must share one format. A format whose rows
    resolve to different schemes across the expert stacks (W4A16-g128 falling back to g64 on one and g32 on
    another, as the map's `storage` records) cannot be that one format."""
    rows = [i for i, g in enumerate(groups) if any(expert_stack(t) for t in g["tensors"])]
    if not rows:
        return []
    stacks = [groups[i].get("storage") or {} for i in rows if all(expert_stack(t) for t in groups[i]["tensors"])]
    for j, f in enumerate(fmts):
        if target.expert_format is not None and not target.expert_format(f):
            allowed[rows, j] = False
        if target.one_expert_format and len({s for storage in stacks for s in storage.get(f, [])}) > 1:
            allowed[rows, j] = False
    if not allowed[rows].any(axis=1).all():
        menu = [f for f in target.formats if target.expert_format is None or target.expert_format(f)]
        raise CardfitError(f"no format of the map (or of the pins and floors) is one {target.name} can hold "
                           "every routed expert in", "scan one of " + ", ".join(menu))
    return [rows] if target.one_expert_format and len(rows) > 1 else []


def _fused_groups(names: list[str], fused: tuple[tuple[str, ...], ...]) -> list[list[int]]:
    """Projections a runtime runs as one kernel (vLLM: q/k/v, gate/up): with per-tensor groups they share a format."""
    out = []
    for parts in fused:
        by_prefix: dict[str, list[int]] = {}
        for i, n in enumerate(names):
            for p in parts:
                if f".{p}." in f".{n}":
                    by_prefix.setdefault(n.replace(p, "*"), []).append(i)
        out += [rows for rows in by_prefix.values() if len(rows) > 1]
    return out


@dataclass
class Solution:
    choice: list[int]  # format index per group
    damage: float
    bytes: int
    gap: float


@contextmanager
def solver_quiet():
    """File descriptor 1 points at /dev/null for the block: HiGHS prints debug lines from C++ straight to it
    whatever its options (`HighsMipSolverData::transformNewIntegerFeasibleSolution ...`). C's buffers are
    flushed on both sides, so nothing of it reaches the terminal later; another thread's writes to the
    descriptor during the block (a solve takes milliseconds to a second) are lost with it."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def optimum(problem: Problem, budget: int | None, objective: str = "damage") -> Solution | None:
    """The least-`objective` choice whose bytes fit `budget` (None: no limit), proven optimal, or None when no
    choice fits."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    from scipy.sparse import coo_matrix, vstack

    G, F = problem.damage.shape
    n = G * F
    cost = (problem.damage if objective == "damage" else problem.bytes.astype(float)).reshape(-1)
    cols = np.arange(n)
    rows = [coo_matrix((np.ones(n), (cols // F, cols)), shape=(G, n))]  # one format per group
    lo, hi = [1.0] * G, [1.0] * G
    if budget is not None:
        rows.append(coo_matrix(problem.bytes.reshape(1, -1).astype(float)))
        lo.append(-np.inf)
        hi.append(float(budget))
    for tied in problem.same_format:
        for a, b in zip(tied, tied[1:]):
            r = np.repeat(np.arange(F), 2)
            c = np.ravel([[a * F + f, b * F + f] for f in range(F)])
            rows.append(coo_matrix((np.tile([1.0, -1.0], F), (r, c)), shape=(F, n)))
            lo += [0.0] * F
            hi += [0.0] * F
    upper = problem.allowed.reshape(-1).astype(float)
    with solver_quiet():
        result = milp(cost, integrality=np.ones(n), bounds=Bounds(np.zeros(n), upper),
                      constraints=LinearConstraint(vstack(rows).tocsr(), lo, hi), options={"mip_rel_gap": 0.0})
    if result.status != 0 or result.x is None:
        return None
    x = np.round(result.x).reshape(G, F).astype(bool)
    choice = [int(np.argmax(x[g])) for g in range(G)]
    gap = float(getattr(result, "mip_gap", 0.0) or 0.0)
    return Solution(choice, float(sum(problem.damage[g, c] for g, c in enumerate(choice))),
                    int(sum(problem.bytes[g, c] for g, c in enumerate(choice))), gap)


def minimum_bytes(problem: Problem) -> int:
    """The fewest bytes any allowed choice takes."""
    solution = optimum(problem, None, objective="bytes")
    if solution is None:
        raise CardfitError("the pins and floors leave no format for some group", "relax --pin / --floor")
    return solution.bytes


def solve(problem: Problem, budget: int) -> Solution:
    """optimum at `budget`, or the no-fit refusal naming the minimum."""
    solution = optimum(problem, budget)
    if solution is None:
        from .budget import no_fit_message

        raise CardfitError(no_fit_message(budget, minimum_bytes(problem)),
                           "raise --vram, lower --context, or allow smaller --formats")
    return solution


def frontier(problem: Problem, max_points: int = 1000) -> list[dict]:
    """The exact Pareto frontier: every budget's optimum, from the largest recipe down to the minimum.

    Each solve at budget B returns the optimum for every budget in [bytes(solution), B];
    the next solve asks for one byte less, so no Pareto point is skipped.
    """
    points = []
    budget = int(problem.bytes.max(axis=1).sum())
    while len(points) < max_points:
        solution = optimum(problem, budget)
        if solution is None:
            break
        points.append({"bytes": solution.bytes, "damage": solution.damage,
                       "formats": [problem.formats[c] for c in solution.choice]})
        budget = solution.bytes - 1
    return points
