"""Runtime memory that is neither weights nor KV cache, as a model with stated terms.

None of these numbers were measured on a GPU here (this project's machines have none);
each term is the mechanism the runtime documents, with defaults a user can override.

llama.cpp (CUDA backend):
  cuda_context   the CUDA context, cuBLAS handle and workspace the process creates
                 before any tensor (default 384 MiB; commonly reported 250-500 MiB on
                 CUDA 12 drivers; override with --cuda-context).
  compute_buffer ggml's graph allocator reserves the worst-case ubatch up front:
                 f32 activations of n_ubatch tokens through the widest tensors —
                 logits (n_vocab), FFN gate+up (2 x n_ff) and the attention
                 projections (4 x hidden) — plus, without flash attention, the
                 f32 K·Q score matrix n_ubatch x n_ctx x n_head.
vLLM:
  reserved       (1 - gpu_memory_utilization) x VRAM is never used (default 0.9).
  cuda_context   non-torch memory: CUDA context, NCCL, cuBLAS (default 512 MiB).
  activations    the profiling forward pass at max_num_batched_tokens (default 8192):
                 2-byte activations of FFN gate+up and attention projections, plus
                 f32 sampler logits for max_num_seqs (default 256) sequences.
  cuda_graphs    memory captured CUDA graphs hold (default 512 MiB; 0 with enforce_eager).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .architecture import ModelGeometry
from .errors import CardfitError

MiB = 2**20


@dataclass
class OverheadSettings:
    cuda_context: int | None = None  # bytes; None = the runtime's default
    n_ubatch: int = 512
    flash_attention: bool = True
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    enforce_eager: bool = False
    cuda_graphs: int = 512 * MiB


@dataclass
class Overhead:
    total: int
    terms: dict[str, int] = field(default_factory=dict)


def runtime_overhead(geometry: ModelGeometry, vram: int, context: int, runtime: str,
                     settings: OverheadSettings | None = None) -> Overhead:
    s = settings or OverheadSettings()
    ffn = 2 * (geometry.intermediate_size or 4 * geometry.hidden_size)
    attn = 4 * geometry.hidden_size
    if runtime == "llama.cpp":
        terms = {"cuda_context": s.cuda_context if s.cuda_context is not None else 384 * MiB}
        buffer = 4 * s.n_ubatch * (geometry.vocab_size + ffn + attn)
        if not s.flash_attention:
            buffer += 4 * s.n_ubatch * context * geometry.num_heads
        terms["compute_buffer"] = buffer
    elif runtime == "vllm":
        if not 0 < s.gpu_memory_utilization <= 1:
            raise CardfitError(f"gpu_memory_utilization {s.gpu_memory_utilization} is outside (0, 1]",
                               "use a fraction such as 0.9")
        terms = {
            "reserved": vram - int(vram * s.gpu_memory_utilization),
            "cuda_context": s.cuda_context if s.cuda_context is not None else 512 * MiB,
            "activations": 2 * s.max_num_batched_tokens * (ffn + attn) + 4 * s.max_num_seqs * geometry.vocab_size,
            "cuda_graphs": 0 if s.enforce_eager else s.cuda_graphs,
        }
    else:
        raise CardfitError(f"unknown runtime '{runtime}'", "use --runtime llama.cpp or --runtime vllm")
    return Overhead(total=sum(terms.values()), terms=terms)
