"""The one executor: every walk through the model (scan, refine, calibration, imatrix collection,
quantize_model, check's reference) runs here, layer-major, with many *tracks* per resident layer.

A track is the hidden states of the calibration batches under one set of replaced tensors: one
format of one group, a whole recipe, the reference. `walk` reads each decoder layer once and moves
every track through it (the track's replacements swapped in and back), so a sweep of F formats of
a group reads each later layer once instead of F times, and the head once instead of F times.
The engine counts every group read (`loads`); the scan reports them.

Where the walk runs is the device policy of `resolve_device`, `resolve_dtype` and `resolve_compute`:
CUDA when torch sees it; decoder layers in float32 unless `--dtype bfloat16` is asked for (the embedding,
final norm, head, log-softmax and KL sums are float32 always; resolve_dtype says why bf16 is not the
default); where bfloat16 matmuls are fast, a scan's tracks run the layers after their own, and the head,
as the reference plus bfloat16 products of their change (difference.py), which keeps the float32 map's
cells. Residency: on CUDA, layers stay on the device once read
while they fit under `gpu_memory` (default: 90 % of what is free when the engine starts, less the
head and a margin for activations), the next layer is read on a background thread while the current
one computes; on the CPU layers stream (a resident float32 copy would multiply the RSS).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from ..errors import CardfitError
from ..groups import EMBED, LM_HEAD, NORM, GroupId

Overrides = Mapping[str, torch.Tensor]
DTYPES = {"auto": None, "float32": torch.float32, "bfloat16-differences": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
DIFFERENCES = "bfloat16-differences"  # float32 layers; a scan's tracks as the reference plus bf16 products of their changes


def resolve_device(requested: str = "auto") -> tuple[torch.device, str]:
    """The compute device for `--device` (auto, cpu, cuda, cuda:N) and one line saying which and why."""
    from ..quant.device import check_device

    text = str(requested).strip().lower()
    if text != "auto":
        device = check_device(text)
        return device, f"computing on {device} (--device {requested})"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return torch.device("cuda:0"), f"computing on cuda:0 ({name}; --device auto found CUDA)"
    why = (f"torch {torch.__version__} has no CUDA" if torch.version.cuda is None
           else f"torch {torch.__version__} sees no CUDA device")
    return torch.device("cpu"), f"{why}: computing on the CPU"


def resolve_dtype(requested: str | torch.dtype | None) -> torch.dtype:
    """The decoder layers' compute dtype: float32 unless asked. Measured on the embedded model, bfloat16
    layers add a floor of 2e-4..1e-3 nats to every cell (Q8_0 cells 10-40x too high, Q4_K up to 82 % off;
    Q2_K within 8 %), which would blur exactly the near-lossless choices a plan makes; so bf16 is an
    opt-in for coarse, low-bit scans, on CUDA as on the CPU (docs/benchmarks.md, issue 18)."""
    if isinstance(requested, torch.dtype):
        return requested
    return DTYPES[_dtype_key(requested)] or torch.float32


def _dtype_key(requested: str | None) -> str:
    key = "auto" if requested is None else str(requested).strip().lower()
    if key not in DTYPES:
        raise CardfitError(f"unknown --dtype '{requested}'", "use --dtype " + ", ".join(DTYPES))
    return key


def resolve_compute(requested: str | torch.dtype | None, device: torch.device) -> str:
    """What `--dtype` means on `device`, as a map records it: auto is bfloat16-differences where bfloat16
    matmuls run fast (difference.fast_bfloat16), else float32; any other value is itself."""
    from .difference import fast_bfloat16

    if isinstance(requested, torch.dtype):
        return str(requested).removeprefix("torch.")
    key = _dtype_key(requested)
    if key == "auto":
        return DIFFERENCES if fast_bfloat16(device) else "float32"
    return key


def default_keep_bytes(device: torch.device, gpu_memory: int | None, source) -> int:
    """Bytes of decoder layers that may stay resident: none on the CPU, else what `gpu_memory` (or 90 %
    of the free device memory) leaves after the float32 head and a quarter for activations."""
    if device.type != "cuda":
        return 0
    if gpu_memory is None:
        free, _ = torch.cuda.mem_get_info(device)
        gpu_memory = int(free * 0.9)
    groups = source.groups()
    head = sum(t.numel * 4 for g in (EMBED, NORM, LM_HEAD) for t in groups.get(g, []))
    return max(0, int((gpu_memory - head) * 0.75))


@dataclass
class Track:
    """Hidden states (one tensor per calibration batch) under one set of replaced tensors.

    `start` is the first decoder layer the track runs (its hidden states are that layer's input);
    `overrides` maps tensor names to replacements, or is a function of a group name giving them
    (so a whole recipe's quantized tensors are made one layer at a time, as the walk reaches it)."""

    hidden: list[torch.Tensor]
    start: int = 0
    overrides: Overrides | Callable[[str], Overrides] = field(default_factory=dict)
    key: object = None

    def replacements(self, group: str) -> Overrides:
        return self.overrides(group) if callable(self.overrides) else self.overrides


class Engine:
    """A streamed model plus the walks every stage needs."""

    def __init__(self, source, device: str | torch.device = "auto", dtype: str | torch.dtype | None = "auto",
                 gpu_memory: int | None = None, log: Callable[[str], None] | None = None):
        from .streamed import StreamedModel

        self.device, self.device_reason = (resolve_device(device) if not isinstance(device, torch.device)
                                           else (device, f"computing on {device}"))
        self.dtype = resolve_dtype(dtype)
        self.compute = resolve_compute(dtype, self.device)
        self._refused: str | None = None if self.compute == DIFFERENCES else "not asked"  # why difference form is off
        self._unsupported: dict[int, str] = {}  # layer -> why it cannot run in difference form
        self._workspace = None  # difference.Workspace: its buffers kept across tracks and layers
        if log:
            log(f"{self.device_reason}, decoder layers in {str(self.dtype).removeprefix('torch.')}"
                + (", a scan's tracks as the reference plus bfloat16 products of their changes"
                   if self.compute == DIFFERENCES else ""))
        self.log = log
        keep = default_keep_bytes(self.device, gpu_memory, source)
        self.stream = StreamedModel(source, device=self.device, dtype=self.dtype, keep_bytes=keep,
                                    prefetch=self.device.type == "cuda")
        self.layers = len(self.stream.layers)
        self.tied = self.stream.tied
        self.gpu_memory = gpu_memory

    def quantizers(self):
        """Context in which quantizers work on this engine's device under `gpu_memory` (GPTQ's arena);
        on the CPU they keep working where the weights are."""
        from ..quant.device import quantizers_on

        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return quantizers_on(self.device, self.gpu_memory)

    @property
    def loads(self):
        """Group -> number of times its weights were read from the source."""
        return self.stream.loads

    def layer_loads(self) -> int:
        return sum(n for g, n in self.loads.items() if GroupId(g).in_layer)

    def close(self) -> None:
        self.stream.close()

    # -- walks ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def embed(self, batches: Iterable[torch.Tensor], overrides: Overrides | None = None) -> list[torch.Tensor]:
        with self.stream.resident(EMBED, overrides):
            return [self.stream.embed(ids) for ids in batches]

    @torch.no_grad()
    def walk(self, tracks: list[Track], end: int | None = None,
             before_layer: Callable[[int, list[Track]], None] | None = None,
             reference: Callable[[int, int], torch.Tensor] | None = None) -> list[Track]:
        """Move every track from its start through layer `end - 1` (default: the last), each layer read
        once for all tracks; `before_layer(i, active)` sees the tracks about to enter layer i.

        `reference(i, b)` (a scan's cache: the reference's hidden states entering layer i, batch b, for i up
        to the last layer's output) lets a bfloat16-differences engine run the tracks that replace nothing
        in a layer as the reference plus their change (difference.py)."""
        end = self.layers if end is None else end
        first = min((t.start for t in tracks), default=end)
        for i in range(first, end):
            active = [t for t in tracks if t.start <= i]
            group = GroupId.layer_group(i)
            if i + 1 < end:
                self.stream.prefetch(GroupId.layer_group(i + 1))
            if before_layer:
                before_layer(i, active)
            with self.stream.resident(group):
                differing = []
                for track in active:
                    overrides = track.replacements(group)
                    replaces = any(name in overrides for name in self.stream.group_tensors(group))
                    if not replaces and reference is not None and self._differs(i):
                        differing.append(track)
                        continue
                    with self.stream.swapped(group, overrides):
                        track.hidden = [self.stream.run_layer(i, h) for h in track.hidden]
                if differing:
                    self._run_differences(i, differing, reference)
        for track in tracks:
            track.start = max(track.start, end)
        return tracks

    def _differs(self, index: int) -> bool:
        """Whether layer `index` runs tracks in difference form (and if a layer cannot, says why, once)."""
        if self._refused is not None:
            return False
        if index not in self._unsupported:
            from .difference import unsupported

            why = unsupported(self.stream.layers[index]) or ""
            if why and self.log and why not in self._unsupported.values():
                self.log(f"{why}: such layers run whole in float32")
            self._unsupported[index] = why
        return not self._unsupported[index]

    def _run_differences(self, index: int, tracks: list[Track], reference: Callable[[int, int], torch.Tensor]) -> None:
        """Each batch's reference intermediates at layer `index` once, every track as them plus its change;
        a reference pass that does not reproduce the layer's own output turns difference form off."""
        from .difference import CHECK_TOLERANCE, DifferenceLayer, Workspace

        self._workspace = self._workspace or Workspace()
        layer = DifferenceLayer(self.stream.layers[index])
        for b in range(len(tracks[0].hidden)):
            inputs = reference(index, b).to(self.device, self.dtype)
            kwargs = self.stream.layer_kwargs(inputs.shape[0], inputs.shape[1])[index]
            ref = layer.reference(inputs, kwargs)
            expected = reference(index + 1, b).to(self.device, self.dtype)
            miss = float((ref.out - expected).abs().max() / expected.abs().max().clamp_min(1e-30))
            if not miss <= CHECK_TOLERANCE:
                self._refused = f"layer {index}'s reference pass is {miss:.1e} off its own output"
                if self.log:
                    self.log(f"{self._refused}: tracks run whole in float32 from here")
                for track in tracks:
                    track.hidden[b:] = [self.stream.run_layer(index, h) for h in track.hidden[b:]]
                return
            for track in tracks:
                track.hidden[b] = layer.forward(ref, track.hidden[b].to(self.device, self.dtype), kwargs,
                                                self._workspace)
            del ref

    @torch.no_grad()
    def step(self, index: int, hidden: list[torch.Tensor], overrides: Overrides | None = None) -> list[torch.Tensor]:
        """One layer of one track: for walks whose next layer depends on this one's result (GPTQ)."""
        track = Track(hidden, index, overrides or {})
        return self.walk([track], end=index + 1)[0].hidden

    def head(self):
        """Context holding the final norm and the output matrix resident (read once for many tracks)."""
        stack = contextlib.ExitStack()
        for g in (NORM, EMBED if self.tied else LM_HEAD):
            stack.enter_context(self.stream.resident(g))
        return stack

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, overrides: Overrides | None = None) -> torch.Tensor:
        """Float32 logits of the whole model for one batch of token ids."""
        track = Track(self.embed([input_ids], overrides), 0, overrides or {})
        self.walk([track])
        return self.stream.logits(track.hidden[0], overrides)  # the head takes the names that are its own
