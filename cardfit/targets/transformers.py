"""transformers: a compressed-tensors checkpoint decompressed by compressed-tensors' own code.

Not a serving target of its own (it is how `check` reads a checkpoint directory when vLLM is not
at hand), so it has no overhead model and `budget` does not offer it."""

from __future__ import annotations

from pathlib import Path

from .base import Target
from .vllm import GPU_FORMATS


def load_transformers(path: Path, n_ctx: int = 512, device: str = "cpu"):
    from .runtimes import TransformersRuntime

    return TransformersRuntime(path, device)


TARGET = Target(name="transformers", summary="transformers + compressed-tensors (check's reader of checkpoints)",
                family="vllm", formats=GPU_FORMATS, artifact="compressed-tensors", load=load_transformers,
                reads_by_default="compressed-tensors")
