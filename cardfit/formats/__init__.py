"""The format registry: every format by name, with its runtime."""

from __future__ import annotations

from ..errors import CardfitError
from .base import Calibration, Format
from .ggml_types import GGML_BLOCKS, GGUF_TYPES
from .gguf_formats import GgmlFormat
from .int_formats import DenseFormat, IntGroupFormat, is_decoder_linear, is_packed_matrix
from .reference_formats import Int8RowFormat, Nf4Format


def _build() -> dict[str, Format]:
    formats: dict[str, Format] = {name: GgmlFormat(name) for name in GGUF_TYPES}
    for fmt in (IntGroupFormat(8, -1), IntGroupFormat(8, 128), IntGroupFormat(4, 128), IntGroupFormat(4, 128, symmetric=False),
                IntGroupFormat(4, 64), IntGroupFormat(4, 32), IntGroupFormat(3, 128), IntGroupFormat(2, 128),
                DenseFormat("BF16-dense"), Nf4Format(), Int8RowFormat()):
        formats[fmt.name] = fmt
    return formats


FORMATS = _build()
ALIASES = {"W8A16-channel": "W8A16", "W4A16": "W4A16-g128", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0",
           "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K", "Q3_K_M": "Q3_K", "nf4": "NF4", "int8": "INT8"}


def get_format(name: str) -> Format:
    key = ALIASES.get(name, name)
    if key not in FORMATS:
        key = next((k for k in FORMATS if k.lower() == name.lower()), None)
    if key is None:
        raise CardfitError(f"unknown format '{name}'", "known formats: " + ", ".join(FORMATS))
    return FORMATS[key]


def parse_formats(text: str | list[str]) -> list[Format]:
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    if not names:
        raise CardfitError("no formats given", "pass --formats such as Q8_0,Q6_K,Q4_K,Q3_K")
    formats, seen = [], {}
    for name in names:
        fmt = get_format(name)
        if fmt.name in seen:
            raise CardfitError(f"--formats names {fmt.name} twice ('{seen[fmt.name]}' and '{name}')",
                               "list each format once")
        seen[fmt.name] = name
        formats.append(fmt)
    return formats


__all__ = ["FORMATS", "runtime_formats", "GGUF_TYPES", "GGML_BLOCKS", "Calibration", "Format", "GgmlFormat", "IntGroupFormat",
           "DenseFormat", "Nf4Format", "Int8RowFormat", "get_format", "parse_formats", "is_decoder_linear",
           "is_packed_matrix"]

def runtime_formats(runtime: str) -> list[Format]:
    """The formats a runtime serves (its target's menu, cardfit.targets)."""
    from ..targets import get_target

    return [FORMATS[n] for n in get_target(runtime).formats]
