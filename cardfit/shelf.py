"""llama.cpp's own quantizer (`llama_model_quantize` from llama-cpp-python), for shelf presets
and for cross-checking that cardfit's GGUF tensors are bit-identical to llama.cpp's."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from .errors import CardfitError

# llama_ftype values (llama.h). Presets are llama.cpp's mixes; pure types quantize every matrix alike.
FTYPES = {
    "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12,
    "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "IQ4_NL": 25,
    "IQ4_XS": 30, "BF16": 32,
}
PURE_FTYPE = {"Q3_K": "Q3_K_S", "Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S"}  # base type of the _S mixes


def llama_quantize(source: str | Path, out: str | Path, ftype: str, *, pure: bool = False,
                   imatrix: dict[str, np.ndarray] | None = None, threads: int = 0) -> Path:
    """Run llama.cpp's quantize on a GGUF file, exactly as `llama-quantize` would."""
    import llama_cpp

    name = PURE_FTYPE.get(ftype, ftype) if pure else ftype
    if name not in FTYPES:
        raise CardfitError(f"llama.cpp has no preset '{ftype}'", "known: " + ", ".join(FTYPES))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[name]
    params.nthread = threads
    params.allow_requantize = True
    params.pure = pure
    keep = []
    if imatrix:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (tensor, values) in enumerate(imatrix.items()):
            arr = np.ascontiguousarray(values, dtype=np.float32)
            keep.append(arr)
            entries[i].name = tensor.encode()
            entries[i].data = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = arr.size
        entries[len(imatrix)].name = None
        keep.append(entries)
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise CardfitError(f"llama.cpp's quantize failed on {source} (code {rc})", "see llama.cpp's log above")
    return Path(out)
