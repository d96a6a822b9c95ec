"""llama.cpp's GGUF tensor types, quantized by ggml itself.

Every number about a ggml type (its enum value, its block and block bytes, the llama.cpp file
type that stores it) is read from gguf-py's tables; this module adds only cardfit's menu of types
and llama.cpp's fallback rule for rows its block does not divide.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from .base import Calibration, Format, numel

# cardfit's menu: the ggml types it offers for llama.cpp, best first. The one list of their names.
GGUF_TYPES = ("F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "IQ4_XS", "IQ4_NL",
              "Q3_K", "Q2_K")
STORAGE_TYPES = ("F32",) + GGUF_TYPES  # what a tensor cardfit writes can be stored as (1-D tensors stay F32)


def ggml_type(type_name: str) -> gguf.GGMLQuantizationType:
    """The ggml type (enum ggml_type) of a type name, from gguf-py."""
    return gguf.GGMLQuantizationType[type_name]


# type -> (block elements, bytes per block): gguf-py's GGML_QUANT_SIZES for the types cardfit stores.
GGML_BLOCKS = {name: gguf.GGML_QUANT_SIZES[ggml_type(name)] for name in STORAGE_TYPES}


def llama_file_type(type_name: str) -> int:
    """llama.cpp's file type (llama_ftype, gguf-py's LlamaFileType) whose base type is `type_name`: the
    pure one, or for a k-quant with no pure file type its _S mix (Q4_K -> MOSTLY_Q4_K_S)."""
    types, name = gguf.LlamaFileType.__members__, f"MOSTLY_{type_name}"
    return int(types[name] if name in types else types[f"{name}_S"])


def storage_type(type_name: str, n_per_row: int) -> str:
    """The type a matrix of `type_name` with rows of `n_per_row` is stored as. llama.cpp's
    tensor_type_fallback (src/llama-quant.cpp): a row the type's block does not divide takes a
    32-block type (a 32-block type keeps itself), and F16 if that block does not divide it either.
    tests/test_formats.py checks this against the bundled llama.cpp's own quantize, type by type."""
    if n_per_row % GGML_BLOCKS[type_name][0] == 0:
        return type_name
    fallback = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
                "IQ4_XS": "IQ4_NL"}.get(type_name, type_name)
    return fallback if n_per_row % GGML_BLOCKS[fallback][0] == 0 else "F16"


def ggml_tensor_bytes(type_name: str, shape: tuple[int, ...]) -> int:
    block, size = GGML_BLOCKS[type_name]
    n_per_row = shape[-1]
    assert n_per_row % block == 0, (type_name, shape)
    return numel(shape) // block * size


class GgmlFormat(Format):
    runtime = "llama.cpp"

    def __init__(self, type_name: str):
        self.name = type_name
        block, size = GGML_BLOCKS[type_name]
        self.bits = size * 8 / block

    def storage(self, name: str, shape: tuple[int, ...]) -> str:
        if len(shape) < 2 or "norm" in name:
            return "F32"  # llama.cpp quantizes only matrices; its converter writes 1-D tensors as F32
        return storage_type(self.name, shape[-1])

    def tensor_bytes(self, name: str, shape: tuple[int, ...]) -> int:
        return ggml_tensor_bytes(self.storage(name, shape), shape)

    def methods(self) -> tuple[str, ...]:
        return ("rtn", "imatrix", "awq")

    def quantize(self, name: str, weight: torch.Tensor, calibration: Calibration | None = None,
                 method: str = "rtn") -> tuple[str, np.ndarray]:
        """(storage type, raw bytes) exactly as llama.cpp's quantize would write them."""
        from . import ggml_lib

        storage = self.storage(name, tuple(weight.shape))
        rows = weight.detach().to("cpu", torch.float32).reshape(-1, weight.shape[-1]).numpy()
        if storage == "F32":
            return storage, np.ascontiguousarray(rows, dtype=np.float32).view(np.uint8).reshape(-1)
        imatrix = None
        if method == "imatrix" and calibration is not None and calibration.imatrix is not None:
            imatrix = calibration.imatrix.detach().to("cpu", torch.float32).numpy()
        return storage, ggml_lib.quantize(storage, rows, imatrix)

    def roundtrip(self, name: str, weight: torch.Tensor, calibration: Calibration | None = None,
                  method: str = "rtn") -> torch.Tensor:
        if method == "awq" and self.storage(name, tuple(weight.shape)) != "F32":
            from ..quant import awq_search

            if calibration is None or calibration.inputs is None:
                from ..errors import CardfitError

                raise CardfitError("AWQ needs calibration inputs", "pass --calibration TEXT or use --method rtn")
            w = weight.detach().to(torch.float32)
            scale = awq_search([w], calibration.inputs, lambda m: self._roundtrip(name, m, None, "rtn"))
            return self._roundtrip(name, w * scale, None, "rtn") / scale
        return self._roundtrip(name, weight, calibration, method)

    def _roundtrip(self, name, weight, calibration, method) -> torch.Tensor:
        from . import ggml_lib

        storage, raw = self.quantize(name, weight, calibration, method)
        if storage == "F32":
            return weight.detach().to(torch.float32).clone()
        rows = numel(tuple(weight.shape)) // weight.shape[-1]
        values = ggml_lib.dequantize(storage, raw, (rows, weight.shape[-1]))
        return torch.from_numpy(values).reshape(weight.shape).to(weight.device)
