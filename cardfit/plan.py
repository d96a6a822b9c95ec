"""Stage 3: the recipe — the map's least summed damage whose bytes fit the budget (solver.py, proven
optimal; the solver's reported gap is stored), or the refusal naming the least that fits."""

from __future__ import annotations

from pathlib import Path

from .errors import CardfitError
from .schemas import RECIPE_VERSION, content_hash, model_header
from .solver import Problem, minimum_bytes, optimum
from .units import format_bytes


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
    solution = optimum(problem, weight_budget - reserve_bytes) if reserve_bytes < weight_budget else None
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
