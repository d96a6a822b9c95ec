"""Layer-level evaluation: how far each format x method moves one Linear's output on its real inputs."""

from __future__ import annotations

import torch

from ..formats import Calibration, get_format
from .imatrix import hessian_from_inputs, imatrix_from_inputs


def layer_errors(name: str, weight: torch.Tensor, inputs: torch.Tensor, formats: list[str],
                 methods: tuple[str, ...] = ("rtn", "gptq", "awq", "imatrix")) -> dict[str, dict[str, float]]:
    """{format: {method: ||X W^T - X Wq^T||^2 / ||X W^T||^2}} for the methods each format takes."""
    x = inputs.reshape(-1, inputs.shape[-1]).to(torch.float32)
    w = weight.to(torch.float32)
    calibration = Calibration(imatrix=imatrix_from_inputs(x), hessian=hessian_from_inputs(x), inputs=x[:4096])
    reference = x @ w.T
    norm = float((reference ** 2).sum())
    out: dict[str, dict[str, float]] = {}
    for fmt_name in formats:
        fmt = get_format(fmt_name)
        out[fmt.name] = {}
        for method in methods:
            if method in fmt.methods():
                q = fmt.roundtrip(name, w, calibration, method)
                out[fmt.name][method] = float(((x @ q.T - reference) ** 2).sum()) / norm
    return out
