"""A sum over a large matrix's units (ggml blocks, whole rows) from an exact price of a seeded sample of them.

Both cheap signals price a cell as a sum over a matrix of weighted squared rounding errors; rounding is the
expensive part, and for a large matrix a sample of its units carries the sum within a few percent
(docs/benchmarks.md, bench/sampled_pricing.py). Units are drawn with a probability that follows a cheap
guess of their price (a tenth spread evenly), weighted by the inverse of that probability
(Horvitz-Thompson), and the result ratio-scaled by the guide's whole sum over the draw's estimate of it.
The draw states its own standard error; where that is over MAX_RELATIVE_ERROR the matrix is priced whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

SAMPLE_SHARE = 16  # a sampled price comes from about one unit in this many ...
SAMPLE_FLOOR = 1 << 18  # ... but never from fewer values than this, and a matrix under twice it is priced whole
UNIFORM_SHARE = 0.1  # of the drawing spread evenly: no drawn unit weighs over 10x what an even draw's would


def worth_sampling(values: int) -> bool:
    """Whether a matrix of `values` is large enough that a sample of it is priced instead of the whole."""
    return values >= 2 * SAMPLE_FLOOR


def values_rounded(values: int, sampled: bool) -> int:
    """About how many of a matrix's `values` its price rounds, drawn from a sample or not (what decides how its
    rounding is threaded)."""
    return max(SAMPLE_FLOOR, values // SAMPLE_SHARE) if sampled and worth_sampling(values) else values


def units_wanted(units: int, values_per_unit: int) -> int:
    """How many of a matrix's `units` a sample draws: one in SAMPLE_SHARE, at least SAMPLE_FLOOR values."""
    return min(units, max(-(-SAMPLE_FLOOR // values_per_unit), units // SAMPLE_SHARE))


def sampled_total(guide: torch.Tensor, price: Callable[[torch.Tensor], torch.Tensor], wanted: int,
                  seed: int = 0) -> tuple[float, float]:
    """(Σ of every unit's price, its standard error), estimated from `price(indices)` (the exact prices of the
    drawn units, float64) of `wanted` units drawn in proportion to `guide` (each unit's expected price up to
    one constant; float64). One seeded draw, so a map is reproducible."""
    units = len(guide)
    total = float(guide.sum())
    even = torch.full_like(guide, 1 / units)
    share = (1 - UNIFORM_SHARE) * guide / total + UNIFORM_SHARE * even if total > 0 else even
    inclusion = inclusion_probabilities(share, wanted)
    draw = torch.rand(units, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    taken = (draw < inclusion).nonzero().reshape(-1)
    if len(taken) == 0:  # nothing drawn decides nothing: an unbounded error sends the caller to the whole
        return 0.0, float("inf")
    prices, chance, expected = price(taken), inclusion[taken], guide[taken]
    estimate = float((prices / chance).sum())
    guide_estimate = float((expected / chance).sum())
    if guide_estimate <= 0:
        residual = prices
    else:
        ratio = estimate / guide_estimate
        estimate *= total / guide_estimate
        residual = prices - ratio * expected
    variance = float(((1 - chance) / chance.square() * residual.square()).sum())  # Poisson sampling's
    return estimate, variance ** 0.5


MAX_RELATIVE_ERROR = 0.02  # a sampled price whose standard error is larger than this share is priced whole
EARLY = 4  # a first draw of a quarter of the sample, which alone prices the matrix where it decides the sum


def sampled_or_whole(guide: torch.Tensor, price: Callable[[torch.Tensor], torch.Tensor], wanted: int,
                     whole: Callable[[], float], seed: int = 0) -> float:
    """sampled_total's estimate from a first draw of `wanted // EARLY` units where that decides the sum to
    MAX_RELATIVE_ERROR (and is not zero), else from `wanted` units where that does, else `whole()`. The stated
    error comes from the drawn units alone: a matrix whose error sits in a few units the guide does not predict,
    none of them drawn, states a small one (callers price such matrices whole on their own rule: a tensor rounded
    back onto the grid its source stored it on)."""
    early = wanted // EARLY
    if 0 < early < wanted:
        estimate, error = sampled_total(guide, price, early, seed)
        if estimate > 0 and error <= MAX_RELATIVE_ERROR * estimate:  # nothing at all: let more units look
            return estimate
    estimate, error = sampled_total(guide, price, wanted, seed)
    return whole() if error > MAX_RELATIVE_ERROR * abs(estimate) else estimate


def inclusion_probabilities(share: torch.Tensor, wanted: int) -> torch.Tensor:
    """Each unit's probability of being drawn: `wanted` times its share, where that would pass certainty the
    unit is certain and the rest is spread again over the others (the certain set only grows)."""
    inclusion = share * wanted
    for _ in range(64):
        if not bool((inclusion > 1).any()):
            break
        certain = inclusion >= 1
        rest = wanted - int(certain.sum())
        if rest <= 0:
            return certain.to(share.dtype)
        inclusion = torch.where(certain, torch.ones_like(share), share * (rest / share[~certain].sum()))
    return inclusion.clamp_(max=1.0)


def scale_guide(weight: torch.Tensor, column_weight: torch.Tensor | None, width: int = 32,
                rows: int = 4096) -> torch.Tensor:
    """Each row's expected price on a scaled grid, up to one constant: over every `width` values (one scale of
    a ggml type) Σ of the column weights (1 where none) times the largest |w| squared, summed along the row
    (a rounding error's variance goes with the scale squared)."""
    if weight.shape[1] % width:  # a row no scale divides (stored F16): each value its own "scale"
        width = 1
    parts = []
    for start in range(0, weight.shape[0], rows):
        w = weight[start:start + rows].to(torch.float32)
        peak = w.reshape(len(w), -1, width).abs().amax(-1).square().double()
        if column_weight is None:
            parts.append(peak.sum(-1) * width)
        else:
            parts.append(peak @ column_weight.to(torch.float64).reshape(-1, width).sum(-1))
    return torch.cat(parts)
