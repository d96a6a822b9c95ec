"""A model as a list of tensors grouped the way cardfit prices them.

A source answers names, shapes and dtypes from file headers alone; `read(name)` pulls
one tensor through a memory map, so nothing larger than the tensor asked for is ever
resident.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..architecture import ModelGeometry

EMBED, NORM, LM_HEAD, OTHER = "embed", "norm", "lm_head", "other"

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name, or a GGUF type name for GGUF sources
    nbytes: int
    group: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|blk)\.(\d+)\.")


def group_of(name: str) -> str:
    """Layer group of an HF or GGUF tensor name: embed, layers.N, norm, lm_head or other."""
    match = _LAYER.search(name)
    if match:
        return f"layers.{int(match.group(1))}"
    if "vision" in name or "visual" in name or "multi_modal" in name or "audio" in name:
        return OTHER
    if name.endswith(("embed_tokens.weight", "wte.weight", "token_embd.weight", "tok_embeddings.weight")):
        return EMBED
    if name.startswith("lm_head") or name in ("output.weight",) or name.endswith(".lm_head.weight"):
        return LM_HEAD
    if name.endswith(("model.norm.weight", "norm_f.weight", "ln_f.weight", "output_norm.weight",
                      "final_layernorm.weight")) or name == "norm.weight":
        return NORM
    return OTHER


def group_sort_key(group: str) -> tuple:
    if group == EMBED:
        return (0, 0)
    if group.startswith("layers."):
        return (1, int(group.split(".")[1]))
    return {NORM: (2, 0), LM_HEAD: (3, 0)}.get(group, (4, 0))


class ModelSource:
    """Common surface of every model source."""

    path: Path
    geometry: ModelGeometry
    config: dict

    def tensors(self) -> list[TensorInfo]:
        raise NotImplementedError

    def read(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    @property
    def tied_embeddings(self) -> bool:
        names = {t.name for t in self.tensors()}
        has_head = any(group_of(n) == LM_HEAD for n in names)
        return self.geometry.tie_word_embeddings or not has_head

    def groups(self) -> dict[str, list[TensorInfo]]:
        """Tensors by layer group, in forward order; a tied lm_head is priced once, with embed."""
        out: dict[str, list[TensorInfo]] = {}
        for info in self.tensors():
            out.setdefault(info.group, []).append(info)
        return dict(sorted(out.items(), key=lambda kv: group_sort_key(kv[0])))

    @property
    def stored_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def fingerprint(self) -> str:
        """Content hash of config and tensor index (names, shapes, dtypes): names the model in artifacts."""
        digest = hashlib.sha256()
        digest.update(json.dumps(self.config, sort_keys=True).encode())
        for t in sorted(self.tensors(), key=lambda t: t.name):
            digest.update(f"{t.name}|{t.shape}|{t.dtype}\n".encode())
        return "sha256:" + digest.hexdigest()
