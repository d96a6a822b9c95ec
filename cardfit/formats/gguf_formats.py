"""llama.cpp's GGUF tensor types, quantized by ggml itself."""

from __future__ import annotations

import numpy as np
import torch

from .base import Calibration, Format, numel

# type -> (block elements, bytes per block); the same numbers ggml's type traits give (tested).
GGML_BLOCKS = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q8_0": (32, 34), "Q5_1": (32, 24), "Q5_0": (32, 22),
    "Q4_1": (32, 20), "Q4_0": (32, 18), "IQ4_NL": (32, 18), "Q6_K": (256, 210), "Q5_K": (256, 176),
    "Q4_K": (256, 144), "IQ4_XS": (256, 136), "Q3_K": (256, 110), "Q2_K": (256, 84),
}

# llama.cpp's tensor_type_fallback (src/llama-quant.cpp): a row that is not a multiple of
# the type's block takes this 32-block type, and F16 if even that does not divide it.
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}
FLOAT_TYPES = ("F32", "F16", "BF16")


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
        target = self.name
        n_per_row = shape[-1]
        if n_per_row % GGML_BLOCKS[target][0]:
            target = FALLBACK.get(target, target)
            if n_per_row % GGML_BLOCKS[target][0]:
                target = "F16"
        return target

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
