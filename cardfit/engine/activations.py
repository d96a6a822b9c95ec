"""Cached hidden states between layer groups: in memory while they fit, else safetensors on disk."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


class ActivationCache:
    """hidden[point][batch] for points 0..L (input of layer i; L = input of the final norm)."""

    def __init__(self, budget_bytes: int | None, spill_dir: str | Path | None = None):
        self.budget = budget_bytes
        self.used = 0
        self.memory: dict[tuple[int, int], torch.Tensor] = {}
        self._dir = None
        self._spill_parent = spill_dir

    def put(self, point: int, batch: int, hidden: torch.Tensor) -> None:
        size = hidden.numel() * hidden.element_size()
        if self.budget is None or self.used + size <= self.budget:
            self.memory[(point, batch)] = hidden.detach().cpu()
            self.used += size
            return
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="cardfit-acts-", dir=self._spill_parent))
        save_file({"h": hidden.detach().cpu().contiguous()}, str(self._dir / f"{point}-{batch}.safetensors"))

    def get(self, point: int, batch: int) -> torch.Tensor:
        if (point, batch) in self.memory:
            return self.memory[(point, batch)]
        with safe_open(str(self._dir / f"{point}-{batch}.safetensors"), framework="pt") as f:
            return f.get_tensor("h")

    def close(self) -> None:
        self.memory.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
