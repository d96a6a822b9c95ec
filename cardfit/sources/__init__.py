"""Open any model spec a user may give: a directory, a .gguf file, a cached hub id, or the default."""

from __future__ import annotations

from pathlib import Path

from ..errors import CardfitError
from .base import EMBED, LM_HEAD, NORM, OTHER, ModelSource, TensorInfo, group_of, group_sort_key
from .gguf_file import GgufSource
from .hf_dir import HfDirectorySource

__all__ = ["open_model", "resolve_hub_id", "ModelSource", "TensorInfo", "HfDirectorySource", "GgufSource",
           "group_of", "group_sort_key", "EMBED", "NORM", "LM_HEAD", "OTHER"]


def resolve_hub_id(repo_id: str) -> Path:
    """A hub id from the local Hugging Face cache only: cardfit never downloads."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        raise CardfitError(f"'{repo_id}' is not in the local Hugging Face cache and cardfit works offline",
                           "download it once (huggingface-cli download) or pass a local directory") from None


def open_model(spec: str | Path | None = None) -> ModelSource:
    """The model a user named; None or 'default' is the embedded SmolLM2-135M-Instruct."""
    if spec is None or str(spec) == "default":
        from ..default_model import default_model_dir

        return HfDirectorySource(default_model_dir())
    path = Path(spec)
    if path.suffix == ".gguf":
        return GgufSource(path)
    if path.is_dir():
        return HfDirectorySource(path)
    if path.is_file() and path.name == "config.json":
        return HfDirectorySource(path.parent)
    text = str(spec)
    if not path.exists() and text.count("/") == 1 and not text.startswith((".", "/")):
        return HfDirectorySource(resolve_hub_id(text))
    raise CardfitError(f"no model at {spec}", "give a model directory, a .gguf file, or a cached hub id")
