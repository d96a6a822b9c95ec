"""Reading recipes (the JSON `plan` writes; schema in docs/formats.md) and turning them into a
format for every tensor of the model they were planned for."""

from __future__ import annotations

from pathlib import Path

from .errors import CardfitError
from .formats import Format, get_format
from .maps import check_map_model, read_json, valid_damage
from .sizes import priced_tensors
from .sources import EMBED, LM_HEAD, ModelSource


def read_recipe(path: str | Path) -> dict:
    data = read_json(path, "recipe", "cardfit plan")
    validate_recipe(data, str(path))
    return data


def validate_recipe(data, where: str = "recipe") -> None:
    def bad(problem):
        raise CardfitError(f"{where}: {problem}", "re-run cardfit plan; do not edit recipes by hand")

    if not isinstance(data, dict) or data.get("cardfit_recipe") != 1:
        bad("not a cardfit recipe (version 1)")
    if data.get("runtime") not in ("llama.cpp", "vllm"):
        bad(f"unknown runtime {data.get('runtime')!r}")
    model = (data.get("map") or {}).get("model")
    if not isinstance(model, dict) or not isinstance(model.get("fingerprint"), str):
        bad("model fingerprint missing")
    groups = data.get("groups")
    if not isinstance(groups, list) or not groups:
        bad("groups missing")
    seen = set()
    for g in groups:
        if not isinstance(g, dict) or not isinstance(g.get("name"), str) or not isinstance(g.get("format"), str):
            bad("a group lacks a name or a format")
        if g["name"] in seen:
            bad(f"group {g['name']} appears twice")
        seen.add(g["name"])
        size = g.get("bytes")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            bad(f"group {g['name']} has invalid bytes {size!r}")
        get_format(g["format"])  # unknown format names fail with the list of known ones
        damage = g.get("damage")
        if damage is None and data.get("source") == "uniform":  # a shelf preset: nothing was scanned
            continue
        if not valid_damage(damage):
            bad(f"group {g['name']} has invalid damage {damage!r}")
    budget = (data.get("budget") or {}).get("weight_budget_bytes")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget <= 0:
        bad(f"invalid weight budget {budget!r}")


def check_model(recipe: dict, source: ModelSource) -> None:
    """Refuse to apply a recipe to a model other than the one its map was measured on."""
    check_map_model(recipe["map"], source)


def tensor_formats(recipe: dict, source: ModelSource) -> dict[str, Format]:
    """The format of every tensor the artifact stores, from the recipe's per-group choice."""
    chosen = {g["name"]: get_format(g["format"]) for g in recipe["groups"]}
    out: dict[str, Format] = {}
    for t in priced_tensors(source):
        group = t.group
        if group == LM_HEAD and source.tied_embeddings:
            group = EMBED
        for key in (t.name, f"{group}.fixed" if len(t.shape) < 2 else None, group):
            if key is not None and key in chosen:
                out[t.name] = chosen[key]
                break
        else:
            raise CardfitError(f"the recipe names no format for {t.name} (group {group})",
                               "re-plan from a map scanned on this model")
    return out
