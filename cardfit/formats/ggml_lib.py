"""ctypes binding to ggml's own quantizers inside llama-cpp-python's shared library.

Pricing a layer with anything but the quantizer llama.cpp itself runs would make the
sensitivity map lie, so cardfit calls `ggml_quantize_chunk` and the type traits'
`to_float` directly instead of reimplementing k-quants.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..errors import CardfitError
from .ggml_types import GGML_BLOCKS, SEARCHED_TYPES, ggml_type


class _TypeTraits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)

# ggml quantizes rows independently and its quantization tables initialise themselves thread-safely
# (ggml.h), which is how llama_model_quantize spreads a tensor over threads; ctypes drops the GIL for the
# call, so row spans on a thread pool give the same bytes on every core the process may use (1.7-1.9x on
# 2 cores for a 8960x1536 Q4_K). Dequantizing stays one call: it takes milliseconds, and measured on
# threads it was 10x slower. Below this many values a thread hand-off costs more than it saves.
PARALLEL_MIN_VALUES = 1 << 20
SEARCHED_MIN_VALUES = PARALLEL_MIN_VALUES >> 4  # an i-quant's rounding searches, 10-30x slower a value: a
# block sample of a large matrix (fisher.sampled_kl) or a small projection is worth its rows' spread


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=_cores(), thread_name_prefix="ggml-rows")


def _row_spans(nrows: int, n_per_row: int, least: int | None = None) -> list[tuple[int, int]]:
    """(first row, rows) per worker: one span for matrices under `least` values (PARALLEL_MIN_VALUES), else
    one per core."""
    workers = _cores() if nrows * n_per_row >= (PARALLEL_MIN_VALUES if least is None else least) else 1
    step = -(-nrows // max(1, min(workers, nrows)))
    return [(first, min(step, nrows - first)) for first in range(0, nrows, step)] or [(0, 0)]


@lru_cache(maxsize=1)
def _item_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=_cores(), thread_name_prefix="ggml-items")


def over_items(work, items: list, values: int) -> list:
    """`work` over `items` (say, one tensor's formats), in order, on a thread per core when one item's matrix
    of `values` is too small for ggml to spread its rows (PARALLEL_MIN_VALUES); a pool apart from the rows'
    one, so an item that does spread its rows never waits on itself."""
    if values >= PARALLEL_MIN_VALUES or len(items) < 2 or _cores() < 2:
        return [work(item) for item in items]
    return list(_item_pool().map(work, items))


def _over_rows(work, nrows: int, n_per_row: int, least: int | None = None) -> list:
    spans = _row_spans(nrows, n_per_row, least)
    if len(spans) == 1:
        return [work(*spans[0])]
    return list(_pool().map(lambda span: work(*span), spans))


@lru_cache(maxsize=1)
def ggml() -> ctypes.CDLL:
    try:
        import llama_cpp
    except ImportError:
        raise CardfitError("llama-cpp-python is not installed, so GGUF formats are unavailable",
                           "pip install llama-cpp-python") from None
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    candidates = sorted(lib_dir.glob("libggml-base.*")) + sorted(lib_dir.glob("libggml.*"))
    for candidate in candidates:
        try:
            lib = ctypes.CDLL(str(candidate), mode=ctypes.RTLD_GLOBAL)
            lib.ggml_quantize_chunk  # noqa: B018 - probe the symbol
            break
        except (OSError, AttributeError):
            continue
    else:
        raise CardfitError(f"no ggml library with ggml_quantize_chunk under {lib_dir}",
                           "reinstall llama-cpp-python")
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_type_name.restype = ctypes.c_char_p
    lib.ggml_type_name.argtypes = [ctypes.c_int]
    # gguf-py's enum values and block sizes must be this libggml's, or cardfit would price and
    # quantize one type and label it another.
    for name, (block, size) in GGML_BLOCKS.items():
        value = ggml_type(name).value
        actual = lib.ggml_type_name(value).decode()
        if actual.upper() != name:
            raise CardfitError(f"this ggml numbers type {value} as {actual}, gguf-py as {name}",
                               "install gguf and llama-cpp-python releases cardfit supports")
        t = lib.ggml_get_type_traits(value).contents
        if (t.blck_size, t.type_size) != (block, size):
            raise CardfitError(f"this ggml stores {name} in blocks of {t.blck_size} elements and {t.type_size} "
                               f"bytes, gguf-py in {block} and {size}",
                               "install gguf and llama-cpp-python releases cardfit supports")
    return lib


def traits(type_name: str) -> _TypeTraits:
    return ggml().ggml_get_type_traits(ggml_type(type_name)).contents


def row_size(type_name: str, n_per_row: int) -> int:
    return int(ggml().ggml_row_size(ggml_type(type_name), n_per_row))


def requires_imatrix(type_name: str) -> bool:
    """ggml's own word: its quantizer asserts (aborts the process) without quantization weights."""
    return bool(ggml().ggml_quantize_requires_imatrix(ggml_type(type_name)))


def quantize(type_name: str, rows: np.ndarray, imatrix: np.ndarray | None = None) -> np.ndarray:
    """llama.cpp's quantization of a (nrows, n_per_row) f32 matrix -> the raw block bytes."""
    if imatrix is None and requires_imatrix(type_name):
        raise CardfitError(f"ggml quantizes {type_name} only with an importance matrix",
                           "round with --method imatrix or pass --imatrix FILE")
    src = np.ascontiguousarray(rows, dtype=np.float32)
    nrows, n_per_row = src.shape
    out = np.empty(nrows * row_size(type_name, n_per_row), dtype=np.uint8)
    imat = None
    if imatrix is not None:
        imat = np.ascontiguousarray(imatrix, dtype=np.float32)
        if imat.shape != (n_per_row,):
            raise ValueError(f"imatrix has {imat.shape}, expected ({n_per_row},)")
    kind, chunk = ggml_type(type_name), ggml().ggml_quantize_chunk
    imat_data = None if imat is None else imat.ctypes.data
    written = sum(_over_rows(lambda first, rows: chunk(kind, src.ctypes.data, out.ctypes.data, first * n_per_row,
                                                        rows, n_per_row, imat_data), nrows, n_per_row,
                                SEARCHED_MIN_VALUES if type_name in SEARCHED_TYPES else None))
    if written != out.nbytes:
        raise RuntimeError(f"ggml wrote {written} bytes for {type_name}, expected {out.nbytes}")
    return out


def dequantize(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The f32 values llama.cpp reads back from raw block bytes."""
    raw = np.ascontiguousarray(data, dtype=np.uint8)
    if type_name == "F32":
        return raw.view(np.float32).reshape(shape).copy()
    t = traits(type_name)
    nrows, n_per_row = shape
    out = np.empty(shape, dtype=np.float32)
    if t.to_float is None:
        raise CardfitError(f"ggml has no dequantizer for {type_name}", "choose another format")
    fn = _TO_FLOAT(t.to_float)
    fn(raw.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), nrows * n_per_row)
    return out
