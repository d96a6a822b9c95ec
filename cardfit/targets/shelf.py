"""llama.cpp's own quantizer (`llama_model_quantize` from llama-cpp-python), for shelf presets
and for cross-checking that cardfit's GGUF tensors are bit-identical to llama.cpp's."""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np

from ..errors import CardfitError
from ..formats.ggml_types import GGUF_TYPES, IMATRIX_TYPES
from ..formats.gguf_formats import file_type_base, llama_file_type


def _presets() -> dict[str, int]:
    """llama.cpp's presets built on cardfit's menu, name -> llama_ftype (gguf-py's LlamaFileType): each
    menu type with a file type of its own (Q6_K, IQ2_XXS, ...) and the mixes built on a menu type (Q4_K_M,
    IQ2_M, IQ3_M, ...), less Q2_K_S (a mix llama.cpp makes only with an imatrix, of no type on the menu)
    and MXFP4_MOE (MXFP4 for MoE experts only: on a dense model, not a preset anyone downloads)."""
    presets = {}
    for file_type in gguf.LlamaFileType:
        name = file_type.name.removeprefix("MOSTLY_")
        if name not in ("Q2_K_S", "MXFP4_MOE") and file_type.name.startswith("MOSTLY_") and file_type_base(name) in GGUF_TYPES:
            presets[name] = int(file_type)
    return presets


def preset_needs_imatrix(preset: str) -> bool:
    """llama.cpp's quantize refuses this preset without an importance matrix (its base type needs one)."""
    return file_type_base(preset) in IMATRIX_TYPES


# Presets are llama.cpp's mixes; a pure quantize (`pure=True`) stores every matrix in the base type.
FTYPES = _presets()


def llama_quantize(source: str | Path, out: str | Path, ftype: str, *, pure: bool = False,
                   imatrix: dict[str, np.ndarray] | None = None, threads: int = 0) -> Path:
    """Run llama.cpp's quantize on a GGUF file, exactly as `llama-quantize` would."""
    import llama_cpp

    if pure and ftype in GGUF_TYPES:
        file_type = llama_file_type(ftype)  # its pure file type, or the _S mix whose base type it is
    elif ftype in FTYPES:
        file_type = FTYPES[ftype]
    else:
        raise CardfitError(f"llama.cpp has no preset '{ftype}'", "known: " + ", ".join(FTYPES))
    if not imatrix and preset_needs_imatrix(ftype):
        raise CardfitError(f"llama.cpp quantizes {ftype} only with an importance matrix",
                           "pass an imatrix (compare --imatrix; cardfit imatrix makes one)")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = file_type
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
