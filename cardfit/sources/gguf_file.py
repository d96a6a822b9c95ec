"""A GGUF file as a model source: tensors listed from its header, dequantized one at a time by gguf-py."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from ..architecture import geometry_from_config
from ..errors import CardfitError
from .base import ModelSource, TensorInfo, group_of


def _reader(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path), "r")
    except Exception as exc:
        raise CardfitError(f"{path} is not a readable GGUF file ({exc.__class__.__name__}: {exc})",
                           "re-download the file or convert the model again") from None


def gguf_config(path: Path) -> dict:
    """The transformers config a GGUF's metadata implies (transformers reads only the header here)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:
        raise CardfitError(f"cannot derive a model config from {path.name} ({exc.__class__.__name__}: {exc})",
                           "use a GGUF of a supported architecture or the original model directory") from None
    return config.to_dict()


class GgufSource(ModelSource):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise CardfitError(f"no GGUF file at {self.path}", "check the path")
        self._gguf = _reader(self.path)
        self.config = gguf_config(self.path)
        self.geometry = geometry_from_config(self.config, source=str(self.path))

    @cached_property
    def _by_name(self):
        return {t.name: t for t in self._gguf.tensors}

    def tensors(self) -> list[TensorInfo]:
        return [TensorInfo(t.name, tuple(int(d) for d in reversed(t.shape)), t.tensor_type.name,
                           int(t.n_bytes), group_of(t.name)) for t in self._gguf.tensors]

    def read(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        import gguf

        tensor = self._by_name[name]
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise CardfitError(f"{self.path.name}: tensor {name} has type {tensor.tensor_type.name}, "
                               "which gguf-py cannot dequantize", "use an F16/BF16/Q8_0/K-quant GGUF") from None
        shape = tuple(int(d) for d in reversed(tensor.shape))
        out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))
        return out if dtype is None else out.to(dtype)

    def materialize(self, out_dir: str | Path, dtype: torch.dtype = torch.float16) -> Path:
        """Write an HF directory (config, tokenizer, safetensors) that transformers runs.

        transformers' GGUF loader undoes llama.cpp's converter transforms (Q/K rotary
        permutation, Gemma's norm offset), so the result computes what the GGUF computes.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        from ..atomic import atomic_directory

        out_dir = Path(out_dir)
        with atomic_directory(out_dir) as tmp:
            model = AutoModelForCausalLM.from_pretrained(
                str(self.path.parent), gguf_file=self.path.name, dtype=dtype,
                quantization_config=GgufConfig(dequantize=True))
            if getattr(model, "hf_quantizer", None) is not None:
                model = model.dequantize(dtype=dtype)
            model.save_pretrained(tmp, safe_serialization=True)
            AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name).save_pretrained(tmp)
            del model
        return out_dir
