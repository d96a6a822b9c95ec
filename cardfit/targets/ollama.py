"""Ollama: llama.cpp's GGUF with a Modelfile beside it, carrying the context the budget was made for
(Ollama's own default context is far shorter, so without it the KV cache the budget paid for would
go unused). `ollama create NAME -f Modelfile` in the artifact's folder imports it."""

from __future__ import annotations

from pathlib import Path

from .llama_cpp import gguf_target


def modelfile(artifact: Path, recipe: dict) -> dict[str, str]:
    lines = [f"FROM ./{artifact.name}"]
    context = (recipe.get("budget") or {}).get("context")
    if isinstance(context, int) and context > 0:
        lines.append(f"PARAMETER num_ctx {context}")
    return {"Modelfile": "\n".join(lines) + "\n"}


TARGET = gguf_target("ollama", "Ollama: the GGUF and a Modelfile with the budget's context",
                     kv_dtypes=("f16", "q8_0", "q4_0"), beside=modelfile)
