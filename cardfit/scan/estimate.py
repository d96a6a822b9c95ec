"""What a scan will cost before it runs: the engine's own counts, priced by a short measured run.

The counts follow the engine's walk exactly (scan.py): one reference pass; per group sweep, one read
of every later layer and of the head, and per format (L - start) layer-forwards and one head
forward per token; one quantization per (group, format); for data-aware rounding one more
forward of the group's layer. The unit times come from this machine: one real decoder layer read
and run on one calibration batch, a slice of the head, and each format's quantizer on one layer,
so the estimate already knows the device, the dtype, the thread count and ggml's speed per type.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ..formats import Calibration
from ..engine.head_kl import summarize, summary_bytes
from ..groups import GroupId


@dataclass
class ScanEstimate:
    layer_forwards: int  # decoder-layer forwards over one batch of calibration chunks
    head_forwards: int  # head forwards over one batch
    layer_reads: int  # decoder layers read from the source
    quantizations: int  # (group, format) roundtrips
    flops: float
    bytes_read: int  # weights read from the source
    bytes_moved: int  # weights + hidden states crossing to the device
    peak_bytes: int  # host memory the scan holds at its peak (activations, the reference's summary, copies)
    seconds: float
    calibration_seconds: float  # spent measuring the unit times
    unit_seconds: dict
    reference_seconds: float = 0.0  # the reference pass, part of `seconds`
    group_seconds: list = None  # each group's sweeps (one Ray task each), the rest of `seconds`

    def render_workers(self, workers: int) -> str:
        seconds = self.on_workers(workers)
        when = f"about {seconds / 60:.0f} minutes" if seconds >= 120 else f"about {seconds:.0f} seconds"
        return (f"on {workers} such worker{'s' * (workers != 1)}: {when} (the reference pass, then the longest-first "
                f"schedule of {len(self.group_seconds or [])} groups' sweeps; transfers and worker start-up not counted)")

    def on_workers(self, workers: int) -> float:
        """Seconds with the group sweeps spread over `workers` equal workers, longest first (as cluster.py
        submits them): the reference pass, then the makespan of that greedy schedule. Transfers of
        activations and each worker's one-time start are not in it."""
        finish = [0.0] * max(1, workers)
        for seconds in sorted(self.group_seconds or [], reverse=True):
            finish[finish.index(min(finish))] += seconds
        return self.reference_seconds + max(finish)

    def as_dict(self) -> dict:
        return asdict(self)

    def render(self) -> str:
        minutes = self.seconds / 60
        when = f"about {minutes:.0f} minutes" if minutes >= 2 else f"about {self.seconds:.0f} seconds"
        return (f"estimate: {self.layer_forwards} layer-forwards and {self.head_forwards} head forwards per batch, "
                f"{self.layer_reads} layer reads, {self.quantizations} quantizations, {self.flops / 1e12:.1f} TFLOP, "
                f"{self.bytes_moved / 2**30:.1f} GiB moved, peak ~{self.peak_bytes / 2**30:.2f} GiB: {when} "
                f"on this device")


def layer_flops(geometry, seq_len: int, layer_params: int) -> float:
    """Per token: 2 x the layer's matrix parameters, plus causal attention (scores and values)."""
    attention = 2 * 2 * (seq_len / 2) * geometry.num_heads * (geometry.head_dim_k + geometry.head_dim_v) / 2
    return 2 * layer_params + attention


