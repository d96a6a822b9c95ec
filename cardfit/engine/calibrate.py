"""Calibration statistics, one decoder layer at a time, for packing with data-aware rounding.

`LayerCalibration` walks the calibration tokens through the model layer by layer and hands
out the statistics of a layer's tensors just before that layer is written, so only one layer's
weights and statistics are ever resident. Whether the next layer sees the quantized or the
original outputs is the caller's choice: GPTQ propagates the quantized layer (each layer
corrects for the error before it), llama.cpp's imatrix is collected on the unquantized model.
"""

from __future__ import annotations

import torch

from ..formats import Calibration
from ..groups import NORM, GroupId
from ..sources import ModelSource


class LayerCalibration:
    def __init__(self, source: ModelSource, chunks: torch.Tensor, methods, device: str = "auto", batch: int = 4,
                 awq_samples: int = 4096, dtype: str = "auto", gpu_memory: int | None = None):
        """`methods`: one rounding or the set of them whose statistics to collect."""
        from . import Engine

        self.methods = {methods} if isinstance(methods, str) else set(methods)
        self.awq_samples = awq_samples
        self.engine = Engine(source, device, dtype, gpu_memory)
        self.stream = self.engine.stream
        self.batches = [chunks[i:i + batch] for i in range(0, len(chunks), batch)]
        self.hidden = self.engine.embed(self.batches)
        self.unvisited: list[str] = []  # routed experts' matrices no calibration token reached

    @torch.no_grad()
    def statistics(self, index: int) -> dict[str, Calibration]:
        """Per-tensor statistics of decoder layer `index` on the current hidden states."""
        from ..quant.model import layer_statistics

        names = [t.name for t in self.stream.groups[GroupId.layer_group(index)] if len(t.shape) == 2]
        stats = layer_statistics(self.engine, index, names, self.methods, self.hidden, self.awq_samples, seed=index)
        self.unvisited += [n for n in stats.unvisited() if n not in self.unvisited]
        return {n: stats.calibration(n) for n in names}

    @torch.no_grad()
    def advance(self, index: int, overrides: dict[str, torch.Tensor] | None = None) -> None:
        """Move the hidden states through layer `index` (with quantized weights when given)."""
        self.hidden = self.engine.step(index, self.hidden, overrides)

    def head_statistics(self) -> Calibration:
        """The output matrix's statistics (final_norm_statistics) on the current hidden states."""
        return final_norm_statistics(self.engine, self.hidden, self.methods)


def rounding_statistics(source: ModelSource, chunks: torch.Tensor, methods, device: str = "auto", batch: int = 4,
                        dtype: str = "auto", gpu_memory: int | None = None, record=None) -> dict[str, Calibration]:
    """Every matrix's rounding statistics for `methods` from one walk of the unquantized model, as the exact
    scan takes them (measure.Scanner.calibration): each layer's from its reference inputs, an untied output
    matrix's from the final norm; the embedding has none (a lookup: ggml weighs its columns equally). Small for
    the imatrix (one vector a matrix); `record` (an imatrix.ImatrixRecord) hears every layer and the head."""
    from ..groups import LM_HEAD

    methods = set(methods) | ({"imatrix"} if record is not None else set())
    walk = LayerCalibration(source, chunks, methods, device, batch, dtype=dtype, gpu_memory=gpu_memory)
    out: dict[str, Calibration] = {}
    try:
        layers = source.geometry.num_layers
        for index in range(layers):
            statistics = walk.statistics(index)
            if record is not None:
                record.layer(statistics)
            out.update(statistics)
            walk.advance(index)
        heads = [t.name for t in source.tensors() if t.group == LM_HEAD and len(t.shape) == 2]
        if heads:  # a tied head is the embedding, which has no statistics
            head = walk.head_statistics()
            if record is not None:
                record.output(head)
            out.update(dict.fromkeys(heads, head))
    finally:
        walk.engine.close()
    return out


@torch.no_grad()
def final_norm_statistics(engine, hidden, methods) -> Calibration:
    """The output matrix's statistics: its input is the final norm of the last hidden state (what its
    matmul reads), summed one batch at a time — mean x² (the imatrix) and, for GPTQ, the Hessian.
    Pack, the imatrix file and the scan (from its cached final states) all take it from here."""
    square = outer = None
    count = 0
    with engine.stream.resident(NORM):
        for h in hidden:
            h = h.to(engine.device)
            x = engine.stream.decoder.norm(h).reshape(-1, h.shape[-1]).to(torch.float32)
            if "imatrix" in methods:
                square = (x * x).sum(0) if square is None else square + (x * x).sum(0)
            if "gptq" in methods:
                outer = x.T @ x if outer is None else outer + x.T @ x
            count += x.shape[0]
    return Calibration(imatrix=None if square is None else (square / count).cpu(),
                       hessian=None if outer is None else (outer / count).cpu())


def unvisited_warning(names: list[str]) -> list[str]:
    """A warning (or none) for routed experts' matrices that no calibration token reached: they are
    rounded with an importance of one on every column, as llama-quantize rounds them."""
    if not names:
        return []
    from ..groups import expert_stack

    experts = sorted({(expert_stack(n)[0].rsplit(".experts.", 1)[0], expert_stack(n)[1]) for n in names})
    shown = ", ".join(f"{layer} expert {e}" for layer, e in experts[:3]) + (" ..." if len(experts) > 3 else "")
    return [f"{len(experts)} routed expert(s) saw no calibration token ({shown}): their matrices are rounded "
            "with equal column importance, as llama-quantize does; more calibration text (--max-tokens) reaches them"]
