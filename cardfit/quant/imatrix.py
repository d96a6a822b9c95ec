"""Importance matrices with llama.cpp's semantics: the mean of x^2 per input column.

llama.cpp's `llama-imatrix` accumulates, for every matrix a token passes through, the sum
of squared activations of each input column and the number of tokens; the importance of a
column is sum / count. `ImatrixCollector` hooks torch Linear layers and does the same.
"""

from __future__ import annotations

import torch


class ImatrixCollector:
    def __init__(self, model: torch.nn.Module, names: set[str] | None = None):
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}
        self._hooks = []
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and (names is None or f"{name}.weight" in names):
                self._hooks.append(module.register_forward_hook(self._hook(f"{name}.weight")))

    def _hook(self, key: str):
        def record(module, args, output):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)
            total = (x * x).sum(dim=0)
            self.sums[key] = self.sums.get(key, 0) + total.cpu()
            self.counts[key] = self.counts.get(key, 0) + x.shape[0]

        return record

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def imatrix(self) -> dict[str, torch.Tensor]:
        return {k: self.sums[k] / self.counts[k] for k in self.sums}


def imatrix_from_inputs(inputs: torch.Tensor) -> torch.Tensor:
    x = inputs.detach().reshape(-1, inputs.shape[-1]).to(torch.float32)
    return (x * x).mean(dim=0)


def hessian_from_inputs(inputs: torch.Tensor) -> torch.Tensor:
    """X^T X / n, the (scaled) GPTQ Hessian; accumulate in float64 on long calibrations upstream."""
    x = inputs.detach().reshape(-1, inputs.shape[-1]).to(torch.float32)
    return x.T @ x / x.shape[0]
