"""Open any model spec a user may give: a directory, a .gguf file, a cached hub id, or the default."""

from __future__ import annotations

from pathlib import Path

from ..errors import CardfitError
from .base import EMBED, LM_HEAD, NORM, OTHER, ModelSource, TensorInfo, group_of, group_sort_key
from .gguf_file import GgufOrigin, GgufSource, converted_source
from .hf_dir import HfDirectorySource

__all__ = ["open_model", "runnable", "locate", "converted_source", "resolve_hub_id", "ModelSource", "TensorInfo", "HfDirectorySource", "GgufSource",
           "group_of", "group_sort_key", "EMBED", "NORM", "LM_HEAD", "OTHER"]


def resolve_hub_id(repo_id: str) -> Path:
    """A hub id from the local Hugging Face cache only: cardfit never downloads."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        raise CardfitError(f"'{repo_id}' is not in the local Hugging Face cache and cardfit works offline",
                           "download it once (huggingface-cli download) or pass a local directory") from None


def open_model(spec: str | Path | None = None, run: bool = False) -> ModelSource:
    """The model a user named: a directory, a .gguf, a cached hub id, a catalog name fetched by
    `cardfit models get` (cardfit.catalog), or None/'default' (the embedded SmolLM2-135M-Instruct). Every command resolves its model here.

    Without `run` a .gguf is read from its header (enough to price it); with `run` the caller gets a
    source it can run and tokenize: a .gguf converted once to f16 in the cache (`converted_source`),
    whose header is not even read again once that conversion exists."""
    kind, path = locate(spec)
    if kind == "gguf":
        return converted_source(path) if run else GgufSource(path)
    source = HfDirectorySource(path)
    if spec is None or str(spec) == "default":
        from ..default_model import default_gguf

        source.origins = (GgufOrigin(default_gguf()),)  # the packaged Q4_1 GGUF it was converted from
    return source


def runnable(source: ModelSource) -> ModelSource:
    """A source the stages run: a Hugging Face directory as it is, a GGUF as its cached f16 conversion."""
    return source.runnable() if isinstance(source, GgufSource) else source


def locate(spec: str | Path | None) -> tuple[str, Path]:
    """("dir", model directory) or ("gguf", file) for any model spec a user may give."""
    if spec is None or str(spec) == "default":
        from ..default_model import default_model_dir

        return "dir", default_model_dir()
    path = Path(spec)
    if path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir():
        return _directory(path)
    if path.is_file() and path.name == "config.json":
        return "dir", path.parent
    text = str(spec)
    from ..catalog import CATALOG, fetched

    if not path.exists() and text in CATALOG:
        return "gguf", fetched(text)
    if not path.exists() and text.count("/") == 1 and not text.startswith((".", "/")):
        return _directory(resolve_hub_id(text))
    raise CardfitError(f"no model at {spec}", "give a model directory, a .gguf file, a cached hub id or a "
                       "catalog name (cardfit models)")


def _directory(path: Path) -> tuple[str, Path]:
    """A model directory, or a directory (a hub snapshot of a GGUF repo) holding one .gguf and no config."""
    if not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return "gguf", ggufs[0]
        if ggufs:
            raise CardfitError(f"{path} holds {len(ggufs)} GGUF files and no config.json",
                               "name one of them: " + ", ".join(str(g) for g in ggufs[:4]))
    return "dir", path
