"""Integer weight-only group formats as compressed-tensors stores them and vLLM serves them.

Arithmetic follows compressed-tensors' `calculate_qparams`: symmetric scale = absmax /
((2^b - 1) / 2), zero point 0, q in [-2^(b-1), 2^(b-1) - 1]; asymmetric scale =
(max - min) / (2^b - 1) over a range that always contains 0, zero point = qmin -
round(min / scale). Storage is the "pack-quantized" layout: int32 words of packed
values, one scale per (row, group) in the model's dtype, zero points packed along rows,
and the original shape as int64. Scales are rounded to float16, the dtype of the default
model (compressed-tensors stores them in the model's dtype; pass `scale_dtype` for bf16 models).
"""

from __future__ import annotations

import math

import torch

from ..groups import expert_stack
from .base import Format, numel

QUANTIZABLE_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                        "up_proj.weight", "down_proj.weight", "qkv_proj.weight", "gate_up_proj.weight",
                        "dense.weight", "fc1.weight", "fc2.weight")


# The same matrices under llama.cpp's names (gguf-py's TENSOR_NAMES for ATTN_Q/K/V, ATTN_QKV, ATTN_OUT,
# FFN_GATE/UP/DOWN; a fused gate_up is ffn_up there), so a .gguf's header prices as its directory does.
GGUF_QUANTIZABLE_SUFFIXES = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_qkv.weight",
                             "attn_output.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")


def is_decoder_linear(name: str, shape: tuple[int, ...]) -> bool:
    """Linear weights inside decoder layers: what `targets="Linear", ignore=["lm_head"]` quantizes.

    Hugging Face names (`model.layers.N.self_attn.q_proj.weight`) and llama.cpp's (`blk.N.attn_q.weight`)
    name the same matrices."""
    if len(shape) != 2:
        return False
    if name.startswith("blk."):
        return name.endswith(GGUF_QUANTIZABLE_SUFFIXES)
    return ".layers." in f".{name}" and name.endswith(QUANTIZABLE_SUFFIXES)


def is_packed_matrix(name: str, shape: tuple[int, ...]) -> bool:
    """What a compressed-tensors checkpoint stores packed: decoder Linears, and each routed expert's matrix
    (stored one per expert, as llmcompressor writes them: vLLM's fused MoE and transformers' fused experts
    stack them at load). bitsandbytes quantizes Linear modules only, so it keeps `is_decoder_linear`."""
    return is_decoder_linear(name, shape) or (len(shape) == 2 and expert_stack(name) is not None)


class DenseFormat(Format):
    """Unquantized 16-bit storage (the model's dtype), as vLLM keeps embeddings, norms and ignored layers."""

    runtime = "vllm"
    bits = 16.0

    def __init__(self, name: str = "BF16"):
        self.name = name

    def storage(self, name, shape):
        return self.name

    def tensor_bytes(self, name, shape):
        return numel(shape) * 2

    def roundtrip(self, name, weight, calibration=None, method="rtn"):
        dtype = torch.bfloat16 if self.name == "BF16" else torch.float16
        return weight.detach().to(dtype).to(torch.float32)


