"""The weight-space signal: each matrix's quantization error weighted by what its inputs carry.

For y = W x the output error of a perturbation δW is δW x; its mean square over the calibration
tokens, keeping only the diagonal of E[x xᵀ], is Σ_j E[x_j²] Σ_i δW_ij²: llama.cpp's importance
matrix (mean x² per input column) weighting the squared weight error, the quantity ggml's
quantizers minimize and the one llama.cpp's automatic allocator (`llama-quantize --target-bpw`)
sums. A cell's damage is that expected squared output error per token, summed over the group's
matrices. A routed expert's error reaches the layer's output only for the tokens routed to it, scaled
by their routing weight: its columns weigh (routing weight x input)^2 summed over its tokens and divided
by all the layer's tokens (quant/experts.py), so an expert stack's cell is its expected share per token.
The token embedding is a lookup, so its input is one-hot: a row weighs by how often its
token occurs in the calibration text (and, when tied, also as the head, by the final norm's mean x²).

Cost: one walk of the calibration tokens through the unquantized model, layer by layer (the
imatrix collection), plus one quantization per cell and distinct rounding; no forward pass per cell. A large
matrix whose rounding treats each row apart (`Format.rows_apart`: every ggml type, RTN or imatrix) is
priced from a seeded sample of its rows (sampling.py), the imatrix unchanged since rows keep their columns. Its units are
squared activations, not nats: cells rank within one map and plan as they are, but are not KL.
"""

from __future__ import annotations

import torch

from ...formats import Calibration, Format
from ...groups import EMBED, LM_HEAD
from .base import Done, PricingJob, Signal
from .sampling import sampled_or_whole, scale_guide, units_wanted, values_rounded, worth_sampling

METRIC = "E||dW x||^2 per token (imatrix-weighted squared weight error), summed over the group's matrices"


def weighted_error(original: torch.Tensor, quantized: torch.Tensor, column_weight: torch.Tensor | None = None,
                   row_weight: torch.Tensor | None = None) -> float:
    """Σ_ij r_i c_j (Q(W) - W)_ij² in float64 sums: c = mean x² per input column (a matmul's imatrix),
    r = how often each row is looked up (an embedding's token frequencies); absent weights are 1."""
    return float(row_errors(original, quantized, column_weight, row_weight).sum())


def token_frequencies(chunks: torch.Tensor, vocab: int) -> torch.Tensor:
    """Share of calibration tokens that are each vocabulary entry: the embedding's one-hot E[x_j²]."""
    counts = torch.bincount(chunks.reshape(-1).to(torch.int64), minlength=vocab)[:vocab]
    return counts.to(torch.float64) / max(int(chunks.numel()), 1)


def weight_cells(source, chunks: torch.Tensor, groups: list, todo: list, rounding: str, device: str, batch: int,
                 dtype: str = "auto", gpu_memory: int | None = None, done=None,
                 record=None) -> dict[tuple[int, str], float]:
    """(group index, format name) -> the weight signal of every to-do cell, one layer resident at a time.
    `done(index, {format: damage})` is called as each group's cells are priced. With `record` (an
    imatrix.ImatrixRecord) the walk visits every layer and the output matrix and records their imatrix."""
    from ...engine.calibrate import LayerCalibration
    from ...groups import pending_by_group

    pending = pending_by_group(todo)
    rounding_methods = {f.method_for(rounding) for _, _, f in todo} - {"rtn"}
    walk = LayerCalibration(source, chunks, rounding_methods | {"imatrix"}, device, batch, dtype=dtype,
                            gpu_memory=gpu_memory)
    layers = source.geometry.num_layers
    by_start: dict[int, list[int]] = {}
    for index in pending:
        by_start.setdefault(groups[index].start, []).append(index)
    cells: dict[tuple[int, str], float] = {}

    def price(index: int, statistics) -> None:
        priced = group_prices(source, groups[index], pending[index], rounding, statistics)
        cells.update({(index, name): damage for name, damage in priced.items()})
        if done is not None:
            done(index, priced)

    edges = sorted(s for s in by_start if s < 0 or s >= layers)
    tied_embedding = source.tied_embeddings and -1 in by_start
    needs_head = any(s >= layers for s in edges) or tied_embedding or (record is not None and record.head is not None)
    last = layers - 1 if record is not None else max((s for s in by_start if 0 <= s < layers), default=-1)
    for layer in range(layers):
        if layer in by_start or record is not None:
            statistics = walk.statistics(layer)
            if record is not None:
                record.layer(statistics)
            stats = _LayerStatistics(statistics)
            for index in by_start.get(layer, ()):
                price(index, stats)
        if layer >= last and not needs_head:
            break
        walk.advance(layer)  # on to the next pending layer's inputs (or the last hidden state)
    head = walk.head_statistics() if needs_head else None
    if record is not None and head is not None:
        record.output(head)
    if edges:
        embedding = next(t for t in source.tensors() if t.group == EMBED and len(t.shape) == 2)
        edge = _EdgeStatistics(token_frequencies(chunks, embedding.shape[0]), head, source.tied_embeddings)
        for start in edges:
            for index in by_start[start]:
                price(index, edge)
    walk.engine.close()
    return cells


