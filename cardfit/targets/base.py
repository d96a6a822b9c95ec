"""What cardfit knows about one runtime, in one place: the `Target`.

A target answers every question a stage asks about the runtime it serves: which formats it can
load (the planner's menu), which of them must share a format because the runtime fuses them,
what file it loads (the packer's writer) and what goes beside it, how its KV cache may be stored,
how much memory it takes beside weights and cache (the budget's overhead model), and how
`check`/`bench` run an artifact in it. Stages ask `cardfit.targets.get_target(name)`; no other
module names a runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

MiB = 2**20


@dataclass
class OverheadSettings:
    """The knobs of the runtimes' overhead models (each target reads the ones it has)."""

    cuda_context: int | None = None  # bytes; None = the runtime's default
    n_ubatch: int = 512
    flash_attention: bool = True
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    enforce_eager: bool = False
    cuda_graphs: int = 512 * MiB


@dataclass(frozen=True)
class Target:
    name: str
    summary: str
    family: str  # the file family its formats belong to, and so the maps it plans from: "llama.cpp" or "vllm"
    formats: tuple[str, ...]  # what it serves, by format name (cardfit.formats)
    artifact: str | None = None  # "gguf", "compressed-tensors", or None when nothing is packed for it
    pack_methods: tuple[str, ...] = ()
    kv_dtypes: tuple[str, ...] = ("f16",)
    state_element_bytes: int = 2  # bytes per element of an SSM's recurrent state
    fused: tuple[tuple[str, ...], ...] = ()  # projections it runs as one kernel: they share one format
    default_scan_formats: str = ""  # fit's exact scan menu (plus the source's own quantized types)
    whole_menu: str = ""  # every type worth pricing: compare's map and fit --scan-method adaptive
    low_bit_scan_formats: str = ""  # added to fit's scan when the budget is below what the default menu reaches
    artifact_name: str = ""  # fit's file name for the artifact
    overhead_terms: Callable | None = None  # (geometry, vram, context, settings) -> {term: bytes}
    load: Callable | None = None  # (path, n_ctx, device) -> a runtime with logits(ids) and close()
    beside: Callable[[Path, dict], dict[str, str]] | None = None  # files written next to the artifact
    reads_by_default: str | None = None  # the kind of file `check` runs in it unless told otherwise