def estimate_scan(scanner, groups, todo, limit: int, formats, units: dict | None = None,
                  rounds_ahead: bool = False, windows: bool = False) -> ScanEstimate:
    """Counts of the scan `todo` will run (scan.py's walk) priced by unit times measured now, or by
    given `units` (the same keys as _unit_seconds; bench/project_cluster.py prices other devices so).
    Layers the engine keeps resident are read once; with `rounds_ahead` (measure.RoundedAhead: the next
    sweep's copies rounded on a host thread) a group costs the longer of its rounding and its sweeps.
    In difference form (engine.DIFFERENCES) a track's layers after its own cost a difference forward
    each, and every layer a walk passes one reference pass; `windows` (the single-process scan) walks the
    layer groups in measure.walk_windows' rounds, each group alone otherwise (a Ray task's walk), as
    `group_seconds` always prices them."""
    from ..groups import pending_by_group
    from .measure import copy_bytes, format_batches, measured_formats, walk_windows

    engine, source = scanner.engine, scanner.source
    layers = engine.layers
    batches = len(scanner.batches)
    chunk = scanner.batches[0]
    tokens = int(scanner.chunks.numel())
    geometry = source.geometry
    differs = _differs(engine)
    units = dict(units) if units is not None else _unit_seconds(scanner, formats, differs)
    calibration_seconds = units.pop("_measured_in", 0.0)
    track_forward = units.get("difference_forward", units["layer_forward"]) if differs else units["layer_forward"]
    reference_pass = units.get("reference_pass", units["layer_forward"]) if differs else 0.0

    layer_forwards = head_forwards = layer_reads = quantizations = 0

    def seconds_of(forwards, heads, reads):
        return forwards * units["layer_forward"] + heads * units["head_forward"] + reads * units["layer_read"]

    layer_device_bytes = sum(t.numel for t in source.groups()[GroupId.layer_group(0)]) * \
        torch.empty((), dtype=engine.dtype).element_size()
    kept = min(layers, engine.stream.keep_bytes // max(1, layer_device_bytes))  # the first ones walked stay
    linear = engine.stream.linear_head
    layer_forwards += layers * batches  # the reference
    # its logits, and its summary's tail rows (head_kl.py; through the rounded head too for a difference-form head)
    head_forwards += batches * (1 + linear + scanner.head_in_differences)
    reference_head = units.get("reference_head", 0.0)  # a walk's reference logits, shared by its tracks
    layer_reads += layers
    reference_seconds = seconds_of(layer_forwards, head_forwards, layer_reads)
    group_seconds = []
    for i, pending in pending_by_group(todo).items():
        group = groups[i]
        measured = measured_formats(group, pending)
        if not measured:
            continue
        start = 0 if group.start < 0 else min(group.start, layers)
        params = copy_bytes(group) // 4
        forwards = heads = reads = 0
        quantizing = 0.0
        for f in measured:
            quantizations += 1
            quantizing += units["quantize_per_param"].get(f.name, 0.0) * params
        if any(f.method_for(scanner.rounding) != "rtn" for f in measured) and 0 <= group.start < layers:
            forwards += batches
            reads += int(group.start >= kept)
        walked = 0.0  # seconds of the tracks' layers beyond what seconds_of prices as plain forwards
        for sweep in format_batches(group, measured, limit):
            reads += layers - max(start, kept)
            forwards += (layers - start) * batches * len(sweep)
            heads += batches * len(sweep) * scanner.heads_per_cell(group)
            if scanner.head_in_differences and scanner.heads_per_cell(group) == 1:
                walked += batches * reference_head
            if differs:  # its own layer plain (none for the embedding's), the rest in difference form
                later = (layers - start - (0 <= group.start < layers)) * batches * len(sweep)
                walked += later * (track_forward - units["layer_forward"]) + (layers - start) * batches * reference_pass
        layer_forwards, head_forwards, layer_reads = layer_forwards + forwards, head_forwards + heads, layer_reads + reads
        device_part = seconds_of(forwards, heads, reads) + walked
        group_seconds.append(max(device_part, quantizing) if rounds_ahead else device_part + quantizing)
    layer_params = _layer_params(source)
    head_params = geometry.vocab_size * geometry.hidden_size
    per_token = layer_flops(geometry, chunk.shape[1], layer_params)
    flops = (layer_forwards * per_token + head_forwards * 2 * head_params) * chunk.numel()
    layer_bytes = sum(t.nbytes for t in source.groups()[GroupId.layer_group(0)])
    hidden_bytes = chunk.numel() * geometry.hidden_size * torch.empty((), dtype=engine.dtype).element_size()
    bytes_read = layer_reads * layer_bytes
    moved = bytes_read + layer_forwards * hidden_bytes * (2 if engine.device.type == "cuda" else 0)
    activations = (layers + 1) * tokens * geometry.hidden_size * torch.empty((), dtype=engine.dtype).element_size()
    reference = tokens * summary_bytes(geometry.hidden_size, scanner.head_in_differences) if linear else 0
    # the reference pass's logits, probabilities and log-probabilities of one slice (a cell's buffer is one)
    head_buffers = (3 + scanner.head_in_differences) * scanner.positions * geometry.vocab_size * 4
    peak = (activations + reference + limit * (2 if rounds_ahead else 1) + 2 * layer_params * 4 + 2 * head_params * 4
            + head_buffers)
    seconds = reference_seconds + sum(group_seconds)
    if differs and windows:  # the rounds' reference passes instead of each group's own
        for together, window in walk_windows(scanner, groups, pending_by_group(todo)):
            sweeps = [(groups[i].start, len(format_batches(groups[i], measured_formats(groups[i], pending), limit)))
                      for i, pending in window]
            sweeps = [(start, n) for start, n in sweeps if n]  # a group with nothing to measure is not walked
            if together and sweeps:
                first = min(start for start, _ in sweeps)
                passes = sum((layers - start) * n for start, n in sweeps) - (layers - first)
                saved_reads = sum((layers - max(start, kept)) * n for start, n in sweeps) - (layers - max(first, kept))
                seconds -= passes * batches * reference_pass + saved_reads * units["layer_read"]
                seconds -= (sum(n for _, n in sweeps) - 1) * batches * reference_head
                layer_reads -= saved_reads
    return ScanEstimate(layer_forwards, head_forwards, layer_reads, quantizations, flops, bytes_read, moved, peak,
                        seconds, calibration_seconds, units, reference_seconds, group_seconds)


def _differs(engine) -> bool:
    """Whether the scan's tracks will run in difference form (as far as can be known before running: a
    layer whose reference pass fails its check turns it off)."""
    from ..engine.difference import unsupported
    from ..engine import DIFFERENCES

    return getattr(engine, "compute", None) == DIFFERENCES and unsupported(engine.stream.layers[0]) is None


def _layer_params(source) -> int:
    return sum(t.numel for t in source.groups()[GroupId.layer_group(0)] if len(t.shape) >= 2)


QUANTIZER_ROWS = 256  # rows of the largest matrix each format's quantizer is timed on


@torch.no_grad()
def _unit_seconds(scanner, formats, differs: bool = False) -> dict:
    """Seconds for one layer read, one layer forward over one batch, one head forward over one batch,
    and each format's quantizer per parameter, measured on this device with the scan's own shapes; in
    difference form also a layer's reference pass and a track's difference forward."""
    engine, stream, source = scanner.engine, scanner.stream, scanner.source
    began = time.perf_counter()
    group = GroupId.layer_group(0)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    t = time.perf_counter()
    stream.load(group)
    sync()
    read = time.perf_counter() - t
    hidden = engine.embed(scanner.batches[:1])[0]
    forward = _median_seconds(lambda: stream.run_layer(0, hidden), sync)
    differences = {}
    if differs:
        from ..engine.difference import DifferenceLayer

        form = DifferenceLayer(stream.layers[0])
        kwargs = stream.layer_kwargs(hidden.shape[0], hidden.shape[1])[0]
        ref = form.reference(hidden, kwargs)
        moved = hidden * 1.001
        differences = {"reference_pass": _median_seconds(lambda: form.reference(hidden, kwargs), sync),
                       "difference_forward": _median_seconds(lambda: form.forward(ref, moved, kwargs), sync)}
        del form, ref, moved
    stream.unload(group)
    # the head timed on a seeded random hidden state, which the final norm makes look like a last layer's to
    # the head (logits spread over tens of nats, as measured); the embedding's own rows through a tied head
    # spread over ~300, and such a slice took 2x as long on both Qwen models: a 45 % too long estimate
    generator = torch.Generator().manual_seed(0)
    piece = torch.randn(hidden[:1, :scanner.positions].shape, generator=generator).to(hidden.device, hidden.dtype)
    reference_slice = 0.0
    with engine.head():
        if stream.linear_head:  # a cell's slice as the scan computes it, against a summary of the same slice
            normed = stream.final_norm(piece)
            ref, tail = summarize(stream.head_logits(normed), normed, stream.head_matrix(),
                                  rounded=scanner.head_in_differences)
            head_slice = lambda: scanner.summarized_slice(piece, ref, tail)  # noqa: E731
            kl_factor = 1.0
            if scanner.head_in_differences:  # in difference form, and the reference logits a walk's tracks share
                reference_logits, out = scanner._slice_buffer(2, piece.shape[1])
                reference_logits = stream.head_logits(normed, out=reference_logits)
                moved = piece + 1e-3 * piece.roll(1, -1)  # a change the final norm does not scale away
                head_slice = lambda: scanner.difference_slice(moved, normed, reference_logits,  # noqa: E731
                                                              stream.head_matrix(), ref, tail, out)
                reference_slice = _median_seconds(lambda: stream.head_logits(normed, out=reference_logits), sync)
        else:  # the log-softmax comparison: about two more vocabulary-wide passes than the logits alone
            head_slice = lambda: stream.logits(piece)  # noqa: E731
            kl_factor = 1.5
        slice_seconds = _median_seconds(head_slice, sync)
    slices = hidden.shape[0] * -(-hidden.shape[1] // scanner.positions)
    head_forward = slice_seconds * slices * kl_factor
    if scanner.head_in_differences:
        differences["reference_head"] = reference_slice * slices
    largest = max((t for t in source.groups()[group] if len(t.shape) >= 2), key=lambda t: t.numel)
    weight = source.read(largest.name)[:QUANTIZER_ROWS]  # ggml rounds rows apart: a slice times it per value
    per_param = {}
    for fmt in formats:
        method = fmt.method_for(scanner.rounding)
        # warm-up on a few rows: the first call loads ggml and builds its tables (seconds, once)
        fmt.roundtrip(largest.name, weight[:32], _synthetic_calibration(method, weight[:32]), method)
        t = time.perf_counter()
        fmt.roundtrip(largest.name, weight, _synthetic_calibration(method, weight), method)
        per_param[fmt.name] = (time.perf_counter() - t) / weight.numel()
    return {"layer_read": read, "layer_forward": forward, "head_forward": head_forward, **differences,
            "quantize_per_param": per_param, "_measured_in": time.perf_counter() - began}


def _median_seconds(work, sync, repeats: int = 3) -> float:
    """The median of `repeats` timed calls after one warm-up (kernels, rotary tables, first-touch pages):
    one timed call swung a unit by 10 % from run to run on 2 cores, and the estimate multiplies it by
    hundreds."""
    work()
    sync()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        work()
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _synthetic_calibration(method: str, weight: torch.Tensor) -> Calibration | None:
    """Statistics of the right shape for timing a data-aware quantizer (its cost does not depend on them)."""
    columns = weight.shape[-1]
    if method == "imatrix":
        return Calibration(imatrix=torch.ones(columns))
    if method == "gptq":
        return Calibration(hessian=torch.eye(columns))
    if method == "awq":
        return Calibration(inputs=torch.randn(256, columns, generator=torch.Generator().manual_seed(0)))
    return None