def group_prices(source, group, formats: list[Format], rounding: str, statistics) -> dict[str, float]:
    """{format: the weight signal of `group` under it}: each tensor read once for all formats, the formats that
    round it alike (Format.rounding_key) priced once, on a thread per format where the matrix is small; a
    tensor rounded back onto the grid its source stored it on (ModelSource.origin_types) priced whole."""
    from ...formats.ggml_lib import over_items

    damage = dict.fromkeys((f.name for f in formats), 0.0)
    for tensor in group.quantizable:
        weight = source.read(tensor.name)
        alike: dict[tuple, list[Format]] = {}
        for fmt in formats:
            if fmt.storage(tensor.name, tensor.shape) != "F32":
                alike.setdefault(fmt.rounding_key(tensor.name, tensor.shape, rounding), []).append(fmt)
        own = source.origin_types().get(tensor.name)  # rounded back onto it: priced whole
        sample = {key: same[0].storage(tensor.name, tensor.shape) != own for key, same in alike.items()}
        drawn = {key: sample[key] and samples_rows(weight, same[0], rounding) for key, same in alike.items()}
        guide = price_guide(weight, statistics.weightings(tensor)) if any(drawn.values()) else None  # one per tensor
        errors = over_items(lambda key: tensor_error(tensor, weight, alike[key][0], rounding, statistics,
                                                     sample=sample[key], guide=guide),
                            list(alike), values_rounded(weight.numel(), all(drawn.values())))
        for key, error in zip(alike, errors):
            for fmt in alike[key]:
                damage[fmt.name] += error
    return damage


def tensor_error(tensor, weight: torch.Tensor, fmt: Format, rounding: str, statistics, sample: bool = True,
                 seed: int = 0, guide: torch.Tensor | None = None) -> float:
    """One tensor's weight signal under `fmt`: Σ over the statistics' weightings of the weighted squared
    rounding error, from a seeded sample of the rows where the matrix is large and the format rounds rows apart,
    unless the sample cannot decide it (sampling.sampled_or_whole; `sample=False`: always the whole matrix,
    as bench/sampled_pricing.py compares). `guide`: price_guide(weight, its weightings), where already made."""
    method = fmt.method_for(rounding)
    calibration = statistics.rounding(tensor)
    terms = statistics.weightings(tensor)
    def whole() -> float:
        quantized = fmt.roundtrip(tensor.name, weight, calibration, method)
        return sum(weighted_error(weight, quantized, c, r) for c, r in terms)

    if not (sample and samples_rows(weight, fmt, rounding)):
        return whole()

    def price(taken: torch.Tensor) -> torch.Tensor:
        rows = weight[taken]
        quantized = fmt.roundtrip(tensor.name, rows, calibration, method)
        return sum(row_errors(rows, quantized, c, None if r is None else r[taken]) for c, r in terms)

    guide = price_guide(weight, terms) if guide is None else guide
    return sampled_or_whole(guide, price, units_wanted(weight.shape[0], weight.shape[1]), whole, seed)


def price_guide(weight: torch.Tensor, terms: list) -> torch.Tensor:
    """Each row's expected price on any scaled grid (sampling.scale_guide), summed over the weightings: the
    same for every format, so made once per tensor."""
    return sum(scale_guide(weight, c) * (1.0 if r is None else r.to(torch.float64)) for c, r in terms)


def samples_rows(weight: torch.Tensor, fmt: Format, rounding: str) -> bool:
    """Whether `weight`'s price under `fmt` comes from a sample of its rows: a large matrix whose rounding treats
    each row apart."""
    return weight.dim() == 2 and worth_sampling(weight.numel()) and fmt.rows_apart(fmt.method_for(rounding))


def row_errors(original: torch.Tensor, quantized: torch.Tensor, column_weight: torch.Tensor | None = None,
               row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's Σ_j r c_j (Q(W) - W)_j² in float64 (weighted_error before its sum over rows)."""
    delta = quantized.to(torch.float32) - original.to(torch.float32)
    square = delta * delta
    if column_weight is not None:
        square = square * column_weight.to(square.device, torch.float32)
    per_row = square.sum(1, dtype=torch.float64)
    return per_row if row_weight is None else per_row * row_weight.to(per_row.device, torch.float64)


class _LayerStatistics:
    """A decoder layer's matrices: their own calibration statistics, for rounding and weighting alike."""

    def __init__(self, stats: dict[str, Calibration]):
        self.stats = stats

    def rounding(self, tensor) -> Calibration | None:
        return self.stats.get(tensor.name)

    def weightings(self, tensor) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """[(column weight, row weight)] whose weighted errors add to the tensor's signal."""
        stats = self.stats[tensor.name]
        return [(stats.imatrix if stats.importance is None else stats.importance, None)]


class _EdgeStatistics:
    """The embedding and the head, rounded as the exact scan rounds them (the embedding without
    statistics, an untied head with the final norm's), weighted by token frequency / the final norm;
    a tied embedding is also the head, so both weightings add."""

    def __init__(self, frequencies: torch.Tensor, head: Calibration | None, tied: bool):
        self.frequencies, self.head, self.tied = frequencies, head, tied

    def rounding(self, tensor) -> Calibration | None:
        return self.head if tensor.group == LM_HEAD else None

    def weightings(self, tensor) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
        if tensor.group == LM_HEAD:
            return [(self.head.imatrix, None)]
        return [(None, self.frequencies)] + ([(self.head.imatrix, None)] if self.tied else [])


class WeightSignal(Signal):
    """The weight signal (weight_cells): imatrix-weighted squared weight error, any rounding; not in nats."""

    name = "weight"
    help = "imatrix-weighted squared weight error, one layer walk; any rounding"
    description = "weight (imatrix-weighted squared weight error; no forward pass per cell)"
    metric = METRIC
    mark = "weight"

    def prices(self, formats: list, rounding: str) -> bool:
        return True

    def price(self, job: PricingJob, todo: list, done: Done) -> None:
        weight_cells(job.source, job.chunks, job.groups, todo, job.rounding, job.device, job.batch, job.dtype,
                     job.gpu_memory, done=done, record=job.record)
        job.keep_imatrix()
