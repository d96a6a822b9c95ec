"""Stage 2: the sensitivity map — damage of every layer group at every format.

Damage of cell (g, f) = mean over calibration tokens of KL(P_ref || P_q), the next-token
distributions of the unquantized model and of the model with only group g stored in
format f (the format's real quantizer). The reference pass runs once and caches the input
of every layer group, so a cell re-runs only from its group onward. The map is written
atomically after every cell; `resume` continues a partial map, and the result is the same
bytes as an uninterrupted scan (no timings or paths that vary are stored in it).

Cost model, L decoder layers, T calibration tokens: the reference pass is L layer-forwards
and one head per token; a cell at layer i costs (L - i) layer-forwards and two heads (the
reference logits are recomputed from the cached final hidden state rather than stored,
which would take T x vocab x 4 bytes); an embedding cell costs L layer-forwards and two
heads; an lm_head cell two heads. Per format: L(L+1)/2 + L layer-forwards and 2(L+2) heads
per token, plus one layer-forward per group to gather GPTQ/AWQ/imatrix statistics.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .activations import ActivationCache
from .atomic import write_json
from .errors import CardfitError
from .formats import Calibration, Format, parse_formats
from .heap import map_large_blocks, return_freed_memory
from .metrics import DistanceMeter, target_nll, token_kl
from .schemas import MAP_VERSION, model_header
from .groups import EMBED, LM_HEAD, NORM, GroupId
from .sources import ModelSource, open_model, runnable
from .text import load_text, text_hash, token_chunks

ROUNDINGS = ("rtn", "imatrix", "gptq", "awq")
LOGIT_POSITIONS = 64  # positions per logits slice in scan: 64 x vocab float32 (12 MiB at 49k tokens)


@dataclass
class Group:
    name: str
    tensors: list  # TensorInfo
    start: int  # first decoder layer to re-run; -1 embedding, L = head only

    @property
    def quantizable(self) -> list:
        return [t for t in self.tensors if len(t.shape) >= 2]


def scan_groups(source: ModelSource, group_by: str) -> list[Group]:
    """Groups in forward order; a tied lm_head is the embedding and is priced once, with it."""
    if group_by not in ("layer", "tensor"):
        raise CardfitError(f"unknown --group-by '{group_by}'", "use --group-by layer or --group-by tensor")
    layers = source.geometry.num_layers
    out = []
    for name, tensors in source.groups().items():
        if name == LM_HEAD and source.tied_embeddings:
            continue
        group = GroupId(name)
        start = -1 if group == EMBED else layers if group in (NORM, LM_HEAD) else group.layer
        if group.kind == "layer" and group_by == "tensor":
            out += [Group(t.name, [t], start) for t in tensors if len(t.shape) >= 2]
            fixed = [t for t in tensors if len(t.shape) < 2]
            if fixed:
                out.append(Group(GroupId.fixed_group(group.layer), fixed, start))
        else:
            out.append(Group(name, tensors, start))
    return out


METHODS = {"exact": "exact", "fast": "fast (diagonal Fisher of sampled tokens, 1/2 dw^T F dw)"}


def map_header(source: ModelSource, text: str, text_path: Path, chunks: torch.Tensor, formats: list[Format],
               group_by: str, rounding: str, method: str = "exact") -> dict:
    runtimes = {f.runtime for f in formats}
    if len(runtimes) > 1:
        raise CardfitError("formats mix runtimes (" + ", ".join(sorted(runtimes)) + ")",
                           "scan GGUF types and vLLM formats into separate maps")
    return {
        "cardfit_map": MAP_VERSION,
        "model": model_header(source),
        "calibration": {"sha256": text_hash(text), "source": text_path.name, "tokens": int(chunks.numel()),
                        "seq_len": int(chunks.shape[1]), "chunks": int(chunks.shape[0])},
        "damage": {"metric": "mean KL(P_ref || P_q), nats per token", "method": METHODS[method]},
        "rounding": rounding,
        "group_by": group_by,
        "runtime": runtimes.pop(),
        "formats": [f.name for f in formats],
    }


def _same_job(a: dict, b: dict) -> bool:
    keys = ("cardfit_map", "model", "calibration", "damage", "rounding", "group_by", "runtime", "formats")
    return all(a.get(k) == b.get(k) for k in keys)


class Scanner:
    """The measuring machinery of a scan: one reference pass, then any set of quantized groups against it."""

    def __init__(self, source, stream, chunks, batch, cache: ActivationCache, rounding: str):
        self.source, self.stream, self.chunks, self.batch = source, stream, chunks, batch
        self.cache, self.rounding = cache, rounding
        self.batches = [chunks[i:i + batch] for i in range(0, len(chunks), batch)]
        self.layers = len(stream.layers)
        vocab = stream.model.config.vocab_size
        self.keep_reference = cache.budget is None or chunks.numel() * vocab * 4 <= cache.budget
        self.ref_logits: dict[tuple[int, int, int], torch.Tensor] = {}  # (batch, row, first position)

    @torch.no_grad()
    def reference(self) -> DistanceMeter:
        """One pass, layer-major (each layer's weights read once), caching every group's input."""
        meter = DistanceMeter()
        with self.stream.resident(EMBED):
            hidden = [self.stream.embed(ids) for ids in self.batches]
        for i in range(self.layers):
            with self.stream.resident(GroupId.layer_group(i)):
                for b, h in enumerate(hidden):
                    self.cache.put(i, b, h)
                    hidden[b] = self.stream.run_layer(i, h)
        for b, h in enumerate(hidden):
            self.cache.put(self.layers, b, h)
        with self._head():
            for b, (ids, h) in enumerate(zip(self.batches, hidden)):
                for r in range(h.shape[0]):
                    for start in range(0, h.shape[1], LOGIT_POSITIONS):
                        logits = self.stream.logits(h[r:r + 1, start:start + LOGIT_POSITIONS])
                        if self.keep_reference:
                            self.ref_logits[(b, r, start)] = logits
                        targets = ids[r:r + 1, start + 1:start + 1 + LOGIT_POSITIONS]
                        meter.nll_sum += float(target_nll(logits[:, :targets.shape[1]], targets).sum())
                        meter.nll_tokens += targets.numel()
        return meter

    def _head(self):
        stack = contextlib.ExitStack()
        for g in (NORM, EMBED if self.stream.tied else LM_HEAD):
            stack.enter_context(self.stream.resident(g))
        return stack

    def calibration(self, group: Group) -> dict[str, Calibration]:
        """Statistics the rounding needs for each tensor of the group, from reference inputs."""
        if self.rounding == "rtn" or group.start < 0 or group.start >= self.layers:
            return {}
        from .quant.model import layer_statistics

        names = [t.name for t in group.quantizable]
        inputs = (self.cache.get(group.start, b) for b in range(len(self.batches)))
        stats = layer_statistics(self.stream, group.start, names, self.rounding, inputs)
        return {n: stats.calibration(n) for n in names}

    def quantized(self, group: Group, fmt: Format, calibration: dict[str, Calibration]) -> dict[str, torch.Tensor]:
        out = {}
        for t in group.quantizable:
            method = self.rounding if self.rounding in fmt.methods() else "rtn"
            out[t.name] = fmt.roundtrip(t.name, self.source.read(t.name), calibration.get(t.name), method)
        return out

    @torch.no_grad()
    def cell(self, group: Group, overrides: dict[str, torch.Tensor]) -> DistanceMeter:
        """Re-run from the group onward, layer-major, and compare with the reference logits."""
        if group.start < 0:
            with self.stream.resident(EMBED, overrides):
                hidden = [self.stream.embed(ids) for ids in self.batches]
            start = 0
        elif group.start < self.layers:
            hidden = [self.cache.get(group.start, b) for b in range(len(self.batches))]
            start = group.start
        else:
            hidden = [self.cache.get(self.layers, b) for b in range(len(self.batches))]
            start = self.layers
        for i in range(start, self.layers):
            with self.stream.resident(GroupId.layer_group(i), overrides):
                hidden = [self.stream.run_layer(i, h) for h in hidden]
        return self.head_distances(hidden, overrides)

    @torch.no_grad()
    def head_distances(self, hidden: list[torch.Tensor], overrides: dict[str, torch.Tensor]) -> DistanceMeter:
        """The final hidden states through the head (quantized if `overrides` holds it) against the reference."""
        head = EMBED if self.stream.tied else LM_HEAD
        head_weight = next(n for n in self.stream.group_tensors(head) if n.endswith("weight"))
        if head_weight in overrides:
            # The cell quantizes the head itself: hold the reference and the quantized matrix side by
            # side (two copies of the largest group) instead of reloading one per logits slice.
            device, dtype = self.stream.device, self.stream.dtype  # moved once, not per slice
            reference = None if self.keep_reference else self.source.read(head_weight, dtype=dtype).to(device)
            quantized = overrides[head_weight].to(device, dtype)
            with self.stream.resident(NORM):
                return self._distances(hidden, lambda x: self.stream.logits_with(x, reference),
                                       lambda x: self.stream.logits_with(x, quantized))
        with self._head():
            return self._distances(hidden, self.stream.logits, self.stream.logits)

    def _distances(self, hidden: list[torch.Tensor], ref_head, q_head) -> DistanceMeter:
        """KL and top-1 per sequence, logits computed LOGIT_POSITIONS at a time: two (slice x vocab)
        float32 logits alive, not two whole sequences or batches."""
        meter = DistanceMeter()
        for b, h in enumerate(hidden):
            final = None if self.keep_reference else self.cache.get(self.layers, b)
            for r in range(h.shape[0]):
                kl, agree = [], []
                for start in range(0, h.shape[1], LOGIT_POSITIONS):
                    end = start + LOGIT_POSITIONS
                    ref = (self.ref_logits[(b, r, start)] if self.keep_reference
                           else ref_head(final[r:r + 1, start:end]))
                    q = q_head(h[r:r + 1, start:end])
                    kl.append(token_kl(ref, q))
                    agree.append(ref.argmax(-1) == q.argmax(-1))
                meter.record(torch.cat(kl, -1), torch.cat(agree, -1))
        return meter


def _separable_fraction(groups: list[dict], formats: list[str]) -> float | None:
    """Share of adjacent format pairs whose damages differ by more than 2 standard errors."""
    pairs = separable = 0
    for g in groups:
        cells = [g["cells"][f] for f in formats if f in g.get("cells", {})]
        cells = [c for c in cells if c["stderr"] is not None and math.isfinite(c["stderr"])]
        for a, b in zip(cells, cells[1:]):
            if a["damage"] == b["damage"]:
                continue
            pairs += 1
            separable += abs(a["damage"] - b["damage"]) > 2 * math.hypot(a["stderr"], b["stderr"])
    return separable / pairs if pairs else None


def scan(model: str | Path | None = None, calibration: str | Path | None = None, max_tokens: int = 8192,
         formats: str | list[str] = "Q8_0,Q6_K,Q4_K,Q3_K,Q2_K", group_by: str = "layer",
         out: str | Path = "sensitivity.json", resume: bool = False, device: str = "cpu",
         memory_cap: int | None = None, rounding: str = "rtn", seq_len: int = 512, batch: int = 4,
         progress: bool = True, method: str = "exact") -> dict:
    """Measure the damage of every group at every format; returns the map (also written to `out`)."""
    from transformers import AutoTokenizer

    from .paths import guard_output, input_paths, model_paths
    from .quant.device import check_device
    from .runner import StreamedModel

    if method not in METHODS:
        raise CardfitError(f"unknown --method '{method}'", "use --method exact or --method fast")
    if method == "fast" and rounding != "rtn":
        raise CardfitError("the fast estimator prices RTN rounding only", "use --rounding rtn with --method fast")
    if rounding not in ROUNDINGS:
        raise CardfitError(f"unknown rounding '{rounding}'", "use " + ", ".join(ROUNDINGS))
    if max_tokens <= 0 or seq_len <= 1 or batch <= 0:
        raise CardfitError("--max-tokens, --seq-len and --batch must be positive",
                           "e.g. --max-tokens 8192 --seq-len 512 --batch 4")
    if group_by not in ("layer", "tensor"):
        raise CardfitError(f"unknown --group-by '{group_by}'", "use --group-by layer or --group-by tensor")
    check_device(device)
    fmts = parse_formats(formats)
    source = open_model(model)
    guard_output(out, {"the model": model_paths(source), "the calibration text": input_paths(calibration)})
    source = runnable(source)
    text, text_path = load_text(calibration)
    tokenizer = AutoTokenizer.from_pretrained(str(source.path))
    chunks = token_chunks(tokenizer, text, seq_len, max_tokens, source=str(text_path))
    header = map_header(source, text, text_path, chunks, fmts, group_by, rounding, method)
    out = Path(out)
    result = None
    if out.exists():
        if not resume:
            raise CardfitError(f"{out} exists", "pass --resume to continue it, or choose another --out")
        from .maps import read_map

        previous = read_map(out)
        if not _same_job(previous, header):
            raise CardfitError(f"{out} was scanned for another model, text or settings",
                               "use a new --out, or the original model, calibration and formats")
        result = previous
    groups = scan_groups(source, group_by)
    if result is None:
        result = dict(header)
        result["reference"] = {}
        result["groups"] = [{"name": g.name, "tensors": [t.name for t in g.tensors],
                             "bytes": {f.name: sum(f.tensor_bytes(t.name, t.shape) for t in g.tensors)
                                       for f in fmts},
                             "storage": {f.name: sorted({f.storage(t.name, t.shape) for t in g.tensors})
                                         for f in fmts},
                             "cells": {}} for g in groups]
        result["complete"] = False
        result["warnings"] = []
    todo = [(i, g, f) for i, g in enumerate(groups) for f in fmts
            if f.name not in result["groups"][i]["cells"]]
    if not todo and result.get("complete"):
        return result  # a finished map of this very job: nothing to measure again
    if method == "fast":
        return _fast_cells(source, chunks, groups, todo, result, out, device, batch)
    map_large_blocks()
    stream = StreamedModel(source, device=device)
    budget = None if memory_cap is None else memory_cap // 2
    cache = ActivationCache(budget, spill_dir=out.parent)
    scanner = Scanner(source, stream, chunks, batch, cache, rounding)
    bar = _progress(progress, len(groups) * len(fmts), len(groups) * len(fmts) - len(todo))
    try:
        ref = scanner.reference()
        return_freed_memory()
        result["reference"] = {"perplexity": round(ref.perplexity, 6)}
        current = None
        for i, group, fmt in todo:
            entry = result["groups"][i]
            if current != group.name:
                calibration_stats, current = scanner.calibration(group), group.name
            if bar:
                bar.set_description(f"{group.name} @ {fmt.name}")
            if all(fmt.storage(t.name, t.shape) == "F32" for t in group.quantizable) or not group.quantizable:
                entry["cells"][fmt.name] = {"damage": 0.0, "stderr": 0.0, "top1": 1.0}
            else:
                meter = scanner.cell(group, scanner.quantized(group, fmt, calibration_stats))
                stderr = meter.kl_stderr  # undefined over a single chunk: recorded as null, not NaN
                entry["cells"][fmt.name] = {"damage": meter.kl, "stderr": stderr if math.isfinite(stderr) else None,
                                            "top1": meter.top1}
            write_json(out, result)
            return_freed_memory()
            if bar:
                bar.update(1)
    finally:
        cache.close()
        if bar:
            bar.close()
    fraction = _separable_fraction(result["groups"], result["formats"])
    result["separable_fraction"] = fraction
    if fraction is not None and fraction < 0.5:
        result["warnings"] = [f"only {fraction:.0%} of adjacent formats differ by more than 2 standard errors: "
                              "the calibration is too short to separate formats; raise --max-tokens"]
    result["complete"] = True
    write_json(out, result)
    return result


def _progress(enabled: bool, total: int, done: int):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=done, unit="cell", dynamic_ncols=True, disable=None)


def _fast_cells(source, chunks, groups, todo, result, out, device, batch) -> dict:
    """Every cell from one Fisher estimate: ½ Σ F δw² over the group's tensors (no model runs per cell)."""
    from .fisher import fisher_diagonal, predicted_kl

    fisher = fisher_diagonal(source.path, chunks, device=device, batch=batch)
    for i, group, fmt in todo:
        damage = 0.0
        for t in group.quantizable:
            if fmt.storage(t.name, t.shape) == "F32" or t.name not in fisher:
                continue
            weight = source.read(t.name)
            damage += predicted_kl(fisher[t.name], weight, fmt.roundtrip(t.name, weight, None, "rtn"))
        result["groups"][i]["cells"][fmt.name] = {"damage": damage, "stderr": None, "top1": None}
    result["separable_fraction"] = None
    result["complete"] = True
    write_json(out, result)
    return result


from .stage import callable_stage  # noqa: E402

callable_stage(__name__)
