"""Calibration and evaluation text: validated, tokenized, cut into equal chunks."""

from __future__ import annotations

import hashlib
from importlib import resources
from pathlib import Path

import torch

from .errors import CardfitError

BUNDLED = {"calibration": "calibration.txt", "heldout": "heldout.txt"}


def bundled_text(name: str) -> Path:
    return Path(str(resources.files("cardfit") / "data" / BUNDLED[name]))


def load_text(path: str | Path | None, default: str = "calibration") -> tuple[str, Path]:
    """The text at `path` (or a bundled one), refusing files that are not prose."""
    path = Path(path) if path is not None else bundled_text(default)
    if not path.is_file():
        raise CardfitError(f"no text file at {path}", "pass a UTF-8 prose file, e.g. cardfit/data/calibration.txt")
    raw = path.read_bytes()
    if not raw.strip():
        raise CardfitError(f"{path} is empty", "pass a few hundred KB of representative prose")
    if b"\x00" in raw[:65536]:
        raise CardfitError(f"{path} looks binary (NUL bytes)", "pass a UTF-8 prose file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CardfitError(f"{path} is not UTF-8 (byte {exc.start})",
                           "convert it: iconv -f LATIN1 -t UTF-8 in.txt > out.txt") from None
    printable = sum(ch.isprintable() or ch in "\n\r\t" for ch in text[:65536])
    if printable < 0.95 * min(len(text), 65536):
        raise CardfitError(f"{path} is mostly unprintable characters", "pass a UTF-8 prose file")
    return text, path


def load_tokenizer(directory: str | Path, **kwargs):
    """transformers' tokenizer of a model directory (or of a GGUF, with gguf_file=), with any failure to read
    its files (a cut-short or edited tokenizer.json, a missing one, a config naming a class that does not
    exist) turned into one CardfitError naming the directory: every command opens tokenizers here, so a
    broken one is one line, never a traceback."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(directory), **kwargs)
    except Exception as exc:  # transformers and tokenizers raise every kind for a bad file
        detail = str(exc).splitlines()[0][:160] if str(exc) else ""
        raise CardfitError(f"cannot read the tokenizer of {directory} ({exc.__class__.__name__}: {detail})",
                           "restore tokenizer.json and tokenizer_config.json from the model's original files") from None


def text_hash(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def calibration_header(text: str, text_path: Path, chunks: torch.Tensor) -> dict:
    """What a map (and an imatrix cardfit writes) records of the calibration tokens it was made from."""
    return {"sha256": text_hash(text), "source": text_path.name, "tokens": int(chunks.numel()),
            "seq_len": int(chunks.shape[1]), "chunks": int(chunks.shape[0])}


def refuse_short_budget(max_tokens: int | None, seq_len: int, flag: str = "--max-tokens") -> None:
    """Refuse a token budget under one chunk; commands call it before they allocate for a chunk (a runtime's
    context of `seq_len`), token_chunks again once the text is read."""
    if max_tokens is not None and max_tokens < seq_len:
        raise CardfitError(f"{flag} {max_tokens} is less than one chunk of {seq_len} tokens",
                           f"raise {flag} to at least {seq_len}")  # fit and compare have no --seq-len


def token_chunks(tokenizer, text: str, seq_len: int, max_tokens: int | None, source: str = "text",
                 rows: int | None = None) -> torch.Tensor:
    """(n_chunks, seq_len) token ids from the start of the text; refuses texts shorter than one chunk and, given
    the model's embedding `rows`, a tokenizer whose ids the model has no row for."""
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    if rows is not None and len(ids) and int(ids.max()) >= rows:
        raise CardfitError(f"the tokenizer turns {source} into token ids up to {int(ids.max())}, and the model's "
                           f"embedding has {rows} rows: tokenizer and weights are of different models",
                           "use the tokenizer files that came with the model's weights")
    limit = len(ids) if max_tokens is None else min(len(ids), max_tokens)
    n = limit // seq_len
    if n == 0 and len(ids) >= seq_len:
        refuse_short_budget(max_tokens, seq_len)
    if n == 0:
        raise CardfitError(f"{source} has {len(ids)} tokens, fewer than one chunk of {seq_len}",
                           f"give a text of at least {seq_len} tokens")
    return ids[: n * seq_len].reshape(n, seq_len)
