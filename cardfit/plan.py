"""Stage 3: the exact optimum — least summed damage whose bytes fit the budget.

A multiple-choice knapsack: binary x[g, f], one format per group, sum of bytes <= budget,
minimise sum of damage. Solved as a MILP by HiGHS (scipy.optimize.milp) with a relative
gap of 0, so a returned recipe is proven optimal; the solver's reported gap is stored.
Pins fix a group's format, floors forbid formats with fewer bits than the floor's, and
`same_format` ties groups that a runtime needs in one format (fused q/k/v, gate/up when
scanning per tensor for vLLM) with equality constraints — constraints, not fix-ups.
"""

from __future__ import annotations

import ctypes
import fnmatch
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CardfitError
from .formats import get_format
from .schemas import RECIPE_VERSION, content_hash, model_header
from .targets import get_target
from .units import format_bytes



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
    from .groups import expert_stack

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


def _solve(problem: Problem, budget: int | None, objective: str = "damage") -> Solution | None:
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
    solution = _solve(problem, None, objective="bytes")
    if solution is None:
        raise CardfitError("the pins and floors leave no format for some group", "relax --pin / --floor")
    return solution.bytes


def solve(problem: Problem, budget: int) -> Solution:
    solution = _solve(problem, budget)
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
        solution = _solve(problem, budget)
        if solution is None:
            break
        points.append({"bytes": solution.bytes, "damage": solution.damage,
                       "formats": [problem.formats[c] for c in solution.choice]})
        budget = solution.bytes - 1
    return points


def map_hash(data: dict) -> str:
    return content_hash(data)


