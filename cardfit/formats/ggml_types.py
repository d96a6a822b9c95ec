"""The ggml types cardfit offers for llama.cpp and what gguf-py's tables say of them (enum, block, bytes)."""

from __future__ import annotations

import gguf

# cardfit's menu: the ggml types it offers for llama.cpp, best first. The one list of their names.
GGUF_TYPES = ("F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "IQ4_XS", "IQ4_NL",
              "MXFP4", "Q3_K", "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")
# The types llama.cpp's quantize refuses without an importance matrix (src/llama-quant.cpp, "Missing importance
# matrix for tensor ... in a very low-bit quantization"); ggml's own quantizer aborts on IQ2_XXS, IQ2_XS and
# IQ1_S (ggml_quantize_requires_imatrix). tests/test_formats.py checks both against the bundled llama.cpp.
IMATRIX_TYPES = ("IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")
STORAGE_TYPES = ("F32",) + GGUF_TYPES  # what a tensor cardfit writes can be stored as (1-D tensors stay F32)
# The i-quants: ggml rounds each block by a search (IQ4_NL and IQ4_XS try 16 scales per 32 values,
# quantize_row_iq4_nl_impl; the lower ones a lattice of grid points), about 6 M values a second a core against
# 50-200 M for the other types (bench/roundtrip_costs.py): the cheap signal prices them from a sample of blocks.
SEARCHED_TYPES = tuple(name for name in GGUF_TYPES if name.startswith("IQ"))


def ggml_type(type_name: str) -> gguf.GGMLQuantizationType:
    """The ggml type (enum ggml_type) of a type name, from gguf-py."""
    return gguf.GGMLQuantizationType[type_name]


# type -> (block elements, bytes per block): gguf-py's GGML_QUANT_SIZES for the types cardfit stores.
GGML_BLOCKS = {name: gguf.GGML_QUANT_SIZES[ggml_type(name)] for name in STORAGE_TYPES}
