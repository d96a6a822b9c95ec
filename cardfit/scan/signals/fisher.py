"""The fast damage estimator: KL(P_ref || P_q) ≈ ½ δwᵀ F δw with the diagonal Fisher F, streamed.

Around the reference weights the KL of a small perturbation δw is, to second order, ½ δwᵀ F δw,
where F is the Fisher information of the model's own next-token distribution. Its diagonal is
estimated from gradients of the log-likelihood of tokens *sampled from the model itself* (so the
score has zero mean and squared batch gradients estimate the per-token Fisher without the cross
terms that true labels leave). Each cell then costs only its quantization round trip; for a large matrix,
that of a sample of its blocks, drawn where a scaled grid's error is expected to lie (sampled_kl).

The model is never whole in memory: a layer-major forward keeps each layer's input per batch (the
activations), the head samples the labels and starts the backward chunk by chunk of tokens (the
logits are never whole either), and the backward walks the layers from the top down, one resident
layer at a time, recomputing its forward from the kept input. A layer's Fisher is final once every
batch has passed back through it, so it is handed to the caller and dropped: peak memory is the
largest group about three times (weights, one batch's gradient, the accumulator) plus the
activations. Tied embeddings get the head's and the lookup's gradient summed before squaring, as one
parameter should.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...groups import EMBED, LM_HEAD, NORM, GroupId
from ...schemas import KL_METRIC
from .base import Done, PricingJob, Signal
from .sampling import sampled_or_whole, units_wanted, values_rounded, worth_sampling

LOGIT_ROWS = 128  # tokens per chunk when sampling: the logits held at once are LOGIT_ROWS x vocab floats
VOCAB_ROWS = 4096  # most head rows per chunk of the backward (its gradient slice: VOCAB_ROWS x hidden)


def streamed_fisher(source, chunks: torch.Tensor, on_group: Callable[[dict[str, torch.Tensor]], None],
                    device: str | torch.device = "cpu", samples: int = 2, batch: int = 4, seed: int = 0) -> None:
    """The mean per-token diagonal Fisher of every tensor, handed to `on_group({name: fisher})` one
    source group at a time as each becomes final: the final norm and an untied head, the layers top
    down, then the embedding (tied, with the head's share). Samples labels batch by batch, sample by sample, token by token from one seeded
    CPU generator."""
    from ...engine.heap import map_large_blocks
    from ...engine.streamed import StreamedModel

    map_large_blocks()  # big temporaries go back to the system when freed, not into a growing heap
    model = StreamedModel(source, device=device, dtype=torch.float32)
    try:
        _Pass(model, chunks, samples, batch, seed).run(on_group)
    finally:
        model.close()


class _Pass:
    def __init__(self, model, chunks: torch.Tensor, samples: int, batch: int, seed: int):
        self.model = model
        self.device = model.device
        self.ids = [chunks[i:i + batch] for i in range(0, len(chunks), batch)]
        self.samples = samples
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.scale = 1.0 / (chunks.numel() * samples)
        self.layers = len(model.layers)

    def run(self, on_group) -> None:
        inputs = self.forward()  # inputs[layer][batch], inputs[layers][batch] = the last hidden state
        grads, head_fisher, head_rows = self.head(inputs.pop())
        on_group(head_fisher)  # final norm and untied head: final now, dropped before the layers
        for index in reversed(range(self.layers)):
            on_group(self.backward_layer(index, inputs.pop(), grads))
        on_group(self.embedding(grads, head_rows if self.model.tied else None))

    def _params(self, group: str) -> dict[str, torch.nn.Parameter]:
        """The module parameters a group's tensors live in (a fused expert stack once)."""
        return {n: self.model.model.get_parameter(n) for n in self.model.group_params(group)}

    def _per_tensor(self, group: str, fisher: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A parameter's Fisher as its checkpoint tensors' (a routed expert's slice of its stack)."""
        place = self.model.place
        return {n: place[n].view(fisher[place[n].param]).contiguous() for n in self.model.group_tensors(group)}

    @torch.no_grad()
    def forward(self) -> list[list[torch.Tensor]]:
        """Every layer's input for every batch, layer-major (each layer read once)."""
        hidden = [self.model.embed(ids) for ids in self.ids]
        inputs = []
        for index in range(self.layers):
            inputs.append(hidden)
            hidden = [self.model.run_layer(index, h) for h in hidden]
        inputs.append(hidden)
        return inputs

    def head(self, last: list[torch.Tensor]):
        """Sample labels and take the backward through the head and final norm: -> each (batch, sample)'s
        gradient at the last hidden state, the head's and norm's Fisher, and (tied) the head gradient's
        rows at each batch's input tokens. Two passes per sample, so neither the logits nor the head's
        gradient is ever whole: token chunks to sample the labels (in the order one whole-batch draw
        would take them), then vocabulary chunks, each squared into the Fisher as it is made."""
        model = self.model
        head_group = EMBED if model.tied else LM_HEAD
        head_name = self._embedding_name() if model.tied else model.group_tensors(LM_HEAD)[0]
        fisher: dict[str, torch.Tensor] = {}
        rows: list[list[torch.Tensor]] = []
        grads: list[list[torch.Tensor]] = []
        softcap = getattr(model.model.config, "final_logit_softcapping", None)

        def capped(z):
            return torch.tanh(z / softcap) * softcap if softcap else z

        with model.resident(NORM), model.resident(head_group):
            weight = model.model.lm_head.weight.detach()
            vocab = weight.shape[0]
            norm_params = self._params(NORM)
            fisher[head_name] = torch.zeros_like(weight)
            fisher.update({n: torch.zeros_like(p) for n, p in norm_params.items()})
            for b, hidden in enumerate(last):
                h = hidden.to(self.device, torch.float32).requires_grad_(True)
                with torch.enable_grad():
                    normed = model.decoder.norm(h)
                flat = normed.detach().reshape(-1, normed.shape[-1])
                tokens = self.ids[b].to(self.device).unique() if model.tied else None
                width = max(1, min(VOCAB_ROWS, LOGIT_ROWS * vocab // len(flat)))
                grads.append([])
                rows.append([])
                for s in range(self.samples):
                    labels, lse = [], []
                    for start in range(0, len(flat), LOGIT_ROWS):
                        logits = capped(flat[start:start + LOGIT_ROWS] @ weight.T)
                        lse.append(torch.logsumexp(logits, dim=-1))
                        probs = torch.softmax(logits, dim=-1).cpu()
                        labels.append(torch.multinomial(probs, 1, generator=self.generator).reshape(-1))
                    labels, lse = torch.cat(labels).to(self.device), torch.cat(lse)
                    g_normed = torch.zeros_like(flat)
                    head_rows = []
                    for v0 in range(0, vocab, width):
                        part = weight[v0:v0 + width]
                        z = flat @ part.T
                        d = torch.exp(capped(z) - lse[:, None])  # softmax, this slice of the vocabulary
                        hit = (labels >= v0) & (labels < v0 + len(part))
                        d[hit.nonzero().reshape(-1), labels[hit] - v0] -= 1.0  # d CE / d logits
                        if softcap:
                            d *= 1 - torch.tanh(z / softcap) ** 2
                        g_part = d.T @ flat
                        fisher[head_name][v0:v0 + len(part)].addcmul_(g_part, g_part)
                        g_normed.addmm_(d, part)
                        if tokens is not None:
                            inside = tokens[(tokens >= v0) & (tokens < v0 + len(part))]
                            head_rows.append(g_part[inside - v0])
                    g_h, *g_norm = torch.autograd.grad(normed, [h, *norm_params.values()],
                                                       grad_outputs=g_normed.reshape(normed.shape),
                                                       retain_graph=s < self.samples - 1, allow_unused=True)
                    for name, g in zip(norm_params, g_norm):
                        if g is not None:
                            fisher[name].addcmul_(g, g)
                    if tokens is not None:
                        rows[b].append(torch.cat(head_rows))
                    grads[b].append(g_h.detach())
        if model.tied:  # the tied matrix is final only after the embedding's own gradient
            self.tied_fisher = fisher.pop(head_name)
        return grads, self._scaled(fisher), rows

    def backward_layer(self, index: int, inputs: list[torch.Tensor], grads) -> dict[str, torch.Tensor]:
        """Layer `index`'s Fisher, and each (batch, sample)'s gradient moved to the layer's input."""
        model = self.model
        group = GroupId.layer_group(index)
        with model.resident(group):
            params = self._params(group)
            fisher = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
            for b, hidden in enumerate(inputs):
                kwargs = model.layer_kwargs(hidden.shape[0], hidden.shape[1])[index]
                h = hidden.to(self.device).requires_grad_(True)
                with torch.enable_grad():
                    out = model.layers[index](h, **kwargs)
                    out = out[0] if isinstance(out, tuple) else out
                for s in range(self.samples):
                    g_h, *g_params = torch.autograd.grad(out, [h, *params.values()], grad_outputs=grads[b][s],
                                                         retain_graph=s < self.samples - 1, allow_unused=True)
                    for name, g in zip(params, g_params):
                        if g is not None:
                            g = g.to(torch.float32)
                            fisher[name].addcmul_(g, g)
                    grads[b][s] = g_h.detach()
                inputs[b] = None  # this batch's input is spent
        return self._scaled(self._per_tensor(group, fisher))

    def embedding(self, grads, head_rows) -> dict[str, torch.Tensor]:
        """The embedding's Fisher from each (batch, sample)'s gradient through the lookup (its own module,
        so a scaled embedding is scaled; sparse, so only the batch's rows are ever made); tied, the
        head's gradient at those rows joins before squaring."""
        model = self.model
        name = self._embedding_name()
        lookup_module = model.decoder.embed_tokens
        with model.resident(EMBED):
            weight = model.model.get_parameter(name)
            fisher = self.tied_fisher if head_rows is not None else torch.zeros_like(weight, dtype=torch.float32)
            was_sparse, lookup_module.sparse = lookup_module.sparse, True
            try:
                for b, ids in enumerate(self.ids):
                    with torch.enable_grad():
                        out = lookup_module(ids.to(self.device))
                    for s in range(self.samples):
                        (g,) = torch.autograd.grad(out, [weight], grad_outputs=grads[b][s].to(out.dtype),
                                                   retain_graph=s < self.samples - 1)
                        g = g.coalesce()
                        tokens, lookup = g.indices()[0], g.values().to(torch.float32)
                        if head_rows is None:
                            fisher[tokens] += lookup * lookup
                        else:  # (h + l)^2 = h^2 (already in) + l (2h + l); rows in sorted token order
                            fisher[tokens] += lookup * (2 * head_rows[b][s] + lookup)
            finally:
                lookup_module.sparse = was_sparse
            fisher = fisher.detach()
        return self._scaled({name: fisher})

    def _embedding_name(self) -> str:
        return next(t.name for t in self.model.groups[EMBED] if len(t.shape) == 2)

    def _scaled(self, fisher: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: f.mul_(self.scale).cpu() for n, f in fisher.items()}


def _squared_errors(fisher: torch.Tensor, original: torch.Tensor, quantized: torch.Tensor, rows: int):
    """(F, δw²) a block of rows at a time, so no full-size temporary is made."""
    for start in range(0, original.shape[0], rows):
        delta = quantized[start:start + rows].to(torch.float32) - original[start:start + rows].to(torch.float32)
        yield fisher[start:start + rows], delta.square_()


def predicted_kl(fisher: torch.Tensor, original: torch.Tensor, quantized: torch.Tensor, rows: int = 4096) -> float:
    """½ Σ F δw² in nats per token."""
    total = 0.0
    for f, squared in _squared_errors(fisher, original, quantized, rows):
        total += float(torch.dot(f.reshape(-1), squared.reshape(-1)))
    return 0.5 * total


def unit_prices(fisher: torch.Tensor, original: torch.Tensor, quantized: torch.Tensor, unit: int,
                rows: int = 4096) -> torch.Tensor:
    """½ Σ F δw² of every `unit` consecutive values of a matrix (its ggml blocks)."""
    return 0.5 * torch.cat([(f * squared).reshape(-1, unit).sum(-1).double()
                            for f, squared in _squared_errors(fisher, original, quantized, rows)])


def expected_prices(fisher: torch.Tensor, original: torch.Tensor, unit: int, rows: int = 4096) -> torch.Tensor:
    """What each `unit` of a matrix is expected to cost rounded to a scaled grid, up to one constant: over each
    32 values an i-quant gives a scale, Σ F times the largest |w| squared (a rounding error's variance goes
    with the scale squared). On the real 0.5B's matrices it tracks IQ4's error per block better than Q4_0's
    actual rounding does (docs/benchmarks.md): the actual errors of two grids are two independent draws."""
    from ...formats.ggml_types import GGML_BLOCKS

    scaled = GGML_BLOCKS["IQ4_NL"][0]  # the values one i-quant scale covers (IQ4_NL's whole block)
    parts = []
    for start in range(0, original.shape[0], rows):
        w = original[start:start + rows].to(torch.float32).reshape(-1, scaled)
        f = fisher[start:start + rows].reshape(-1, scaled)
        parts.append((f.sum(-1) * w.abs().amax(-1).square()).reshape(-1, unit // scaled).sum(-1).double())
    return torch.cat(parts)


def sampled(storage: str, values: int) -> bool:
    """Whether the cheap signal prices a matrix of `values` stored as `storage` from a sample of its blocks:
    any large matrix of a block-quantized ggml type (RTN rounds each block apart from the others)."""
    from ...formats.ggml_types import GGML_BLOCKS

    return storage in GGML_BLOCKS and GGML_BLOCKS[storage][0] > 1 and worth_sampling(values)


def sampled_kl(fisher: torch.Tensor, original: torch.Tensor, storage: str, seed: int = 0,
               guide: torch.Tensor | None = None) -> float:
    """½ Σ F δw² of `original` stored as the ggml type `storage`, from ggml's rounding of a sample of its
    blocks drawn by their expected price (expected_prices; sampling.sampled_or_whole: whole where the sample
    cannot decide). `guide`: another price
    per block to draw by (bench/sampled_pricing.py compares)."""
    from ...formats.gguf_formats import ggml_roundtrip
    from ...formats.ggml_types import GGML_BLOCKS

    unit = GGML_BLOCKS[storage][0]
    matrix = original.reshape(-1, original.shape[-1])
    weights = fisher.reshape(matrix.shape)
    guide = expected_prices(weights, matrix, unit) if guide is None else guide

    def price(taken: torch.Tensor) -> torch.Tensor:
        picked = matrix.reshape(-1, unit)[taken].to(torch.float32)
        return unit_prices(weights.reshape(-1, unit)[taken], picked, ggml_roundtrip(storage, picked), unit)

    return sampled_or_whole(guide, price, units_wanted(len(guide), unit),
                            lambda: predicted_kl(weights, matrix, ggml_roundtrip(storage, matrix)), seed)


def fisher_cells(source, chunks: torch.Tensor, groups: list, todo: list, device: str | torch.device = "cpu",
                 batch: int = 4, done: Callable[[int, dict[str, float]], None] | None = None,
                 rounding: str = "rtn", statistics: Callable | None = None) -> None:
    """The predicted KL of every to-do cell (group index, group, format) under `rounding` (a large matrix from a
    sample of its blocks or rows, sampled_kl / sampled_rows_kl): `done(index, {format: nats})` as each group's
    Fisher becomes final, its tensors read once for all its formats; then the Fisher is dropped. `statistics`:
    tensor -> the Calibration its rounding takes (rounding_statistics), needed for any rounding but RTN.
    Refuses a group the pass never reached rather than leave holes."""
    from ...errors import CardfitError
    from ...formats.ggml_lib import over_items
    from ...groups import pending_by_group

    pending = pending_by_group(todo)

    def price(fisher: dict[str, torch.Tensor]) -> None:
        for index in [i for i in pending if all(t.name in fisher for t in groups[i].quantizable)]:
            formats = pending.pop(index)
            damage = dict.fromkeys((f.name for f in formats), 0.0)
            for t in groups[index].quantizable:
                weight = source.read(t.name)
                calibration = statistics(t) if statistics is not None else None
                alike: dict[tuple, list] = {}  # formats that round this tensor the same, priced once
                for f in formats:
                    if f.storage(t.name, t.shape) != "F32":
                        alike.setdefault(f.rounding_key(t.name, t.shape, rounding), []).append(f)
                own = source.origin_types().get(t.name)
                drawn = [_drawn(same[0], t, weight, own, rounding, calibration) for same in alike.values()]
                rows = any(d and same[0].method_for(rounding) != "rtn" for d, same in zip(drawn, alike.values()))
                guide = row_guide(fisher[t.name], weight) if rows else None  # one per tensor, as the formats share it
                kl = over_items(lambda pair: _price(pair[0][0], t, fisher[t.name], weight, pair[1], rounding,
                                                    calibration, guide),
                                list(zip(alike.values(), drawn)), values_rounded(weight.numel(), all(drawn)))
                for same, nats in zip(alike.values(), kl):
                    for fmt in same:
                        damage[fmt.name] += nats
            if done is not None:
                done(index, damage)

    streamed_fisher(source, chunks, price, device=device, batch=batch)
    if pending:  # a group whose tensors the model does not run (none today)
        raise CardfitError(f"the Fisher pass never reached {', '.join(groups[i].name for i in pending)}",
                           "scan with --method exact")


def prices_rounding(formats: list, rounding: str) -> bool:
    """Whether the Fisher prices `formats` under `rounding`: each rounds with RTN or the imatrix (what a
    walk's mean x² per column gives; GPTQ and AWQ search against more than that)."""
    return all(f.method_for(rounding) in ("rtn", "imatrix") for f in formats)


def _drawn(fmt, tensor, weight: torch.Tensor, own: str | None, rounding: str = "rtn", calibration=None) -> bool:
    """Whether `_price` draws this tensor's price from a sample (of blocks under RTN, of rows otherwise), the
    rounding being `fmt.method_for(rounding)` as the exact scan rounds it (Scanner.rounded: an i-quant's imatrix
    in an RTN scan). Not a tensor rounded back onto the grid its source stored it on without statistics: ~0 but
    in a few blocks, which no sample predicts (with an imatrix the scales are searched again and every row moves)."""
    storage = fmt.storage(tensor.name, tensor.shape)
    method = fmt.method_for(rounding)
    if storage == own and (method == "rtn" or calibration is None):
        return False
    if method == "rtn":
        return sampled(storage, weight.numel())
    return weight.dim() == 2 and worth_sampling(weight.numel()) and fmt.rows_apart(method)


def _price(fmt, tensor, fisher: torch.Tensor, weight: torch.Tensor, drawn: bool, rounding: str = "rtn",
           calibration=None, guide: torch.Tensor | None = None) -> float:
    """One tensor's predicted KL under one format and rounding: where `drawn` (_drawn), from a sample of its
    blocks (RTN, sampled_kl) or rows (a rounding with statistics, sampled_rows_kl); otherwise from its whole
    round trip."""
    method = fmt.method_for(rounding)
    if drawn:
        if method == "rtn":
            return sampled_kl(fisher, weight, fmt.storage(tensor.name, tensor.shape))
        return sampled_rows_kl(fisher, weight, lambda rows: fmt.roundtrip(tensor.name, rows, calibration, method),
                               guide=guide)
    return predicted_kl(fisher, weight, fmt.roundtrip(tensor.name, weight, calibration, method))


def row_guide(fisher: torch.Tensor, original: torch.Tensor) -> torch.Tensor | None:
    """Each row's expected price on a scaled grid (expected_prices summed along the row), what sampled_rows_kl
    draws by; None for rows no i-quant scale divides (such a matrix is priced whole)."""
    from ...formats.ggml_types import GGML_BLOCKS

    matrix = original.reshape(-1, original.shape[-1])
    if matrix.shape[1] % GGML_BLOCKS["IQ4_NL"][0]:
        return None
    return expected_prices(fisher.reshape(matrix.shape), matrix, matrix.shape[1])


def sampled_rows_kl(fisher: torch.Tensor, original: torch.Tensor, roundtrip: Callable[[torch.Tensor], torch.Tensor],
                    seed: int = 0, guide: torch.Tensor | None = None) -> float:
    """½ Σ F δw² of a matrix whose rounding treats each row apart (Format.rows_apart), from `roundtrip` of a
    sample of its rows drawn by their expected price (row_guide, given where already made), whole where the
    sample cannot decide (sampling.sampled_or_whole). Rows whose Fisher is all zero cost exactly nothing and are
    never rounded (an embedding's rows of tokens the calibration text never holds: most of a large vocabulary)."""
    matrix = original.reshape(-1, original.shape[-1])
    weights = fisher.reshape(matrix.shape)
    guide = row_guide(weights, matrix) if guide is None else guide
    live = weights.ne(0).any(1)
    if not bool(live.all()):
        matrix, weights = matrix[live], weights[live]
        guide = None if guide is None else guide[live]
        if len(matrix) == 0:
            return 0.0
    if guide is None or not worth_sampling(matrix.numel()):  # what is left is small: priced whole
        return predicted_kl(weights, matrix, roundtrip(matrix))

    def price(taken: torch.Tensor) -> torch.Tensor:
        picked = matrix[taken]
        squared = (roundtrip(picked).to(torch.float32) - picked.to(torch.float32)).square_()
        return 0.5 * (weights[taken] * squared).sum(1, dtype=torch.float64)

    return sampled_or_whole(guide, price, units_wanted(len(guide), matrix.shape[1]),
                            lambda: predicted_kl(weights, matrix, roundtrip(matrix)), seed)


class FisherSignal(Signal):
    """The streamed Fisher's predicted KL (fisher_cells), in nats; RTN and imatrix rounding."""

    name = "fast"
    help = "the streamed diagonal Fisher's predicted KL; RTN and imatrix rounding"
    description = "fast (diagonal Fisher of sampled tokens, 1/2 dw^T F dw)"
    metric = KL_METRIC

    def prices(self, formats: list, rounding: str) -> bool:
        return prices_rounding(formats, rounding)

    def refusal(self, formats: list, rounding: str) -> str:
        return f"the fast (Fisher) signal prices RTN and imatrix rounding, not {rounding}"

    def price(self, job: PricingJob, todo: list, done: Done) -> None:
        from ...engine import resolve_device

        fisher_cells(job.source, job.chunks, job.groups, todo, str(resolve_device(job.device)[0]), job.batch, done,
                     job.rounding, rounding_walk(job, [f for _, _, f in todo]))


def rounding_walk(job: PricingJob, formats: list):
    """tensor -> the Calibration the Fisher's cells round with (calibrate.rounding_statistics), from one walk
    that also records the imatrix when asked; None where every format rounds with RTN (no walk)."""
    from ...engine.calibrate import rounding_statistics

    methods = {f.method_for(job.rounding) for f in formats} - {"rtn"}
    if not methods:
        return None
    if job.log:
        job.log(f"collecting the {'/'.join(sorted(methods))} statistics the Fisher's cells round with (one walk)")
    statistics = rounding_statistics(job.source, job.chunks, methods, job.device, job.batch, job.dtype,
                                     job.gpu_memory, job.record)
    job.keep_imatrix()
    return lambda tensor: statistics.get(tensor.name)
