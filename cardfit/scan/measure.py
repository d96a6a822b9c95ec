"""Exact measuring: one reference pass over the calibration tokens, then any set of quantized groups against it.

The reference pass runs once on the engine and caches the input of every layer group and, per position,
what a cell's KL needs of the reference through its own head (head_kl.py: a hidden-wide row and a few
numbers, not the vocabulary-wide log-probabilities, so they are never held whole); then each group's
formats walk together as tracks from the group onward (engine.py), so every later layer and the head are
read once per group sweep, not once per cell (`measure_group`), or a round's cells of many groups in one
walk (`measure_round`). scan.py runs this for the exact and adaptive scans, cluster.py on Ray, and
estimate.py prices it.

Cost model, L decoder layers, T calibration tokens, F formats: the reference pass is L
layer-forwards and one head per token; a cell at layer i costs (L - i) layer-forwards and one head
(the embedding cell L layer-forwards). Per format: L(L+1)/2 + L layer-forwards and L + 2 heads per
token; layer reads per scan: L(L+1)/2 + L for the sweeps plus L per format for the embedding, whose
quantized copies (the largest group) are held one at a time so the peak stays what one cell held.
A cell that replaces the head itself (the output matrix, or a tied embedding), and every cell of a
model whose logits are soft-capped, recomputes the reference's logits from the cached final hidden
state and compares log-probabilities: one more head per such cell.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch

from ..engine.activations import ActivationCache
from ..atomic import write_json
from ..engine.difference import head_change
from ..engine import Track
from ..formats import Calibration, Format
from ..groups import EMBED, LM_HEAD, Group, GroupId
from ..engine.head_kl import ReferenceSlice, difference_slice_kl, one_thread, slice_kl, summarize
from ..engine.heap import return_freed_memory
from ..engine.metrics import DistanceMeter, kl_from_logprobs, target_nll


# Positions per logits slice: the head's matmul is (positions x hidden) by (hidden x vocab), and on 2 cores
# it ran at 54 GFLOPS with 64 rows against 90-99 with 256 (152k vocabulary, docs/benchmarks.md); the slice's
# buffer is then 256 x vocab float32 (148 MiB at 152k), so under --memory-cap the slice stays 64.
LOGIT_POSITIONS = 256
CAPPED_LOGIT_POSITIONS = 64
TAIL_ROWS = "tail"  # the activation cache's key for the reference's tail rows (head_kl.py), beside points 0..L


class Scanner:
    """The measuring machinery of a scan: one reference pass, then any set of quantized groups against it."""

    def __init__(self, source, engine, chunks, batch, cache: ActivationCache, rounding: str):
        self.source, self.engine, self.stream, self.chunks, self.batch = source, engine, engine.stream, chunks, batch
        self.cache, self.rounding = cache, rounding
        self.batches = [chunks[i:i + batch] for i in range(0, len(chunks), batch)]
        self.layers = engine.layers
        self.positions = LOGIT_POSITIONS if cache.budget is None else CAPPED_LOGIT_POSITIONS  # per logits slice
        # (batch, row, first position) -> what a cell's KL needs of the reference there, on the host
        self.summary: dict[tuple[int, int, int], ReferenceSlice] = {}
        self._buffer: torch.Tensor | None = None  # _slice_buffer's

    @torch.no_grad()
    def reference(self) -> DistanceMeter:
        """One pass, layer-major (each layer's weights read once), caching every group's input."""
        meter = DistanceMeter()
        track = Track(self.engine.embed(self.batches))

        def cache_inputs(i, active):
            for b, h in enumerate(active[0].hidden):
                self.cache.put(i, b, h)

        hidden = self.engine.walk([track], before_layer=cache_inputs)[0].hidden
        for b, h in enumerate(hidden):
            self.cache.put(self.layers, b, h)
        with self.engine.head():
            for b, (ids, h) in enumerate(zip(self.batches, hidden)):
                rounded = self.head_in_differences  # the rounded head's tail rows follow the exact ones
                width = h.shape[-1] * (2 if rounded else 1)
                tails = torch.empty(*h.shape[:-1], width) if self.stream.linear_head else None
                for r in range(h.shape[0]):
                    for start in range(0, h.shape[1], self.positions):
                        piece = h[r:r + 1, start:start + self.positions]
                        with self._row_reductions(piece.shape[1]):
                            normed = self.stream.final_norm(piece)
                            logits = self.stream.head_logits(normed)
                            targets = ids[r:r + 1, start + 1:start + 1 + self.positions]
                            meter.nll_sum += float(target_nll(logits[:, :targets.shape[1]], targets).sum())
                            meter.nll_tokens += targets.numel()
                            if self.stream.linear_head:  # what every cell compares against, computed once
                                ref, tail = summarize(logits, normed, self.stream.head_matrix(), rounded)
                                self.summary[(b, r, start)] = ref.map(self._held)
                                tails[r:r + 1, start:start + self.positions] = tail
                if self.stream.linear_head:
                    self.cache.put(TAIL_ROWS, b, tails)
        return meter

    def _row_reductions(self, positions: int):
        """One thread for a one-position slice: torch splits a lone row's vocabulary-wide sum across its
        threads (other bits on 1 and 2), where it hands each thread whole rows otherwise."""
        return one_thread(self.engine.device) if positions == 1 else contextlib.nullcontext()

    def heads_per_cell(self, group: Group) -> int:
        """Head forwards a cell of `group` costs: its own, plus the reference's again where it cannot be
        compared against the summary (it replaces the head, or the head is soft-capped)."""
        replaces_head = any(t.name == self._head_weight()[1] for t in group.tensors)
        return 1 if self.stream.linear_head and not replaces_head else 2

    def _head_weight(self) -> tuple[str, str]:
        """(the head's group, its output matrix's name): the embedding's when tied. A cell replacing that
        matrix is the one head_distances compares against recomputed log-probabilities."""
        head = EMBED if self.stream.tied else LM_HEAD
        return head, next(n for n in self.stream.group_tensors(head) if n.endswith("weight"))

    def _held(self, tensor: torch.Tensor) -> torch.Tensor:
        """A reference tensor kept on the host; page-locked when the engine computes on CUDA, so every
        cell's copy back to the device is a DMA transfer rather than a staged one."""
        if self.engine.device.type != "cuda":
            return tensor.cpu()
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True).copy_(tensor)

    def calibration(self, group: Group, formats: list[Format]) -> dict[str, Calibration]:
        """Statistics each tensor of the group needs to be rounded in `formats` (the scan's rounding, or
        the imatrix a type cannot round without), from reference inputs, as pack collects them: an untied
        output matrix reads the final norm of the last hidden state; the embedding (tied or not) is
        rounded without statistics (ggml weighs its columns equally where a type needs weights)."""
        methods = {f.method_for(self.rounding) for f in formats} - {"rtn"}
        if not methods:
            return {}
        names = [t.name for t in group.quantizable]
        if 0 <= group.start < self.layers:
            from ..quant.model import layer_statistics

            inputs = (self.cache.get(group.start, b) for b in range(len(self.batches)))
            stats = layer_statistics(self.engine, group.start, names, methods, inputs)
            return {n: stats.calibration(n) for n in names}
        if names and group.start >= self.layers:
            from ..engine.calibrate import final_norm_statistics

            final = (self.cache.get(self.layers, b) for b in range(len(self.batches)))
            return dict.fromkeys(names, final_norm_statistics(self.engine, final, methods))
        return {}

    def quantized(self, group: Group, fmt: Format, calibration: dict[str, Calibration]) -> dict[str, torch.Tensor]:
        return self.variants(group, [fmt], calibration)[fmt.name]

    def variants(self, group: Group, formats: list[Format], calibration: dict[str, Calibration]
                 ) -> dict[str, dict[str, torch.Tensor]]:
        """Each format's copy of the group's tensors; a tensor that two formats round alike (the same
        `rounding_key`: a K-quant's fallback rows and the fallback type itself) is rounded once and
        shared by both copies, the same values either way."""
        copies: dict[str, dict[str, torch.Tensor]] = {f.name: {} for f in formats}
        for t in group.quantizable:
            weight, made = None, {}
            for fmt in formats:
                key = fmt.rounding_key(t.name, t.shape, self.rounding)
                if key not in made:
                    weight = self.source.read(t.name) if weight is None else weight
                    made[key] = self.rounded(t, fmt, weight, calibration)
                copies[fmt.name][t.name] = made[key]
        return copies

    def rounded(self, tensor, fmt: Format, weight: torch.Tensor, calibration: dict[str, Calibration]) -> torch.Tensor:
        """One tensor's round trip in `fmt` under the scan's rounding (the format's own where it takes no other)."""
        return fmt.roundtrip(tensor.name, weight, calibration.get(tensor.name), fmt.method_for(self.rounding))

    @torch.no_grad()
    def sweep(self, group: Group, variants: dict[str, dict[str, torch.Tensor]]) -> dict[str, DistanceMeter]:
        """Damage of every variant of one group (key -> its replaced tensors), measured in one walk:
        each later layer and the head are read once for all variants."""
        if group.start < 0:
            with self.stream.resident(EMBED):
                tracks = []
                for key, overrides in variants.items():
                    with self.stream.swapped(EMBED, overrides):
                        tracks.append(Track([self.stream.embed(ids) for ids in self.batches], 0, overrides, key))
        else:
            point = min(group.start, self.layers)
            inputs = [self.cache.get(point, b) for b in range(len(self.batches))]
            tracks = [Track(list(inputs), point, overrides, key) for key, overrides in variants.items()]
        self.engine.walk(tracks, reference=self.cache.get)
        return self.head_distances(tracks)

    @torch.no_grad()
    def head_distances(self, tracks: list[Track]) -> dict[object, DistanceMeter]:
        """Each track's final hidden states through the head (its own quantized head when it replaces
        it) against the reference; the reference head is resident once for all tracks."""
        head, head_weight = self._head_weight()
        meters = {}
        if self.head_in_differences:  # the tracks that keep the reference's head, in difference form
            own = [t for t in tracks if t.replacements(head).get(head_weight) is None]
            meters.update(self._difference_distances(own) if own else {})
            tracks = [t for t in tracks if t.key not in meters]
        with self.engine.head():
            for track in tracks:
                quantized = track.replacements(head).get(head_weight)
                q_head = (self.stream.logits if quantized is None
                          else lambda x, out, w=quantized: self.stream.logits_with(x, w, out=out))
                meters[track.key] = self._distances(track.hidden, self.stream.logits, q_head, quantized is None)
        return meters

    def _slice_buffer(self, views: int, positions: int) -> tuple[torch.Tensor, ...]:
        """`views` (1 x positions x vocab) float32 views of one block on the device, allocated once per
        scan and written in place slice after slice: a cell's logits (one view of `self.positions`), the
        reference's and a cell's in difference form (two), or the log-softmax comparison's four (a quarter
        of the positions each, the same block)."""
        vocab = self.stream.model.config.vocab_size
        longest = min(self.positions, self.chunks.shape[1])
        size = max(longest, 4, views * positions) * vocab
        if self._buffer is None or self._buffer.numel() < size:
            self._buffer = None
            self._buffer = torch.empty(size, device=self.engine.device)
        return tuple(self._buffer[i * positions * vocab:(i + 1) * positions * vocab].view(1, positions, vocab)
                     for i in range(views))

    def summarized_slice(self, piece: torch.Tensor, ref: ReferenceSlice, tail_rows: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(KL per position, q's argmax) of one slice through the reference's own linear head, against
        the reference's summary there; the logits are written into the scan's buffer."""
        logits, = self._slice_buffer(1, piece.shape[1])
        normed = self.stream.final_norm(piece)
        return slice_kl(self.stream.head_logits(normed, out=logits), normed, ref, tail_rows)

    @property
    def head_in_differences(self) -> bool:
        """Whether cells that keep the reference's head take it in difference form (difference.head_change):
        the engine computes its tracks so and the head is linear. The reference's summary then carries the
        rounded head's tail rows too (head_kl.summarize)."""
        from ..engine import DIFFERENCES

        return self.engine.compute == DIFFERENCES and self.stream.linear_head

    def _difference_distances(self, tracks: list[Track]) -> dict[object, DistanceMeter]:
        """_distances for every track at once with the head in difference form: a slice's reference logits
        (one float32 matmul from the cached final hidden states) are shared by all tracks, and each track's
        are those plus the head's bfloat16 product with the change of its final norm's output, then the KL
        against the reference's summary as in summarized_slice."""
        meters = {t.key: DistanceMeter() for t in tracks}
        with self.engine.head():
            weight = self.stream.head_matrix()  # resident only inside engine.head()
            low = weight.to(torch.bfloat16) if weight.is_cuda else None  # once, not per slice and track
            for b in range(len(self.batches)):
                final = self.cache.get(self.layers, b)
                tails = self.cache.get(TAIL_ROWS, b)
                for r in range(final.shape[0]):
                    kl = {t.key: [] for t in tracks}
                    agree = {t.key: [] for t in tracks}
                    for start in range(0, final.shape[1], self.positions):
                        piece = final[r:r + 1, start:start + self.positions]
                        reference_logits, logits = self._slice_buffer(2, piece.shape[1])
                        with self._row_reductions(piece.shape[1]):
                            ref = self.summary[(b, r, start)].to(self.engine.device, non_blocking=True)
                            tail = tails[r:r + 1, start:start + self.positions].to(self.engine.device,
                                                                                    non_blocking=True)
                            reference_normed = self.stream.final_norm(piece)
                            reference_logits = self.stream.head_logits(reference_normed, out=reference_logits)
                            for track in tracks:
                                own = track.hidden[b][r:r + 1, start:start + self.positions]
                                cell_kl, top = self.difference_slice(own, reference_normed, reference_logits, weight,
                                                                     ref, tail, logits, low)
                                kl[track.key].append(cell_kl)
                                agree[track.key].append(ref.argmax == top)
                    for track in tracks:  # one copy to the host per sequence, as _distances
                        meters[track.key].record(torch.cat(kl[track.key], -1).cpu(),
                                                 torch.cat(agree[track.key], -1).cpu())
        return meters

    def difference_slice(self, piece: torch.Tensor, reference_normed: torch.Tensor, reference_logits: torch.Tensor,
                         weight: torch.Tensor, ref: ReferenceSlice, tail_rows: torch.Tensor, out: torch.Tensor,
                         low_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(KL per position, q's argmax) of one track's slice with the head in difference form, against the
        reference's logits, head input and summary there; the track's logits are written into `out`."""
        change = self.stream.final_norm(piece).sub_(reference_normed).to(torch.bfloat16).float()
        head_change(reference_logits, change, weight, out, low_weight)
        return difference_slice_kl(out, reference_normed, change, ref, tail_rows)

    def _distances(self, hidden: list[torch.Tensor], ref_head, q_head, own_head: bool) -> DistanceMeter:
        """KL and top-1 per sequence, logits computed a slice of positions at a time into the scan's
        buffer: through the reference's own linear head against the reference's summary (head_kl.py),
        else (`own_head` False: a quantized head; or a soft-capped one) against the reference's
        log-probabilities recomputed from the cached final hidden states, a quarter slice at a time."""
        meter = DistanceMeter()
        summarized = own_head and self.stream.linear_head
        step = self.positions if summarized else max(1, min(self.positions, self.chunks.shape[1]) // 4)
        for b, h in enumerate(hidden):
            final = None if summarized else self.cache.get(self.layers, b)
            tails = self.cache.get(TAIL_ROWS, b)[..., :h.shape[-1]] if summarized else None  # the exact rows
            for r in range(h.shape[0]):
                kl, agree = [], []
                for start in range(0, h.shape[1], step):
                    piece = h[r:r + 1, start:start + step]
                    with self._row_reductions(piece.shape[1]):
                        if summarized:
                            ref = self.summary[(b, r, start)].to(self.engine.device, non_blocking=True)
                            tail = tails[r:r + 1, start:start + step].to(self.engine.device, non_blocking=True)
                            cell_kl, top = self.summarized_slice(piece, ref, tail)
                            kl.append(cell_kl)
                            agree.append(ref.argmax == top)
                            continue
                        logits, ref_logits, ref_logprobs, work = self._slice_buffer(4, piece.shape[1])
                        q = q_head(piece, out=logits)
                        ref = ref_head(final[r:r + 1, start:start + step], out=ref_logits)
                        agree.append(ref.argmax(-1) == q.argmax(-1))
                        torch._log_softmax(ref, -1, False, out=ref_logprobs)
                        kl.append(kl_from_logprobs(ref_logprobs, q, (ref, work)).double())
                # one copy to the host per sequence: each copy waits for the device
                meter.record(torch.cat(kl, -1).cpu(), torch.cat(agree, -1).cpu())
        return meter


def copy_bytes(group: Group) -> int:
    """Bytes of one quantized (dequantized float32) copy of the group's matrices."""
    return sum(t.numel * 4 for t in group.quantizable)


def measured_formats(group: Group, formats: list[Format]) -> list[Format]:
    """The formats whose cells a scan must measure: those that store some matrix of the group other
    than as F32 (the rest cost nothing: damage 0)."""
    return [f for f in formats if group.quantizable
            and not all(f.storage(t.name, t.shape) == "F32" for t in group.quantizable)]


def format_batches(group: Group, formats: list[Format], limit: int) -> list[list[Format]]:
    """Formats of one group split into sweeps whose quantized copies together stay under `limit` bytes
    (at least one format per sweep), so a sweep never holds more than the largest single cell did."""
    out, current, held = [], [], 0
    size = copy_bytes(group)
    for fmt in formats:
        if current and held + size > limit:
            out.append(current)
            current, held = [], 0
        current.append(fmt)
        held += size
    if current:
        out.append(current)
    return out


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


WINDOWS = 4  # rounds a difference-form exact scan walks its decoder-layer groups in


def walk_windows(scanner: Scanner, groups: list[Group], pending: dict[int, list[Format]], allowed: bool = True
                 ) -> list[tuple[bool, list[tuple[int, list[Format]]]]]:
    """How the exact scan walks its pending groups, as (together, [(group index, formats), ...]): each group
    alone (measure_group, its map written after every sweep), unless the engine runs tracks in difference
    form (engine.DIFFERENCES). Then every layer a walk passes costs one reference pass, shared by the
    walk's tracks, and the decoder-layer groups walk together (measure_round) in WINDOWS rounds of
    consecutive layers: about 2.5 L reference passes for the scan instead of L²/2, the map written
    after each round."""
    from ..engine import DIFFERENCES

    if not allowed or scanner.engine.compute != DIFFERENCES:
        return [(False, [item]) for item in pending.items()]
    span = -(-scanner.layers // WINDOWS)
    out: list[tuple[bool, list]] = []
    rounds: dict[int, list] = {}
    for i, formats in pending.items():
        if 0 <= groups[i].start < scanner.layers:
            rounds.setdefault(groups[i].start // span, []).append((i, formats))
        else:
            out.append((False, [(i, formats)]))
    return out + [(True, rounds[k]) for k in sorted(rounds)]


def in_map_order(cells: dict, formats: list[Format]) -> dict:
    """A group's cells in the map's format order, whatever order they were measured in: what makes a
    resumed or distributed scan the same bytes as an uninterrupted one."""
    return {f.name: cells[f.name] for f in formats if f.name in cells}


class GroupCells(dict):
    """Format name -> cell of one group, and how many sweeps measured them."""
    sweeps = 0


class RoundedAhead:
    """Rounds the next sweep's copies on a host thread while the device measures this one. Measured on
    an H200 (docs/benchmarks.md), a float32 scan of the 1.5B spent about half its time in ggml's CPU
    quantizers with the GPU idle. Only round-to-nearest sweeps (any other rounding reads statistics the
    device computes for that group first), one sweep ahead: at most two sweeps' copies held. The copies
    are the same bits whichever thread rounds them."""

    def __init__(self, scanner: Scanner, sweeps: list[tuple[Group, list[Format]]]):
        from concurrent.futures import ThreadPoolExecutor

        self.scanner, self.sweeps, self.next = scanner, sweeps, 0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="round-ahead")
        self.pending = self._submit(0)

    @staticmethod
    def applies(scanner: Scanner, formats: list[Format], memory_cap: int | None) -> bool:
        """On CUDA without a memory cap (a cap is a promise about what is held at once)."""
        return (scanner.engine.device.type == "cuda" and memory_cap is None
                and all(f.method_for(scanner.rounding) == "rtn" for f in formats))

    def _submit(self, index: int):
        if index >= len(self.sweeps):
            return None
        group, formats = self.sweeps[index]
        return self.pool.submit(lambda: self.scanner.variants(group, formats, {}))

    def take(self, group: Group, formats: list[Format]) -> dict[str, dict[str, torch.Tensor]] | None:
        """The copies of this sweep if they are the next ones rounded ahead, else None."""
        if self.next >= len(self.sweeps):
            return None
        planned_group, planned_formats = self.sweeps[self.next]
        if planned_group is not group or [f.name for f in planned_formats] != [f.name for f in formats]:
            return None
        variants = self.pending.result()
        self.next += 1
        self.pending = self._submit(self.next)
        return variants

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def measure_group(scanner: Scanner, group: Group, pending: list[Format], limit: int,
                  sweep_done=None, bar=None, ahead: RoundedAhead | None = None) -> GroupCells:
    """Every pending cell of one group: formats that store nothing quantized cost 0; the rest are
    measured in sweeps of at most `limit` bytes of quantized copies, with the group's calibration
    statistics computed once. `sweep_done(cells)` sees each sweep's cells (the free ones first) as
    soon as they exist, so a caller can checkpoint them. The single-process scan and each Ray task
    run exactly this, so their cells are the same bits; `ahead` may hand over copies rounded earlier."""
    cells = GroupCells()
    measured = measured_formats(group, pending)
    free = free_cells(pending, measured)
    if free:
        cells.update(free)
        if sweep_done:
            sweep_done(free)
    calibration_stats = scanner.calibration(group, measured) if measured else {}
    for sweep_formats in format_batches(group, measured, limit):
        cells.sweeps += 1
        if bar:
            bar.set_description(f"{group.name} @ {','.join(f.name for f in sweep_formats)}")
        variants = ahead.take(group, sweep_formats) if ahead else None
        if variants is None:
            with scanner.engine.quantizers():
                variants = scanner.variants(group, sweep_formats, calibration_stats)
        meters = scanner.sweep(group, variants)
        del variants
        swept = {fmt.name: measured_cell(meters[fmt.name]) for fmt in sweep_formats}
        cells.update(swept)
        if sweep_done:
            sweep_done(swept)
        return_freed_memory()
    return cells


def free_cells(pending: list[Format], measured: list[Format]) -> dict[str, dict]:
    """The cells of the pending formats that store nothing of the group quantized: no damage."""
    return {f.name: {"damage": 0.0, "stderr": 0.0, "top1": 1.0} for f in pending if f not in measured}


def measured_cell(meter: DistanceMeter) -> dict:
    stderr = meter.kl_stderr  # undefined over a single chunk: recorded as null, not NaN
    return {"damage": meter.kl, "stderr": stderr if math.isfinite(stderr) else None, "top1": meter.top1}


ROUND_TRACK_BYTES = 2 << 30  # hidden states one walk of measure_round holds, unless --memory-cap says less


def measure_round(scanner: Scanner, todo: list[tuple[Group, list[Format]]], track_bytes: int = ROUND_TRACK_BYTES
                  ) -> list[GroupCells]:
    """Every pending cell of several groups (an adaptive round), cell for cell the bits measure_group gives:
    the decoder-layer groups' cells walk together as tracks starting at their own layers, so each layer
    and the head are read once per walk instead of once per group (the embedding and the head's own
    group, whose copies ride the whole walk, are swept by measure_group). A walk holds at most
    `track_bytes` of hidden states (never fewer tracks than one group's formats); a cell's copy is
    rounded when its track reaches its layer, the rounding of a tensor shared by the formats that round
    it alike, and dropped as soon as no track left at that layer needs it: at most one copy held."""
    out = [GroupCells() for _ in todo]
    limit = max((copy_bytes(g) for g, _ in todo), default=0)
    walks: list[list[tuple[int, Group, list[Format]]]] = []
    held = 0
    per_track = scanner.chunks.numel() * scanner.stream.model.config.hidden_size * scanner.engine.dtype.itemsize
    for k, (group, pending) in sorted(enumerate(todo), key=lambda item: item[1][0].start):
        if not 0 <= group.start < scanner.layers:
            out[k] = measure_group(scanner, group, pending, limit)
            continue
        measured = measured_formats(group, pending)
        out[k].update(free_cells(pending, measured))
        if not measured:
            continue
        size = len(measured) * per_track
        if not walks or held + size > max(track_bytes, size):
            walks.append([])
            held = 0
        walks[-1].append((k, group, measured))
        held += size
    for walk in walks:
        meters = _walk_round(scanner, walk)
        for k, _, measured in walk:
            out[k].sweeps += 1
            out[k].update({fmt.name: measured_cell(meters[(k, fmt.name)]) for fmt in measured})
        return_freed_memory()
    return out


def _walk_round(scanner: Scanner, cells: list[tuple[int, Group, list[Format]]]) -> dict[tuple[int, str], DistanceMeter]:
    """One walk of measure_round: (k, decoder-layer group, formats) -> a DistanceMeter per (k, format)."""
    at_layer: dict[int, list[tuple[int, Group, list[Format]]]] = {}
    for k, group, formats in cells:
        at_layer.setdefault(group.start, []).append((k, group, formats))
    tracks, needs = [], {}  # needs: track key -> (tensor name, rounding key) of its copy
    for start in sorted(at_layer):
        for k, group, formats in at_layer[start]:
            for fmt in formats:
                key = (k, fmt.name)
                needs[key] = [(t.name, fmt.rounding_key(t.name, t.shape, scanner.rounding)) for t in group.quantizable]
                tracks.append(Track([], start, lambda name, key=key: copies(name, key), key))
    made: dict[tuple, torch.Tensor] = {}  # (tensor, rounding key) -> its round trip, at the layer walked now
    here: dict = {}  # track key -> (group, format, calibration) of the cells whose layer is walked now
    left: list = []  # keys of those tracks not yet through the layer, in the walk's order
    index = None

    def enter(i: int, active: list[Track]) -> None:
        nonlocal index
        index = i
        made.clear()
        here.clear()
        left[:] = [t.key for t in active if t.start == i]
        for track in active:
            if track.start == i:
                track.hidden = [scanner.cache.get(i, b) for b in range(len(scanner.batches))]
        for k, group, formats in at_layer.get(i, []):
            calibration = scanner.calibration(group, formats)
            here.update({(k, fmt.name): (group, fmt, calibration) for fmt in formats})

    def copies(name: str, key) -> dict[str, torch.Tensor]:
        if name != GroupId.layer_group(index) or key not in here:
            return {}  # a layer after its own, or the head
        left.remove(key)
        wanted = {need for later in [key, *left] for need in needs[later]}
        for stale in [need for need in made if need not in wanted]:
            del made[stale]
        group, fmt, calibration = here[key]
        with scanner.engine.quantizers():
            for t, need in zip(group.quantizable, needs[key]):
                if need not in made:
                    made[need] = scanner.rounded(t, fmt, scanner.source.read(t.name), calibration)
        return {t.name: made[need] for t, need in zip(group.quantizable, needs[key])}

    scanner.engine.walk(tracks, before_layer=enter, reference=scanner.cache.get)
    made.clear()
    return scanner.head_distances(tracks)


def finish(result: dict, out: Path) -> dict:
    """Mark a map whose every cell is measured complete, with its separability, and write it."""
    fraction = _separable_fraction(result["groups"], result["formats"])
    result["separable_fraction"] = fraction
    if fraction is not None and fraction < 0.5:
        result["warnings"] = [f"only {fraction:.0%} of adjacent formats differ by more than 2 standard errors: "
                              "the calibration is too short to separate formats; raise --max-tokens"]
    result["complete"] = True
    write_json(out, result)
    return result
