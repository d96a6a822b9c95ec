"""What every weight format knows: its exact bytes for a tensor and its round trip.

A format is applied to a tensor by name and shape, because runtimes treat tensors
differently: llama.cpp keeps 1-D tensors in F32 and falls back to a 32-block type when a
row is not a multiple of 256; vLLM keeps embeddings and lm_head unquantized. `storage`
says what a tensor actually becomes, so scan prices, plan counts and pack writes the same
thing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Calibration:
    """Per-tensor calibration statistics a data-aware rounding may use.

    imatrix  mean squared activation per input column (llama.cpp's importance matrix)
    hessian  X^T X / n over calibration tokens, (in, in), for GPTQ
    act_mean mean |activation| per input column, for AWQ's scale search
    inputs   a sample of the tensor's inputs (tokens, in), for AWQ's loss
    tokens   the input rows the statistics average (a routed expert's: the tokens routed to it; 0 when
             none was, and the statistics are the stand-ins quant/model.py gives such an expert)
    importance what a squared error in each input column costs the layer's output per token, where that
             is not the imatrix: a routed expert's sum of (routing weight x input)^2 over the layer's
             tokens (a rarely chosen, lightly weighted expert costs little); the weight signal reads it
    """

    imatrix: torch.Tensor | None = None
    hessian: torch.Tensor | None = None
    act_mean: torch.Tensor | None = None
    inputs: torch.Tensor | None = None
    tokens: int | None = None
    importance: torch.Tensor | None = None


class Format:
    name: str
    runtime: str  # "llama.cpp", "vllm", or "reference" (comparison rows only)
    bits: float  # nominal bits per weight of a quantized 2-D tensor, for display and ordering

    def storage(self, name: str, shape: tuple[int, ...]) -> str:
        """The concrete storage type this tensor gets under this format."""
        raise NotImplementedError

    def tensor_bytes(self, name: str, shape: tuple[int, ...]) -> int:
        raise NotImplementedError

    def roundtrip(self, name: str, weight: torch.Tensor, calibration: Calibration | None = None,
                  method: str = "rtn") -> torch.Tensor:
        """The weight as the runtime will compute with it after this format stores it."""
        raise NotImplementedError

    def rounding_key(self, name: str, shape: tuple[int, ...], requested: str) -> tuple:
        """Formats whose keys are equal round this tensor to the same values with the same statistics:
        the round trip depends only on the storage it resolves to and the rounding used (a K-quant whose
        rows its block does not divide stores its fallback, Q4_K's 896-wide rows are Q5_0's), so a
        caller rounds it once for all of them (tests/test_fisher.py)."""
        return type(self), self.storage(name, shape), self.method_for(requested)

    def rows_apart(self, method: str) -> bool:
        """Whether `method` rounds each row of a matrix apart from the others, so a subset of the rows comes back
        exactly as inside the whole (what lets a signal price a large matrix from a sample of its rows)."""
        return False

    def methods(self) -> tuple[str, ...]:
        """The roundings this format takes, its default first."""
        return ("rtn",)

    def method_for(self, requested: str) -> str:
        """The rounding this format uses when `requested` is asked for: itself if the format takes it;
        for GPTQ on a format that takes an imatrix, the imatrix (GPTQ's Hessian diagonal is that mean x²);
        otherwise the format's default (RTN, or the imatrix for a type that cannot round without one)."""
        methods = self.methods()
        if requested in methods:
            return requested
        if requested == "gptq" and "imatrix" in methods:
            return "imatrix"
        return methods[0]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
