"""A Hugging Face model directory read through safetensors memory maps."""

from __future__ import annotations

import hashlib
import json
import math
from functools import cached_property
from pathlib import Path

import torch
from safetensors import safe_open

from ..architecture import geometry_from_config, load_config
from ..errors import CardfitError
from .base import DTYPE_BYTES, ModelSource, TensorInfo, group_of

INDEX = "model.safetensors.index.json"


class HfDirectorySource(ModelSource):
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = load_config(self.path)
        self.geometry = geometry_from_config(self.config, source=str(self.path / "config.json"))
        self._handles: dict[Path, object] = {}
        self._views: dict = {}  # per-expert name -> (fused checkpoint tensor, Placement, shape) (gpt-oss)
        self._shards = self._find_shards()
        self.check_against_config()  # headers only: a config that is not these weights' fails here

    def _find_shards(self) -> dict[str, Path]:
        """tensor name -> shard file; validated so that a missing shard fails here, not mid-scan."""
        index = self.path / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError, RecursionError):
                raise CardfitError(f"{index} is not a safetensors index (no weight_map)",
                                   "restore the model's original index file") from None
            shards = {name: self.path / file for name, file in weight_map.items()}
            for file in sorted(set(shards.values())):
                if not file.exists():
                    raise CardfitError(f"{index.name} names shard {file.name}, which is missing",
                                       "download the missing shard or restore the directory")
            return shards
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            if list(self.path.glob("*.bin")) or list(self.path.glob("*.pt")) or list(self.path.glob("*.pth")):
                raise CardfitError(f"{self.path} holds only pickle checkpoints (.bin/.pt), which cardfit never loads",
                                   "convert them to safetensors first (e.g. transformers save_pretrained "
                                   "with safe_serialization=True on a trusted machine)")
            raise CardfitError(f"no *.safetensors weights in {self.path}",
                               "point at a model directory with config.json and safetensors shards")
        shards = {}
        for file in files:
            for name in self._open(file).keys():
                shards[name] = file
        return shards

    def _open(self, file: Path):
        handle = self._handles.get(file)
        if handle is None:
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise CardfitError(f"{file} is not a readable safetensors file ({exc})",
                                   "re-download or re-save the shard") from None
            self._handles[file] = handle
        return handle

    @cached_property
    def _infos(self) -> list[TensorInfo]:
        infos = []
        for name, file in self._shards.items():
            handle = self._open(file)
            try:
                view = handle.get_slice(name)
            except Exception:
                raise CardfitError(f"{file.name} does not contain tensor {name} named by the index",
                                   "restore the model's original shards") from None
            infos.append(_info(name, tuple(view.get_shape()), view.get_dtype()))
        for file in set(self._shards.values()):
            self._check_length(file, [i for i in infos if self._shards[i.name] == file])
        return self._per_expert(infos)

    def _per_expert(self, infos: list[TensorInfo]) -> list[TensorInfo]:
        """A checkpoint of fused expert stacks (gpt-oss) as the per-expert matrices runtimes multiply
        (checkpoint_map.fused_views), each in the place of the stack it comes from."""
        from ..checkpoint_map import fused_views

        self._views = fused_views(self.geometry.model_type, {i.name: i.shape for i in infos})
        if not self._views:
            return infos
        dtypes = {i.name: i.dtype for i in infos}
        cut: dict[str, list[TensorInfo]] = {}
        for name, (fused, _, shape) in self._views.items():
            cut.setdefault(fused, []).append(_info(name, shape, dtypes[fused]))
        return [view for i in infos for view in cut.get(i.name, [i])]

    @staticmethod
    def _check_length(file: Path, infos: list[TensorInfo]) -> None:
        """A truncated shard has a valid header but too few data bytes; catch it before reading."""
        with open(file, "rb") as fh:
            header = int.from_bytes(fh.read(8), "little")
        expected = 8 + header + sum(i.nbytes for i in infos)
        actual = file.stat().st_size
        if actual < expected:
            raise CardfitError(f"{file} is truncated ({actual} of {expected} bytes)",
                               "re-download or re-save the shard")

    def tensors(self) -> list[TensorInfo]:
        return self._infos

    def read(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """A fresh handle per read: safetensors maps the whole shard, and every page a long-lived
        handle has touched stays in our resident set (the whole model, after one pass)."""
        view = self._views.get(name) if name not in self._shards else None
        if name not in self._shards and view is None:
            raise KeyError(name)
        with safe_open(str(self._shards[view[0] if view else name]), framework="pt") as handle:
            if view is None:
                tensor = handle.get_tensor(name)
            else:  # one expert's block of the fused stack is read, then its part cut out
                fused, place, _ = view
                tensor = place.within(handle.get_slice(fused)[place.expert]).contiguous()
            return tensor.clone() if dtype is None or dtype == tensor.dtype else tensor.to(dtype)

    SAMPLED = 256  # values from each end of every stored tensor that weights_sample hashes

    @cached_property
    def _weights_sample(self) -> str:
        digest = hashlib.sha256()
        for name in sorted(self._shards):
            view = self._open(self._shards[name]).get_slice(name)
            shape = view.get_shape()
            if not shape:
                continue  # a scalar says nothing a checkpoint's matrices do not
            edges = [tuple([slice(0, 1)] * (len(shape) - 1)) + (slice(0, self.SAMPLED),),
                     tuple(slice(n - 1, n) for n in shape[:-1]) + (slice(max(shape[-1] - self.SAMPLED, 0), None),)]
            digest.update(name.encode())
            for edge in edges:
                digest.update(view[edge].to(torch.float32).numpy().tobytes())
        return "sha256:" + digest.hexdigest()

    def weights_sample(self) -> str:
        """The values at both ends of every stored tensor (its first and last rows' first and last 256 values):
        a fine-tune or another checkpoint changes them; one weight changed elsewhere is not caught."""
        return self._weights_sample


def _info(name: str, shape: tuple[int, ...], dtype: str) -> TensorInfo:
    """A tensor's entry from its header: bytes as stored (unknown dtypes priced at 4 bytes)."""
    return TensorInfo(name, shape, dtype, math.prod(shape) * DTYPE_BYTES.get(dtype, 4), group_of(name))
