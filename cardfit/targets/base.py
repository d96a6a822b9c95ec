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

from ..errors import CardfitError

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
    # Routed experts in the file it loads: which formats one may take (None: any it serves), and whether every
    # expert stack of the model must share one (the planner's constraints, pack's refusals)
    expert_format: Callable[[str], bool] | None = None
    one_expert_format: bool = False
    default_scan_formats: str = ""  # fit's exact scan menu (plus the source's own quantized types)
    whole_menu: str = ""  # every type worth pricing: compare's map and fit --scan-method adaptive
    low_bit_scan_formats: str = ""  # added to fit's scan when the budget is below what the default menu reaches
    artifact_name: str = ""  # fit's file name for the artifact
    overhead_terms: Callable | None = None  # (geometry, vram, context, settings) -> {term: bytes}
    load: Callable | None = None  # (path, n_ctx, device) -> a runtime with logits(ids) and close()
    beside: Callable[[Path, dict], dict[str, str]] | None = None  # files written next to the artifact
    reads_by_default: str | None = None  # the kind of file `check` runs in it unless told otherwise

    def refuse_expert_formats(self, formats: dict) -> None:
        """A recipe (hand-made, or planned before these rules) giving routed experts a format, or several,
        that this target's file cannot hold: one line before anything is written."""
        from ..groups import expert_stack

        given = {f.name for name, f in formats.items() if expert_stack(name)}
        wrong = sorted(f for f in given if self.expert_format is not None and not self.expert_format(f))
        if wrong:
            raise CardfitError(f"routed experts in {', '.join(wrong)}: {self.name} loads experts only in "
                               f"{', '.join(f for f in self.formats if self.expert_format(f))}",
                               "re-plan the recipe (cardfit plan keeps experts to these)")
        if self.one_expert_format and len(given) > 1:
            raise CardfitError(f"the routed experts are in {len(given)} formats ({', '.join(sorted(given))}); "
                               f"{self.name}'s file holds one for every expert", "re-plan the recipe (cardfit plan ties them)")
