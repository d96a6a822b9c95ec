"""transformers + bitsandbytes NF4: the shelf's baseline, quantized at load from the full-precision
model (no file is packed for it), measured by `check --runtime bitsandbytes` and `compare`."""

from __future__ import annotations

from pathlib import Path

from ..errors import CardfitError
from .base import Target


def load_bitsandbytes(path: Path, n_ctx: int = 512, device: str = "cpu"):
    from .runtimes import BitsAndBytesRuntime

    if not (Path(path).is_dir() and (Path(path) / "config.json").exists()):
        raise CardfitError(f"bitsandbytes quantizes a full-precision model directory at load; {path} is not one",
                           "give the reference model's directory as the artifact")
    return BitsAndBytesRuntime(path, device)


TARGET = Target(name="bitsandbytes", summary="transformers + bitsandbytes NF4 at load (a baseline; nothing is packed)",
                family="reference", formats=("NF4",), load=load_bitsandbytes)
