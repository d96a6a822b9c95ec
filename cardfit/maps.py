"""Reading and validating sensitivity maps (the JSON `scan` writes; schema in docs/formats.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .errors import CardfitError


def read_json(path: str | Path, what: str, producer: str):
    """A JSON artifact another stage wrote, or one clear error naming the stage that makes it."""
    path = Path(path)
    if not path.is_file():
        raise CardfitError(f"no {what} at {path}", f"run {producer} first")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CardfitError(f"{path} is not valid JSON ({exc})", f"re-run {producer}") from None


def read_map(path: str | Path) -> dict:
    data = read_json(path, "sensitivity map", "cardfit scan")
    validate_map(data, str(path))
    return data


def valid_damage(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def validate_map(data, where: str = "map") -> None:
    def bad(problem):
        raise CardfitError(f"{where}: {problem}", "re-run cardfit scan; do not edit maps by hand")

    if not isinstance(data, dict) or data.get("cardfit_map") != 1:
        bad("not a cardfit sensitivity map (version 1)")
    formats = data.get("formats")
    if not isinstance(formats, list) or not formats or not all(isinstance(f, str) for f in formats):
        bad("formats missing")
    groups = data.get("groups")
    if not isinstance(groups, list) or not groups:
        bad("groups missing")
    seen = set()
    for g in groups:
        if not isinstance(g, dict) or not isinstance(g.get("name"), str):
            bad("a group has no name")
        if g["name"] in seen:
            bad(f"group {g['name']} appears twice")
        seen.add(g["name"])
        sizes = g.get("bytes")
        if not isinstance(sizes, dict):
            bad(f"group {g['name']} has no bytes")
        for f in formats:
            size = sizes.get(f)
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                bad(f"group {g['name']} has invalid bytes {size!r} for {f}")
        cells = g.get("cells")
        if not isinstance(cells, dict):
            bad(f"group {g['name']} has no cells")
        for f, cell in cells.items():
            if f not in formats or not isinstance(cell, dict):
                bad(f"group {g['name']} has a cell for unknown format {f!r}")
            if not valid_damage(cell.get("damage")):
                bad(f"group {g['name']} @ {f} has invalid damage {cell.get('damage')!r}")
    model = data.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("fingerprint"), str):
        bad("model fingerprint missing")


def check_map_model(data: dict, source) -> None:
    """Refuse a map measured on another model (fingerprint of config and tensor index)."""
    if source.fingerprint() != data["model"]["fingerprint"]:
        raise CardfitError(f"the map was scanned on another model ({data['model'].get('name')}), "
                           f"not {source.path.name}", "scan this model, or pass the model the map was made on")
