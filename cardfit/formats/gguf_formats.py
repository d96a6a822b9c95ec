"""llama.cpp's GGUF tensor types, quantized by ggml itself.

Every number about a ggml type (its enum value, its block and block bytes, the llama.cpp file
type that stores it) is read from gguf-py's tables; this module adds only cardfit's menu of types
and llama.cpp's fallback rule for rows its block does not divide.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from . import ggml_lib
from .base import Calibration, Format, numel
from .ggml_types import GGML_BLOCKS, IMATRIX_TYPES



def _router_pattern():
    """An MoE router (llama.cpp's `ffn_gate_inp`) under any of the checkpoint names gguf-py maps to it:
    llama.cpp's converter writes it F32 and its quantize never rounds it ("do not quantize expert gating
    tensors", src/llama-quant.cpp)."""
    import re

    from gguf.tensor_mapping import TensorNameMap

    names = TensorNameMap.block_mappings_cfg[gguf.MODEL_TENSOR.FFN_GATE_INP]
    return re.compile("|".join(re.escape(n).replace(re.escape("{bid}"), r"\d+") + r"\.weight$" for n in names))


ROUTER = _router_pattern()




# llama.cpp's file types whose base ggml type is not the one their name says (llama_model_quantize_impl's
# default_type, src/llama-quant.cpp); a k-quant mix (Q4_K_M) is built on its k-quant (Q4_K).
FILE_TYPE_BASES = {"IQ2_S": "IQ2_XS", "IQ2_M": "IQ2_S", "IQ3_XS": "IQ3_S", "IQ3_M": "IQ3_S", "MXFP4_MOE": "MXFP4"}


def file_type_base(file_type: str) -> str:
    """The ggml type a llama.cpp file type (by its name less MOSTLY_: Q4_K_M, IQ2_M) stores most matrices in."""
    if file_type in FILE_TYPE_BASES:
        return FILE_TYPE_BASES[file_type]
    base, _, mix = file_type.rpartition("_")
    return base if mix in ("S", "M", "L") and base.endswith("_K") else file_type


def llama_file_type(type_name: str) -> int:
    """llama.cpp's file type (llama_ftype, gguf-py's LlamaFileType) built on `type_name`: the one of its own
    name if that is built on it, else the first that is (Q4_K -> MOSTLY_Q4_K_S, IQ2_S -> MOSTLY_IQ2_M)."""
    names = [m.removeprefix("MOSTLY_") for m in gguf.LlamaFileType.__members__ if m.startswith("MOSTLY_")]
    built_on = [n for n in names if file_type_base(n) == type_name]
    if not built_on:
        raise KeyError(type_name)
    chosen = type_name if type_name in built_on else built_on[0]
    return int(gguf.LlamaFileType[f"MOSTLY_{chosen}"])


def storage_type(type_name: str, n_per_row: int) -> str:
    """The type a matrix of `type_name` with rows of `n_per_row` is stored as. llama.cpp's
    tensor_type_fallback (src/llama-quant.cpp): a row the type's block does not divide takes a
    32-block type (a 32-block type keeps itself), and F16 if that block does not divide it either.
    tests/test_formats.py checks this against the bundled llama.cpp's own quantize, type by type."""
    if n_per_row % GGML_BLOCKS[type_name][0] == 0:
        return type_name
    fallback = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0",
                **dict.fromkeys(("IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S"),
                                "IQ4_NL")}.get(type_name, type_name)
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
        if len(shape) < 2 or "norm" in name or ROUTER.search(name):
            return "F32"  # llama.cpp quantizes only matrices, and no router; its converter writes those F32
        return storage_type(self.name, shape[-1])

    def tensor_bytes(self, name: str, shape: tuple[int, ...]) -> int:
        return ggml_tensor_bytes(self.storage(name, shape), shape)

    @property
    def needs_imatrix(self) -> bool:
        """Quantized only with an importance matrix (the very-low-bit i-quants): its rounding is always imatrix."""
        return self.name in IMATRIX_TYPES

    def methods(self) -> tuple[str, ...]:
        return ("imatrix",) if self.needs_imatrix else ("rtn", "imatrix", "awq")

    def rows_apart(self, method: str) -> bool:
        """ggml quantizes row by row (its imatrix is per column); AWQ's scale search spans the matrix."""
        return method in ("rtn", "imatrix")

    def quantize(self, name: str, weight: torch.Tensor, calibration: Calibration | None = None,
                 method: str = "rtn") -> tuple[str, np.ndarray]:
        """(storage type, raw bytes) exactly as llama.cpp's quantize would write them."""
        storage = self.storage(name, tuple(weight.shape))
        rows = weight.detach().to("cpu", torch.float32).reshape(-1, weight.shape[-1]).numpy()
        if storage == "F32":
            return storage, np.ascontiguousarray(rows, dtype=np.float32).view(np.uint8).reshape(-1)
        imatrix = importance(name, storage, calibration if method == "imatrix" else None, rows.shape[1])
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
        storage, raw = self.quantize(name, weight, calibration, method)
        if storage == "F32":
            return weight.detach().to(torch.float32).clone()
        return _dequantized(storage, raw, weight)


def _dequantized(storage: str, raw: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    rows = numel(tuple(like.shape)) // like.shape[-1]
    values = ggml_lib.dequantize(storage, raw, (rows, like.shape[-1]))
    return torch.from_numpy(values).reshape(like.shape).to(like.device)


def ggml_roundtrip(storage: str, rows: torch.Tensor) -> torch.Tensor:
    """`rows` (n, row length) stored as the ggml type `storage` itself and read back, RTN: for a caller that
    rounds blocks cut from a matrix (ggml rounds every block of a row apart from the others without an
    importance matrix, so a block comes back as it would inside its matrix; tests/test_fisher.py)."""
    flat = rows.detach().to("cpu", torch.float32).contiguous()
    return _dequantized(storage, ggml_lib.quantize(storage, flat.numpy()), flat)


def importance(name: str, storage: str, calibration: Calibration | None, columns: int) -> np.ndarray | None:
    """The importance matrix ggml rounds `name` with: the calibration's (or, from GPTQ's statistics, the
    Hessian's diagonal, which is the same mean x²); for a type that cannot quantize without one, the
    token embedding (a lookup table: no activation flows into its columns) weighs its columns equally,
    and any other tensor is refused in one line rather than left to ggml's abort."""
    values = None
    if calibration is not None:
        if calibration.imatrix is not None:
            values = calibration.imatrix
        elif calibration.hessian is not None:
            values = torch.diagonal(calibration.hessian)
    if values is not None:
        return values.detach().to("cpu", torch.float32).numpy()
    if storage not in IMATRIX_TYPES:
        return None
    from ..groups import EMBED, group_of

    if group_of(name) == EMBED:
        return np.ones(columns, dtype=np.float32)
    from ..errors import CardfitError

    raise CardfitError(f"{name}: {storage} quantizes only with an importance matrix, and none was given",
                       "pack with --method imatrix or --imatrix FILE (scan and fit collect one themselves)")
