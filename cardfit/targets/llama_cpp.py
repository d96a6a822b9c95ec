"""llama.cpp: GGUF files, quantized by ggml itself (also what Ollama and LM Studio run)."""

from __future__ import annotations

from pathlib import Path

from .base import MiB, Target


def llama_cpp_overhead(geometry, vram: int, context: int, settings) -> dict[str, int]:
    """CUDA backend: the context and cuBLAS workspace, and the compute buffer for one micro-batch
    (logits, FFN and attention activations in f32); without flash attention the K·Q scores too."""
    ffn = 2 * (geometry.intermediate_size or 4 * geometry.hidden_size)
    attn = 4 * geometry.hidden_size
    terms = {"cuda_context": settings.cuda_context if settings.cuda_context is not None else 384 * MiB}
    buffer = 4 * settings.n_ubatch * (geometry.vocab_size + ffn + attn)
    if not settings.flash_attention:
        buffer += 4 * settings.n_ubatch * context * geometry.num_heads
    terms["compute_buffer"] = buffer
    return terms


def load_gguf(path: Path, n_ctx: int = 512, device: str = "cpu"):
    from .runtimes import GgufRuntime

    return GgufRuntime(path, n_ctx)


def gguf_target(name: str, summary: str, **changes) -> Target:
    """A runtime that loads cardfit's GGUF files as llama.cpp does."""
    from ..formats import GGUF_TYPES

    fields = dict(name=name, summary=summary, family="llama.cpp", formats=GGUF_TYPES, artifact="gguf",
                  pack_methods=("rtn", "imatrix"), kv_dtypes=("f32", "f16", "bf16", "q8_0", "q4_0"),
                  state_element_bytes=4, default_scan_formats="Q8_0,Q4_K,Q2_K",
                  whole_menu="Q8_0,Q6_K,Q5_K,Q5_1,Q5_0,Q4_K,Q4_1,Q4_0,IQ4_XS,Q3_K,Q2_K",
                  low_bit_scan_formats="IQ3_XXS,IQ2_XXS,IQ1_M", artifact_name="model.gguf",
                  overhead_terms=llama_cpp_overhead, load=load_gguf)
    fields.update(changes)
    return Target(**fields)


TARGET = gguf_target("llama.cpp", "llama.cpp (llama-cpp-python, llama-server): a GGUF file", reads_by_default="gguf")
