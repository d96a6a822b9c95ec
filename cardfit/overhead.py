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
from .targets import OverheadSettings, get_target

__all__ = ["Overhead", "OverheadSettings", "runtime_overhead"]


@dataclass
class Overhead:
    total: int
    terms: dict[str, int] = field(default_factory=dict)


def runtime_overhead(geometry: ModelGeometry, vram: int, context: int, runtime: str,
                     settings: OverheadSettings | None = None) -> Overhead:
    """The runtime's own memory, from its target's overhead model (the terms above)."""
    target = get_target(runtime)
    if target.overhead_terms is None:
        from .targets import names

        raise CardfitError(f"{runtime} has no overhead model (it is not a serving runtime)",
                           "budget for one of: " + ", ".join(names(budget=True)))
    terms = target.overhead_terms(geometry, vram, context, settings or OverheadSettings())
    return Overhead(total=sum(terms.values()), terms=terms)
