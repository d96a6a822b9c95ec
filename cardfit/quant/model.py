"""Quantize a whole model layer by layer, the way GPTQ/AWQ calibrate: each layer sees the
inputs that the already-quantized layers before it produce.

Statistics per Linear (Hessian X^T X / n, imatrix mean x^2, a sample of inputs for AWQ)
are gathered by forward hooks while the layer computes, so only one decoder layer and its
statistics are resident. Linears that read the same input tensor (q/k/v; gate/up) share
one AWQ scale, which is what lets the scale be folded into the preceding norm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..formats import Calibration, Format
from ..groups import EMBED, LM_HEAD, GroupId
from .awq import awq_search


class _LinearStats:
    """Statistics per input: a Linear's own (hooked on its module), or one routed expert's (tapped from the
    fused experts module: an expert's gate and up read the same rows and share one entry)."""

    def __init__(self, stream, names: list[str], methods, awq_samples: int, seed: int = 0):
        from ..groups import expert_stack
        from .experts import expert_taps

        self.methods = {methods} if isinstance(methods, str) else set(methods)
        self.hessian: dict = {}
        self.sq: dict = {}
        self.count: dict = {}
        self.samples: dict = {}
        self.routed: dict = {}  # routed experts' sum of (routing weight x input)^2 per column
        self.shared: dict = {}
        self.key_of: dict[str, object] = {}  # tensor name -> the input its statistics are kept under
        self.awq_samples = awq_samples
        self._gen = torch.Generator().manual_seed(seed)
        self._hooks = []
        self._first = True
        self._alive: list[torch.Tensor] = []
        experts = [n for n in names if expert_stack(n)]
        for name in names:
            if name in experts:
                continue
            self.key_of[name] = name
            module = stream.model.get_submodule(stream.place[name].param.rsplit(".", 1)[0])  # as transformers names it
            self._hooks.append(module.register_forward_hook(self._hook(name)))
        self._taps = expert_taps(stream, experts, self._record)
        self.tap_of: dict[str, object] = {}  # routed expert's tensor name -> the tap that sees its rows
        for tap in self._taps:
            self.key_of.update(tap.keys)
            self.tap_of.update(dict.fromkeys(tap.keys, tap))
            for group in tap.input_groups():
                self.shared[tap.keys[group[0]]] = group

    def _hook(self, name: str):
        def record(module, args, output):
            x = args[0]
            if self._first:  # keep x alive so no later tensor can reuse its id during this batch
                self._alive.append(x)
                self.shared.setdefault(id(x), []).append(name)
            self._record(name, x.detach().reshape(-1, x.shape[-1]).to(torch.float32))

        return record

    def _record(self, key, x: torch.Tensor, routing: torch.Tensor | None = None) -> None:
        self.count[key] = self.count.get(key, 0) + x.shape[0]
        if routing is not None and "imatrix" in self.methods:  # what the layer's output sees of this expert
            routed = routing[:, None] * x
            self.routed[key] = self.routed.get(key, 0) + (routed * routed).sum(dim=0)
        if "gptq" in self.methods:  # only what the method reads: X^T X is the costly one
            self.hessian[key] = self.hessian.get(key, 0) + x.T @ x
        if "imatrix" in self.methods:
            self.sq[key] = self.sq.get(key, 0) + (x * x).sum(dim=0)
        if "awq" in self.methods:
            take = torch.randperm(x.shape[0], generator=self._gen)[: max(1, self.awq_samples // 8)]
            self.samples.setdefault(key, []).append(x[take.to(x.device)].cpu())

    def end_first_batch(self) -> None:
        self._first = False
        self._alive.clear()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        for tap in self._taps:
            tap.close()

    def unvisited(self) -> list[str]:
        """Routed experts' matrices no calibration token reached."""
        return [n for n in self.tap_of if not self.count.get(self.key_of[n])]

    def calibration(self, name: str) -> Calibration:
        """`name`'s statistics. An expert no token reached gets what llama-quantize gives
        one: an importance of one per column; for GPTQ the identity (its rounding is then RTN's) and for
        AWQ an empty sample (no token to weigh: the identity scale)."""
        key = self.key_of[name]
        n = self.count.get(key, 0)
        tap = self.tap_of.get(name)
        importance = None
        if tap is not None and "imatrix" in self.methods:  # per token of the layer, routing weight squared
            importance = (self.routed[key] / max(tap.tokens, 1)).cpu() if n else torch.zeros(tap.columns[name])
        if n == 0:
            columns = tap.columns[name]
            return Calibration(imatrix=torch.ones(columns) if "imatrix" in self.methods else None,
                               hessian=torch.eye(columns) if "gptq" in self.methods else None,
                               inputs=torch.zeros(0, columns) if "awq" in self.methods else None, tokens=0,
                               importance=importance)
        inputs = torch.cat(self.samples[key])[: self.awq_samples] if self.samples.get(key) else None
        imatrix = (self.sq[key] / n).cpu() if key in self.sq else None
        hessian = (self.hessian[key] / n).cpu() if key in self.hessian else None
        return Calibration(imatrix=imatrix, hessian=hessian, inputs=inputs, tokens=n, importance=importance)

    def input_groups(self) -> list[list[str]]:
        return list(self.shared.values())


@torch.no_grad()
def layer_statistics(engine, index: int, names: list[str], methods, hidden, awq_samples: int = 4096,
                     seed: int = 0) -> _LinearStats:
    """Run decoder layer `index` over every batch of `hidden`, recording what `methods` (one rounding or a
    set of them) need of `names`."""
    stream = engine.stream
    with stream.resident(GroupId.layer_group(index)):
        stats = _LinearStats(stream, names, methods, awq_samples, seed=seed)
        try:
            for j, h in enumerate(hidden):
                stream.run_layer(index, h)
                if j == 0:
                    stats.end_first_batch()
        finally:
            stats.close()
    return stats


@torch.no_grad()
def quantize_model(engine, chunks: torch.Tensor, format_for: Callable[[str], Format | None], method: str = "rtn",
                   batch: int = 4, awq_samples: int = 4096, progress: Callable[[str], None] | None = None
                   ) -> dict[str, torch.Tensor]:
    """Effective (dequantized) weights by tensor name for every tensor `format_for` assigns a format.

    `method` is rtn, gptq, awq or imatrix; formats that do not take a method fall back to
    the closest they do (imatrix on integer formats is rtn; gptq on GGUF types is imatrix).
    """
    stream = engine.stream
    overrides: dict[str, torch.Tensor] = {}
    hidden = engine.embed(chunks[i:i + batch] for i in range(0, len(chunks), batch))
    for index in range(engine.layers):
        group = GroupId.layer_group(index)
        names = [t.name for t in stream.groups[group] if len(t.shape) == 2 and format_for(t.name) is not None]
        stats = layer_statistics(engine, index, names, {format_for(n).method_for(method) for n in names},
                                 hidden, awq_samples, seed=index)
        with engine.quantizers():
            for shared in stats.input_groups():
                _quantize_shared(stream, shared, stats, format_for, method, overrides)
        hidden = engine.step(index, hidden, overrides)  # the next layer sees this one quantized
        if progress:
            progress(group)
    for group in (EMBED, LM_HEAD):
        for t in stream.groups.get(group, []):
            fmt = format_for(t.name)
            if fmt is not None:
                overrides[t.name] = fmt.roundtrip(t.name, stream.source.read(t.name), None, "rtn")
    return overrides


def _quantize_shared(stream, names, stats, format_for, method, overrides) -> None:
    weights = {n: stream.source.read(n) for n in names}
    chosen = {n: format_for(n).method_for(method) for n in names}
    if all(chosen[n] == "awq" for n in names) and len({format_for(n).name for n in names}) == 1:
        fmt = format_for(names[0])
        x = stats.calibration(names[0]).inputs
        scale = awq_search([weights[n] for n in names], x,
                           lambda m, n0=names[0]: fmt.roundtrip(n0, m, None, "rtn"))
        for n in names:
            overrides[n] = fmt.roundtrip(n, weights[n] * scale, None, "rtn") / scale
        return
    for n in names:
        overrides[n] = format_for(n).roundtrip(n, weights[n], stats.calibration(n), chosen[n])
