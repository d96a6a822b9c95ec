"""Rounding rules: RTN, GPTQ, AWQ and imatrix-weighted ggml quantization, device-agnostic."""

from __future__ import annotations

import torch

from ..errors import CardfitError
from .awq import awq_search
from .device import DeviceArena
from .gptq import gptq_quantize


def quantize_int(fmt, weight: torch.Tensor, calibration=None, method: str = "rtn", *,
                 arena: DeviceArena | None = None, act_order: bool = False, block_size: int = 128,
                 input_scale: torch.Tensor | None = None):
    """(int8 values, scales, zero points, AWQ input scale or None) for an integer group format."""
    w = weight.detach().to(torch.float32)
    fmt = fmt.resolve(tuple(w.shape))
    if method == "rtn":
        q, s, z = fmt.quantize_rtn(w)
        return q, s, z, None
    if method == "gptq":
        if calibration is None or calibration.hessian is None:
            raise CardfitError("GPTQ needs calibration statistics (a Hessian per tensor)",
                               "pass --calibration TEXT or use --method rtn")
        q, s, z = gptq_quantize(fmt, w, calibration.hessian, arena=arena, act_order=act_order,
                                block_size=block_size)
        return q, s, z, None
    if method == "awq":
        if input_scale is None:
            if calibration is None or calibration.inputs is None:
                raise CardfitError("AWQ needs calibration inputs", "pass --calibration TEXT or use --method rtn")
            input_scale = awq_search([w], calibration.inputs.to(w.device),
                                     lambda m: fmt.dequantize(*fmt.quantize_rtn(m)[:3]))
        q, s, z = fmt.quantize_rtn(w * input_scale)
        return q, s, z, input_scale
    raise CardfitError(f"method '{method}' does not apply to {fmt.name}",
                       "integer formats take --method rtn, gptq or awq")


__all__ = ["quantize_int", "gptq_quantize", "awq_search", "DeviceArena"]
