"""The plain weight-magnitude signal: Σ ||W - Q(W)||² over a group's matrices, no calibration text at all.

The baseline every data-aware signal should beat (it is what a size-only allocator sees): it knows how far
each format moves the weights, not how much the model's output cares. RTN rounding only, since the formats
that need an importance matrix cannot round without a walk."""

from __future__ import annotations

import torch

from .base import Done, PricingJob, Signal

METRIC = "||W - Q(W)||^2 (squared weight error), summed over the group's matrices"


def group_magnitude(source, group, formats: list) -> dict[str, float]:
    """{format: Σ over the group's quantizable matrices of the squared RTN rounding error}, float64."""
    damage = dict.fromkeys((f.name for f in formats), 0.0)
    for tensor in group.quantizable:
        weight = source.read(tensor.name)
        for fmt in formats:
            if fmt.storage(tensor.name, tensor.shape) == "F32":
                continue
            rounded = fmt.roundtrip(tensor.name, weight, None, "rtn")
            damage[fmt.name] += float((rounded.to(torch.float64) - weight.to(torch.float64)).square().sum())
    return damage


class MagnitudeSignal(Signal):
    name = "magnitude"
    help = "plain squared weight error, no calibration text: a baseline; RTN rounding"
    description = "magnitude (plain squared weight error; no calibration text, a baseline)"
    metric = METRIC
    mark = "magnitude"

    def prices(self, formats: list, rounding: str) -> bool:
        return all(f.method_for(rounding) == "rtn" for f in formats)

    def refusal(self, formats: list, rounding: str) -> str:
        if rounding != "rtn":
            return f"the magnitude signal prices plain RTN rounding, not {rounding}"
        needing = [f.name for f in formats if f.method_for(rounding) != "rtn"]
        verb = "rounds" if len(needing) == 1 else "round"
        return f"the magnitude signal cannot price {', '.join(needing)}, which {verb} only with an importance matrix"

    def price(self, job: PricingJob, todo: list, done: Done) -> None:
        from ...groups import pending_by_group

        for index, formats in pending_by_group(todo).items():
            done(index, group_magnitude(job.source, job.groups[index], formats))
