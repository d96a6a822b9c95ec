"""Reading recipes (the JSON `plan` writes; schema in docs/formats.md) and turning them into a
format for every tensor of the model they were planned for."""

from __future__ import annotations

from pathlib import Path

from .errors import CardfitError
from .formats import Format, get_format
from .maps import check_map_model, read_json
from .sizes import priced_tensors
from .groups import EMBED, LM_HEAD, GroupId, expert_stack
from .sources import ModelSource


def read_recipe(path: str | Path) -> dict:
    data = read_json(path, "recipe", "cardfit plan")
    validate_recipe(data, str(path))
    return data


def validate_recipe(data, where: str = "recipe") -> None:
    """The recipe's schema (cardfit.schemas.Recipe): one line naming the first bad field."""
    from .schemas import Recipe, validate

    validate(Recipe, data, where, "re-run cardfit plan; do not edit recipes by hand")


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
        fixed = GroupId.fixed_group(t.group.layer) if len(t.shape) < 2 and t.group.layer is not None else None
        stack = expert_stack(t.name)
        for key in (t.name, stack and stack[0], fixed, group):
            if key is not None and key in chosen:
                out[t.name] = chosen[key]
                break
        else:
            raise CardfitError(f"the recipe names no format for {t.name} (group {group})",
                               "re-plan from a map scanned on this model")
    return out