def parse_assignments(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        for part in item.split(","):
            if "=" not in part:
                raise CardfitError(f"{flag} '{part}' is not GROUP=FORMAT", f"write e.g. {flag} 'lm_head=Q8_0'")
            group, fmt = (side.strip() for side in part.split("=", 1))
            if not group or not fmt:
                raise CardfitError(f"{flag} '{part}' names no group or no format", f"write e.g. {flag} 'lm_head=Q8_0'")
            if out.get(group, fmt) != fmt:
                raise CardfitError(f"{flag} gives {group} two formats ({out[group]} and {fmt})",
                                   f"give each group one {flag}")
            out[group] = fmt
    return out


def plan(map_path: str | Path | dict, weight_budget: int, formats: list[str] | None = None,
         pins: dict[str, str] | None = None, floors: dict[str, str] | None = None,
         budget_info: dict | None = None, reserve_bytes: int = 0, runtime: str | None = None) -> dict:
    """The optimal recipe for a map and a weight budget, as the recipe JSON (docs/formats.md).

    `reserve_bytes` is what the artifact needs beside tensor data (GGUF metadata, tokenizer and
    alignment padding; see `pack.reserve_bytes`), so that the packed file, not just its tensors,
    fits the budget.
    """
    from .maps import read_map, validate_map

    if isinstance(map_path, dict):  # a map already read (refine plans from a corrected copy)
        validate_map(map_path)
        data = map_path
    else:
        data = read_map(map_path)
    problem = Problem.from_map(data, formats, pins, floors, runtime)
    solution = _solve(problem, weight_budget - reserve_bytes) if reserve_bytes < weight_budget else None
    if solution is None:  # the minimum is stated against the whole budget, reserve included
        from .budget import no_fit_message

        info = budget_info or {}
        raise_it = ("raise --vram or lower --context" if "vram_bytes" in info else
                    "raise --size" if "file_size_bytes" in info else "raise --weight-budget")
        raise CardfitError(no_fit_message(weight_budget, minimum_bytes(problem) + reserve_bytes),
                           f"{raise_it}, or allow smaller --formats")
    uniform = {f: int(problem.bytes[:, j].sum()) for j, f in enumerate(problem.formats)}
    groups = []
    for g, c in enumerate(solution.choice):
        fmt = problem.formats[c]
        group = {"name": problem.groups[g], "format": fmt, "bytes": int(problem.bytes[g, c]),
                 "damage": float(problem.damage[g, c]), "largest_bytes": int(problem.bytes[g].max())}
        storage = data["groups"][g].get("storage")  # the types really written; older maps lack it
        if storage and fmt in storage:
            group["stored_as"] = list(storage[fmt])
        groups.append(group)
    return {
        "cardfit_recipe": RECIPE_VERSION,
        "map": {"sha256": map_hash(data), "model": data["model"], "calibration": data["calibration"],
                "rounding": data["rounding"], "damage": data["damage"]},
        "runtime": data.get("runtime"),
        "served_by": problem.runtime,
        "constraints": {"formats": list(formats) if formats else None, "pins": dict(pins or {}),
                        "floors": dict(floors or {})},
        "budget": {"weight_budget_bytes": int(weight_budget), **(budget_info or {})},
        "solver": {"method": "MILP (HiGHS via scipy.optimize.milp)", "optimality_gap": solution.gap,
                   "proven_optimal": solution.gap == 0.0},
        "predicted_damage": solution.damage,
        "bytes": solution.bytes,
        "reserved_bytes": int(reserve_bytes),
        "margin_bytes": int(weight_budget - reserve_bytes - solution.bytes),
        "uniform_bytes": uniform,
        "groups": groups,
    }


# Unquantized types: what 1-D tensors (norms) are stored as beside a group's quantized matrices.
PLAIN_TYPES = ("F32", "F16", "BF16")


def stored_types(group: dict) -> list[str]:
    """What a recipe group is really stored as, its main type first: the chosen format when its matrices
    take it, then the fallbacks taken by rows its block does not divide. Unquantized types (the 1-D
    tensors beside the matrices) are named only when nothing else is: a norm group planned "at Q2_K"
    is ["F32"]. A recipe planned from a map without `storage` gives just its format."""
    stored = group.get("stored_as")
    if not stored:
        return [group["format"]]
    quantized = [t for t in stored if t not in PLAIN_TYPES] or list(stored)
    own = [group["format"]] if group["format"] in quantized else []
    return own + [t for t in quantized if t not in own]


def render_recipe(recipe: dict) -> str:
    top = max(recipe["uniform_bytes"], key=recipe["uniform_bytes"].get)
    # Each group counts at what it is stored as (a norm kept in F32 as F32); a recipe without `stored_as`
    # counts a group stored the same whatever the format at the top format, as before.
    shown = [stored_types(g)[0] if g.get("stored_as") else top if g["bytes"] == g.get("largest_bytes") else g["format"]
             for g in recipe["groups"]]
    counts: dict[str, int] = {}
    for fmt in shown:
        counts[fmt] = counts.get(fmt, 0) + 1
    # A downgrade is a group stored smaller than at the top format; one whose bytes no format changes is none.
    downgrades = sum(1 for g in recipe["groups"] if g["format"] != top and g["bytes"] != g.get("largest_bytes"))
    lines = [f"weight budget {format_bytes(recipe['budget']['weight_budget_bytes'])}",
             f"result {format_bytes(recipe['bytes'])}, " + " and ".join(f"{n} at {f}" for f, n in counts.items()),
             f"downgrades from {top}: {downgrades}", f"predicted damage {recipe['predicted_damage']:.4f}",
             f"margin {format_bytes(recipe['margin_bytes'])} under",
             f"solver gap {recipe['solver']['optimality_gap']} (proven optimal: {recipe['solver']['proven_optimal']})"]
    return "\n".join(lines)


def uniform_recipe(source, format_name: str, weight_budget: int | None = None) -> dict:
    """Every tensor in one format, as a shelf preset stores it: a recipe `pack` writes without a map.

    Its damage is unknown (nothing was scanned), so `predicted_damage` and each group's damage
    are null; `check` measures what it really loses.
    """
    from .formats import get_format
    from .groups import scan_groups

    fmt = get_format(format_name)
    groups = [{"name": g.name, "format": fmt.name, "damage": None,
               "bytes": sum(fmt.tensor_bytes(t.name, t.shape) for t in g.tensors)}
              for g in scan_groups(source, "layer")]
    total = sum(g["bytes"] for g in groups)
    if weight_budget is None:  # the budget this preset needs, file overhead included
        from .pack import reserve_bytes

        weight_budget = total + reserve_bytes(source, fmt.runtime)
    budget = int(weight_budget)
    model = model_header(source)
    return {"cardfit_recipe": RECIPE_VERSION, "source": "uniform",
            "map": {"sha256": None, "model": model, "calibration": None, "rounding": "rtn"},
            "runtime": fmt.runtime, "budget": {"weight_budget_bytes": budget},
            "solver": None, "predicted_damage": None, "bytes": total, "reserved_bytes": 0,
            "margin_bytes": budget - total, "uniform_bytes": {fmt.name: total}, "groups": groups}


from .stage import callable_stage  # noqa: E402

callable_stage(__name__)
