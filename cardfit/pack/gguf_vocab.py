"""The tokenizer as llama.cpp reads it from GGUF metadata.

Byte-level BPE tokenizers (GPT-2 style: SmolLM, Llama 3, Qwen2) are written as
`tokenizer.ggml.model = gpt2` with the token list, token types and merges, the way llama.cpp's
converter writes them; SentencePiece models (`tokenizer.model`) through gguf-py's own
SentencePiece reader. llama.cpp also needs the name of the pre-tokenizer (how text is split
before BPE): we read it off the tokenizer's declared split rule instead of guessing by
model name, and fall back to llama.cpp's `default` (with a warning) for rules we do not know.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CardfitError

# Split patterns of the pre-tokenizers llama.cpp knows by name (tokenizer.json, pre_tokenizer Split regex).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def pre_tokenizer_name(tokenizer_json: dict) -> str | None:
    """llama.cpp's name for this tokenizer's pre-tokenizer, or None when it is not one we recognise."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Split", "ByteLevel"]:
        pattern = (steps[0].get("pattern") or {}).get("Regex")
        return {_LLAMA3: "llama-bpe", _QWEN2: "qwen2"}.get(pattern)
    return None


def _looks_special(token: str) -> bool:
    return (token.startswith("<|") and token.endswith("|>")) or (token.startswith("<") and token.endswith(">")
                                                                  and len(token) > 2 and " " not in token)


def add_vocab(writer, model_dir: Path, vocab_size: int) -> tuple[list, list[str]]:
    """Write the tokenizer keys; returns the token list and warnings to show the user."""
    import gguf

    warnings: list[str] = []
    tokenizer_file = model_dir / "tokenizer.json"
    if (model_dir / "tokenizer.model").exists() and not _is_byte_level(tokenizer_file):
        vocab = gguf.SentencePieceVocab(model_dir)
        tokens, scores, types = [], [], []
        for text, score, kind in vocab.all_tokens():
            tokens.append(text)
            scores.append(score)
            types.append(int(kind))
        tokens, scores, types = _pad(tokens, types, vocab_size, scores)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        gguf.SpecialVocab(model_dir, n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)
        return tokens, warnings
    if not tokenizer_file.exists():
        raise CardfitError(f"{model_dir} has no tokenizer.json or tokenizer.model",
                           "copy the model's tokenizer files into its directory")
    try:
        declared = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise CardfitError(f"{tokenizer_file} is not valid JSON", "restore the model's tokenizer.json") from None
    if (declared.get("model") or {}).get("type") != "BPE":
        raise CardfitError(f"tokenizer type {(declared.get('model') or {}).get('type')} is not packed to GGUF",
                           "byte-level BPE and SentencePiece tokenizers are supported")
    pre = pre_tokenizer_name(declared)
    if pre is None:
        pre = "default"
        warnings.append("the tokenizer's pre-tokenizer is not one llama.cpp knows by name; wrote 'default', so "
                        "llama.cpp may split some text differently from transformers")
    from ..text import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(CONTROL if added[i].special or _looks_special(by_id[i]) else USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(NORMAL)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(model_dir, load_merges=True, n_vocab=len(tokens))
    # Whether transformers prepends/appends BOS/EOS, read off its own encoding, so llama.cpp does the same.
    probe = tokenizer("a", add_special_tokens=True).input_ids
    plain = tokenizer("a", add_special_tokens=False).input_ids
    special.add_special_token["bos"] = tokenizer.bos_token_id is not None and probe[:1] == [tokenizer.bos_token_id] \
        and plain[:1] != probe[:1]
    special.add_special_token["eos"] = tokenizer.eos_token_id is not None and probe[-1:] == [tokenizer.eos_token_id] \
        and plain[-1:] != probe[-1:]
    special.add_to_gguf(writer, quiet=True)
    writer.add_add_space_prefix(False)
    return tokens, warnings


# llama.cpp's vocabulary loader sets Phi-3's token attributes for any model whose general.name says
# phi-3/phi3, looking these tokens up unconditionally: a vocabulary without one fails to load.
_PHI3_MARKERS = ("phi-3", "phi3")
_PHI3_TOKENS = ("</s>", "<unk>", "<s>", "<|endoftext|>")


def loadable_name(name: str, tokens: list, warnings: list[str]) -> str:
    """The model name to write: as given, unless llama.cpp would then refuse this vocabulary."""
    if not any(marker in name.lower() for marker in _PHI3_MARKERS):
        return name
    present = {t.decode("utf-8", "replace") if isinstance(t, bytes) else t for t in tokens}
    missing = [t for t in _PHI3_TOKENS if t not in present]
    if not missing:
        return name
    warnings.append(f"general.name '{name}' would make llama.cpp apply Phi-3's token rules, and this vocabulary "
                    f"lacks {', '.join(missing)}; wrote the name as 'model'")
    return "model"


def _is_byte_level(tokenizer_file: Path) -> bool:
    if not tokenizer_file.exists():
        return False
    try:
        declared = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return False
    return pre_tokenizer_name(declared) is not None


def _pad(tokens, types, vocab_size, scores):
    while len(tokens) < vocab_size:
        tokens.append(f"[PAD{len(tokens)}]".encode())
        types.append(UNUSED)
        scores.append(-1000.0)
    return tokens, scores, types
