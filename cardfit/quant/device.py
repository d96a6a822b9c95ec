"""A device-memory cap that the quantizers honour by construction and measure as they go.

Every tensor a quantizer places on the compute device goes through `DeviceArena.put`,
which counts its bytes against the cap and records the peak; `free` gives them back. The
peak is therefore a measurement of what the algorithm actually held, on CPU or CUDA alike.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ..errors import CardfitError


def check_device(device: str | torch.device) -> torch.device:
    """The compute device a user named (cpu, cuda, cuda:N), refused in one line when torch cannot use it."""
    if isinstance(device, torch.device):
        return device
    text = str(device).strip().lower()
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise CardfitError(f"unknown --device '{device}'", "use --device cpu, cuda or cuda:N")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise CardfitError(f"--device {device} but torch {torch.__version__} sees no CUDA device",
                               "install a CUDA build of torch that matches your driver, or use --device cpu")
        if index and int(index) >= torch.cuda.device_count():
            raise CardfitError(f"--device {device} but torch sees {torch.cuda.device_count()} CUDA device(s)",
                               f"use cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return torch.device(text)


class DeviceArena:
    def __init__(self, device: str | torch.device = "cpu", cap_bytes: int | None = None):
        self.device = torch.device(device)
        self.cap = cap_bytes
        self.current = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def reserve(self, nbytes: int) -> None:
        if self.cap is not None and self.current + nbytes > self.cap:
            raise CardfitError(
                f"quantizer needs {(self.current + nbytes) / 2**20:.1f} MiB on {self.device}, over the "
                f"{self.cap / 2**20:.1f} MiB --memory-cap", "raise --memory-cap or use smaller column blocks")
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def put(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or tensor.dtype
        nbytes = tensor.numel() * torch.empty((), dtype=dtype).element_size()
        self.reserve(nbytes)
        out = tensor.to(self.device, dtype=dtype, copy=True)
        self._sizes[id(out)] = nbytes
        return out

    def zeros(self, shape, dtype=torch.float32) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        self.reserve(nbytes)
        out = torch.zeros(shape, dtype=dtype, device=self.device)
        self._sizes[id(out)] = nbytes
        return out

    def free(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.current -= self._sizes.pop(id(t), 0)


_current_arena: ContextVar["DeviceArena | None"] = ContextVar("cardfit_quantizer_arena", default=None)


@contextmanager
def quantizers_on(device: str | torch.device, cap_bytes: int | None = None):
    """Quantizers called inside put their working tensors on `device`, counted against `cap_bytes`:
    how a stage running on a GPU (`--device`, `--gpu-memory`) bounds what GPTQ holds there."""
    arena = DeviceArena(device, cap_bytes)
    token = _current_arena.set(arena)
    try:
        yield arena
    finally:
        _current_arena.reset(token)


def arena_for(weight: torch.Tensor) -> DeviceArena:
    """The stage's arena when one is set, else an uncapped one where the weight lives."""
    return _current_arena.get() or DeviceArena(weight.device)
