"""Reading and validating sensitivity maps (the JSON `scan` writes; schema in docs/formats.md)."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import CardfitError


def read_json(path: str | Path, what: str, producer: str):
    """A JSON artifact another stage wrote, or one clear error naming the stage that makes it."""
    path = Path(path)
    if not path.is_file():
        raise CardfitError(f"no {what} at {path}", f"run {producer} first")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CardfitError(f"{path} is not valid JSON ({exc})", f"re-run {producer}") from None


def read_map(path: str | Path) -> dict:
    data = read_json(path, "sensitivity map", "cardfit scan")
    validate_map(data, str(path))
    return data


def validate_map(data, where: str = "map") -> None:
    """The map's schema (cardfit.schemas.SensitivityMap): one line naming the first bad field."""
    from .schemas import SensitivityMap, validate

    validate(SensitivityMap, data, where, "re-run cardfit scan; do not edit maps by hand")


def check_map_model(data: dict, source) -> None:
    """Refuse a map measured on another model (fingerprint of config and tensor index), or on other weights of
    the same architecture (the weights sample, where the map records one)."""
    if source.fingerprint() != data["model"]["fingerprint"]:
        raise CardfitError(f"the map was scanned on another model ({data['model'].get('name')}), "
                           f"not {source.path.name}", "scan this model, or pass the model the map was made on")
    recorded = data["model"].get("weights")
    if recorded is not None and recorded != source.weights_sample():
        raise CardfitError(f"the map was scanned on other weights of this architecture ({data['model'].get('name')}: "
                           f"another checkpoint or a fine-tune), not {source.path.name}'s",
                           "scan this model, or pass the checkpoint the map was made on")
