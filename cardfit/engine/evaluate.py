"""Measure a quantized model against its reference over token chunks, on the engine (one layer read per walk)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .metrics import DistanceMeter


@torch.no_grad()
def reference_logits(engine, chunks: torch.Tensor, batch: int = 4) -> list[torch.Tensor]:
    return [engine.forward(chunks[i:i + batch]) for i in range(0, len(chunks), batch)]


@torch.no_grad()
def measure(engine, chunks: torch.Tensor, overrides: Mapping[str, torch.Tensor] | None,
            reference: list[torch.Tensor] | None = None, batch: int = 4, keep_values: bool = False) -> DistanceMeter:
    meter = DistanceMeter()
    for k, i in enumerate(range(0, len(chunks), batch)):
        ids = chunks[i:i + batch]
        ref = reference[k] if reference is not None else engine.forward(ids)
        meter.add(ref, engine.forward(ids, overrides), ids, keep_values=keep_values)
    return meter