class IntGroupFormat(Format):
    runtime = "vllm"

    def __init__(self, bits: int, group_size: int, symmetric: bool = True, scale_dtype: torch.dtype = torch.float16):
        self.num_bits = bits
        self.group_size = group_size  # -1: one group per output channel
        self.symmetric = symmetric
        self.scale_dtype = scale_dtype
        suffix = "" if group_size == -1 else f"-g{group_size}"
        self.name = f"W{bits}A16{suffix}{'' if symmetric else '-asym'}"
        self.bits = float(bits)

    # -- layout -----------------------------------------------------------------------------------------
    def resolve(self, shape: tuple[int, ...]) -> "IntGroupFormat":
        """The format this tensor really gets: compressed-tensors refuses a group size that does
        not divide the row, so we fall back to the next group size vLLM's kernels serve
        (128 -> 64 -> 32 -> per channel), as llama.cpp falls back for k-quants."""
        in_f = shape[-1]
        size = self.group_size
        while size != -1 and in_f % size:
            size = {128: 64, 64: 32}.get(size, -1)
        if size == self.group_size:
            return self
        return IntGroupFormat(self.num_bits, size, self.symmetric, self.scale_dtype)

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else math.ceil(in_features / self.group_size)

    def storage(self, name, shape):
        return self.resolve(shape).name if is_packed_matrix(name, shape) else "BF16"

    def tensor_bytes(self, name, shape):
        if not is_packed_matrix(name, shape):
            return numel(shape) * 2
        return self.resolve(shape)._packed_bytes(shape)

    def _packed_bytes(self, shape):
        out_f, in_f = shape
        g = self.groups(in_f)
        size = out_f * math.ceil(in_f * self.num_bits / 32) * 4  # weight_packed, int32
        size += out_f * g * 2  # weight_scale, 16-bit
        if not self.symmetric:
            size += math.ceil(out_f * self.num_bits / 32) * g * 4  # weight_zero_point, packed along rows
        return size + 2 * 8  # weight_shape, int64[2]

    def methods(self):
        return ("rtn", "gptq", "awq")

    # -- arithmetic -------------------------------------------------------------------------------------
    @property
    def qmin(self) -> int:
        return -(2 ** (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.num_bits - 1) - 1

    def qparams(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero point per row of `w` (rows = output channels, columns = one group)."""
        lo = torch.clamp(w.amin(dim=-1, keepdim=True), max=0)
        hi = torch.clamp(w.amax(dim=-1, keepdim=True), min=0)
        span = float(self.qmax - self.qmin)
        if self.symmetric:
            scale = torch.maximum(lo.abs(), hi) / (span / 2)
            zero = torch.zeros_like(scale)
        else:
            scale = (hi - lo) / span
        scale = scale.to(self.scale_dtype).to(w.dtype)
        scale = torch.where(scale == 0, torch.full_like(scale, torch.finfo(self.scale_dtype).eps), scale)
        if not self.symmetric:
            zero = torch.clamp(self.qmin - torch.round(lo / scale), self.qmin, self.qmax)
        return scale, zero

    def grouped(self, w: torch.Tensor):
        """Yield (column slice) for each group of the input dimension."""
        in_f = w.shape[1]
        step = in_f if self.group_size == -1 else self.group_size
        for start in range(0, in_f, step):
            yield slice(start, min(start + step, in_f))

    def quantize_rtn(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(int8 values, scales (out, groups), zero points (out, groups)) by round-to-nearest."""
        w = w.to(torch.float32)
        q = torch.empty_like(w, dtype=torch.int8)
        scales, zeros = [], []
        for cols in self.grouped(w):
            scale, zero = self.qparams(w[:, cols])
            q[:, cols] = torch.clamp(torch.round(w[:, cols] / scale) + zero, self.qmin, self.qmax).to(torch.int8)
            scales.append(scale)
            zeros.append(zero)
        return q, torch.cat(scales, dim=1), torch.cat(zeros, dim=1)

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        cols = torch.arange(q.shape[1], device=q.device)
        group = cols // (q.shape[1] if self.group_size == -1 else self.group_size)
        return (q.to(torch.float32) - zero[:, group]) * scale[:, group]

    def roundtrip(self, name, weight, calibration=None, method="rtn"):
        if not is_packed_matrix(name, tuple(weight.shape)):
            return DenseFormat().roundtrip(name, weight)
        from ..quant import quantize_int

        q, scale, zero, input_scale = quantize_int(self, weight, calibration, method)
        w = self.resolve(tuple(weight.shape)).dequantize(q, scale, zero)
        # AWQ stores Q(W * s) and divides s out of the activations; the effective weight is Q(W * s) / s.
        return w if input_scale is None else w / input_scale
