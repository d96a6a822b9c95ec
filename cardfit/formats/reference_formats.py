"""bitsandbytes NF4 and LLM.int8 as reference rows for `compare`.

cardfit does not pack these (no runtime here serves them from a file we write); it
prices and rounds them the way bitsandbytes stores them, so comparison rows are
measured, not guessed. The NF4 code book and the block layout are bitsandbytes'
(blocksize 64, one fp32 absmax per block, no double quantization). The arithmetic is
done here in torch so a CPU-only machine where bitsandbytes cannot load still works.
"""

from __future__ import annotations

import torch

from .base import Format, numel
from .int_formats import is_decoder_linear

NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
])


class Nf4Format(Format):
    name = "NF4"
    runtime = "reference"
    bits = 4.5
    blocksize = 64

    def storage(self, name, shape):
        return "NF4" if is_decoder_linear(name, shape) else "BF16"

    def tensor_bytes(self, name, shape):
        n = numel(shape)
        if not is_decoder_linear(name, shape):
            return n * 2
        return (n + 1) // 2 + -(-n // self.blocksize) * 4

    def roundtrip(self, name, weight, calibration=None, method="rtn"):
        if not is_decoder_linear(name, tuple(weight.shape)):
            return weight.detach().to(torch.bfloat16).to(torch.float32)
        flat = weight.detach().to(torch.float32).reshape(-1)
        pad = (-flat.numel()) % self.blocksize
        blocks = torch.nn.functional.pad(flat, (0, pad)).reshape(-1, self.blocksize)
        absmax = blocks.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        code = NF4_CODE.to(weight.device)
        idx = torch.argmin((blocks / absmax).unsqueeze(-1).sub(code).abs(), dim=-1)
        out = (code[idx] * absmax).reshape(-1)[: flat.numel()]
        return out.reshape(weight.shape)


class Int8RowFormat(Format):
    """LLM.int8 weight storage: int8 per row with one fp32 absmax scale per row."""

    name = "INT8"
    runtime = "reference"
    bits = 8.0

    def storage(self, name, shape):
        return "INT8" if is_decoder_linear(name, shape) else "BF16"

    def tensor_bytes(self, name, shape):
        if not is_decoder_linear(name, shape):
            return numel(shape) * 2
        return numel(shape) + shape[0] * 4

    def roundtrip(self, name, weight, calibration=None, method="rtn"):
        if not is_decoder_linear(name, tuple(weight.shape)):
            return weight.detach().to(torch.bfloat16).to(torch.float32)
        w = weight.detach().to(torch.float32)
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
        return torch.clamp(torch.round(w / scale), -127, 127) * scale
