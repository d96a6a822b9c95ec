"""What config.json says about the shape of a model, read without touching weights.

Budgeting needs the attention geometry of every layer (how many KV heads, how wide,
whether the layer is global, sliding-window, latent (MLA) or has no KV at all), and
sizing needs the hidden and vocabulary widths. Multimodal configs keep the language
model under `text_config`; we read that part. Every key read here is validated first, in one
place (config_schema.validate_config), so what follows can trust types and ranges.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .config_schema import FIX, first, show, validate_config
from .errors import CardfitError

# model_type -> family. The family decides how layer kinds are derived.
KNOWN_MODEL_TYPES = {
    "llama": "dense", "mistral": "dense", "qwen2": "dense", "qwen3": "dense", "phi3": "dense",
    "gemma": "dense", "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3",
    "smollm3": "dense", "granite": "dense", "olmo2": "dense", "cohere": "dense",
    "mixtral": "dense", "qwen2_moe": "dense", "qwen3_moe": "dense", "gpt_oss": "dense", "starcoder2": "dense",
    "deepseek_v2": "mla", "deepseek_v3": "mla", "kimi_k2": "mla",
    "jamba": "hybrid", "nemotron_h": "hybrid", "falcon_h1": "hybrid", "qwen3_next": "hybrid",
    "granitemoehybrid": "hybrid", "bamba": "hybrid",
}

FULL, SLIDING, NO_KV = "full", "sliding", "none"


@dataclass(frozen=True)
class LayerKind:
    """The KV-relevant nature of one decoder layer."""

    attention: str  # FULL, SLIDING or NO_KV
    window: int | None = None  # tokens kept by a SLIDING layer
    recurrent: bool = False  # carries an SSM / linear-attention state instead of (or beside) KV


@dataclass(frozen=True)
class SsmGeometry:
    """Recurrent state of one SSM / linear-attention layer: fixed per sequence, not per token."""

    state_elements: int  # the SSM (or delta-rule) state matrix
    conv_elements: int  # the rolling window of the short causal convolution


@dataclass
class ModelGeometry:
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int | None
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    layers: list[LayerKind]
    tie_word_embeddings: bool
    torch_dtype: str | None = None
    mla_latent: int | None = None  # kv_lora_rank + qk_rope_head_dim per token per layer
    ssm: SsmGeometry | None = None
    raw: dict = field(default_factory=dict, repr=False)
    source: str = "config.json"  # where the config came from, for messages
    keys: dict[str, str] = field(default_factory=dict, repr=False)  # role -> config key it was read from

    @property
    def attention_layers(self) -> int:
        return sum(1 for k in self.layers if k.attention != NO_KV)

    @property
    def recurrent_layers(self) -> int:
        return sum(1 for k in self.layers if k.recurrent)


def load_config(path: str | Path) -> dict:
    """Read config.json from a file or a model directory, with errors a user can act on."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise CardfitError(f"no config.json at {path}", "point --config at a model directory or its config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CardfitError(f"{path} is not valid JSON ({exc.__class__.__name__}: {exc})",
                           "restore the model's original config.json") from None
    if not isinstance(config, dict):
        raise CardfitError(f"{path} holds {type(config).__name__}, not a JSON object",
                           "restore the model's original config.json")
    return config


def _text_part(config: dict, source: str) -> tuple[dict, str]:
    """The language-model part of a config and the prefix that names its keys in messages."""
    text = config.get("text_config")
    if text is None:
        return config, ""
    if not isinstance(text, dict):
        raise CardfitError(f"{source} has text_config={show(text)}, expected an object", FIX)
    merged = dict(text)
    merged.setdefault("model_type", config.get("model_type"))
    if "tie_word_embeddings" not in merged and "tie_word_embeddings" in config:
        merged["tie_word_embeddings"] = config["tie_word_embeddings"]
    return merged, "text_config."


def _require(config: dict, *keys: str, source: str = "config.json", prefix: str = "") -> tuple[str, int]:
    """The first of `keys` the config gives (its value already validated) and its name in messages."""
    key, value = first(config, *keys)
    if key is None:
        raise CardfitError(f"{source} lacks {' / '.join(prefix + k for k in keys)}", FIX)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:  # keys outside the schema
        raise CardfitError(f"{source} has {prefix}{key}={show(value)}, expected a positive integer", FIX)
    return prefix + key, value


def geometry_from_config(config: dict, source: str = "config.json") -> ModelGeometry:
    """Turn a config dict into the geometry every stage uses, validating every key it reads first."""
    if not isinstance(config, dict):
        raise CardfitError(f"{source} holds {type(config).__name__}, not a JSON object", FIX)
    outer_type = config.get("model_type")
    if outer_type is not None and not isinstance(outer_type, str):
        raise CardfitError(f"{source} has model_type={show(outer_type)}, expected a string", FIX)
    cfg, prefix = _text_part(config, source)
    model_type = cfg.get("model_type") or outer_type
    if not isinstance(model_type, (str, type(None))):
        raise CardfitError(f"{source} has {prefix}model_type={show(model_type)}, expected a string", FIX)
    if model_type in ("gemma3",) and cfg is not config:
        model_type = "gemma3_text"
    if not model_type:
        raise CardfitError(f"{source} has no model_type", FIX)
    family = KNOWN_MODEL_TYPES.get(model_type)
    if family is None:
        raise CardfitError(
            f"unknown architecture '{model_type}' in {source}",
            "supported: " + ", ".join(sorted(KNOWN_MODEL_TYPES)),
        )
    validate_config(cfg, family, source, prefix)
    keys: dict[str, str] = {}
    keys["num_layers"], num_layers = _require(cfg, "num_hidden_layers", "n_layer", "num_layers",
                                              source=source, prefix=prefix)
    keys["hidden"], hidden = _require(cfg, "hidden_size", "d_model", "n_embd", source=source, prefix=prefix)
    keys["heads"], heads = _require(cfg, "num_attention_heads", "n_head", source=source, prefix=prefix)
    keys["vocab"], vocab = _require(cfg, "vocab_size", source=source, prefix=prefix)
    kv_heads = cfg.get("num_key_value_heads") or heads
    keys["kv_heads"] = prefix + "num_key_value_heads" if cfg.get("num_key_value_heads") else keys["heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    keys["head_dim"] = prefix + "head_dim" if cfg.get("head_dim") else f"{keys['hidden']}/{keys['heads']}"
    inter = cfg.get("intermediate_size")
    keys["intermediate"] = prefix + "intermediate_size"
    tie = cfg.get("tie_word_embeddings")
    if tie is None:
        tie = family in ("gemma2", "gemma3") or model_type == "gemma"

    head_dim_k = head_dim_v = head_dim
    mla_latent = None
    if family == "mla":
        rank = _require(cfg, "kv_lora_rank", source=source, prefix=prefix)[1]
        rope = _require(cfg, "qk_rope_head_dim", source=source, prefix=prefix)[1]
        mla_latent = rank + rope

    layers = _layer_kinds(cfg, family, num_layers, source, prefix)
    ssm = _ssm_geometry(cfg, hidden, source, prefix) if any(k.recurrent for k in layers) else None
    return ModelGeometry(
        model_type=model_type, num_layers=num_layers, hidden_size=hidden, intermediate_size=inter,
        vocab_size=vocab, num_heads=heads, num_kv_heads=kv_heads, head_dim_k=head_dim_k,
        head_dim_v=head_dim_v, layers=layers, tie_word_embeddings=tie,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype") or _outer_dtype(config),
        mla_latent=mla_latent, ssm=ssm, raw=cfg, source=source, keys=keys,
    )


def _outer_dtype(config: dict) -> str | None:
    dtype = config.get("torch_dtype")
    return dtype if isinstance(dtype, str) else None


def _sliding(cfg: dict) -> int | None:
    window = cfg.get("sliding_window") or None  # 0 means no window (transformers' Qwen2-MoE, llama.cpp)
    if window is None or cfg.get("use_sliding_window") is False:
        return None
    return window


_LAYER_TYPE_WORDS = {
    "full_attention": (FULL, False), "attention": (FULL, False), "global": (FULL, False),
    "sliding_attention": (SLIDING, False), "local": (SLIDING, False), "chunked_attention": (SLIDING, False),
    "linear_attention": (NO_KV, True), "mamba": (NO_KV, True), "mamba2": (NO_KV, True),
    "mlp": (NO_KV, False), "moe": (NO_KV, False),
    "hybrid": (FULL, True),
}

# Nemotron-H's hybrid_override_pattern: M = mamba, * = attention, - = MLP, E = MoE
_PATTERN_CHARS = {"M": LayerKind(NO_KV, recurrent=True), "*": LayerKind(FULL), "-": LayerKind(NO_KV),
                  "E": LayerKind(NO_KV)}


def _from_layer_types(types: list, window: int | None, num_layers: int, source: str, key: str) -> list[LayerKind]:
    if len(types) != num_layers:
        raise CardfitError(f"{source} lists {len(types)} {key} for {num_layers} layers", FIX)
    kinds = []
    for word in types:
        if word not in _LAYER_TYPE_WORDS:
            raise CardfitError(f"{source} has unknown layer type {show(word)} in {key}",
                               "known: " + ", ".join(sorted(_LAYER_TYPE_WORDS)))
        attention, recurrent = _LAYER_TYPE_WORDS[word]
        kinds.append(LayerKind(attention, window if attention == SLIDING else None, recurrent))
    return kinds


def _layer_kinds(cfg: dict, family: str, num_layers: int, source: str, prefix: str = "") -> list[LayerKind]:
    kinds = _layer_kinds_unchecked(cfg, family, num_layers, source, prefix)
    if any(k.attention == SLIDING and k.window is None for k in kinds):
        raise CardfitError(f"{source} has sliding-window layers but no {prefix}sliding_window", FIX)
    return kinds


def _layer_kinds_unchecked(cfg: dict, family: str, num_layers: int, source: str, prefix: str) -> list[LayerKind]:
    window = cfg.get("sliding_window") or None
    for key in ("layer_types", "layers_block_type"):
        if isinstance(cfg.get(key), list):
            return _from_layer_types(cfg[key], window, num_layers, source, prefix + key)
    if family == "gemma2":
        # Gemma 2 alternates local and global, starting local.
        return [LayerKind(SLIDING, window) if i % 2 == 0 else LayerKind(FULL) for i in range(num_layers)]
    if family == "gemma3":
        pattern = cfg.get("sliding_window_pattern") or 6
        return [LayerKind(FULL) if (i + 1) % pattern == 0 else LayerKind(SLIDING, window)
                for i in range(num_layers)]
    if family == "hybrid":
        pattern = cfg.get("hybrid_override_pattern")
        if isinstance(pattern, str):
            if len(pattern) != num_layers:
                raise CardfitError(f"{source} {prefix}hybrid_override_pattern has {len(pattern)} entries "
                                   f"for {num_layers} layers", FIX)
            unknown = sorted(set(pattern) - set(_PATTERN_CHARS))
            if unknown:
                raise CardfitError(f"{source} has {prefix}hybrid_override_pattern with unknown layer "
                                   f"character(s) {show(''.join(unknown))}",
                                   "known: M (mamba), * (attention), - (MLP), E (MoE)")
            return [_PATTERN_CHARS[c] for c in pattern]
        if cfg.get("attn_layer_period") is not None:  # Jamba
            period, offset = cfg["attn_layer_period"], cfg.get("attn_layer_offset") or 0
            return [LayerKind(FULL) if i % period == offset else LayerKind(NO_KV, recurrent=True)
                    for i in range(num_layers)]
        if cfg.get("full_attention_interval") is not None:  # Qwen3-Next
            interval = cfg["full_attention_interval"]
            return [LayerKind(FULL) if (i + 1) % interval == 0 else LayerKind(NO_KV, recurrent=True)
                    for i in range(num_layers)]
        if cfg.get("model_type") == "falcon_h1":  # attention and mamba heads side by side in every layer
            return [LayerKind(FULL, recurrent=True) for _ in range(num_layers)]
        raise CardfitError(f"{source} is a hybrid model but names no layer pattern", FIX)
    sliding = _sliding(cfg)
    if sliding is not None:
        max_window_layers = cfg.get("max_window_layers")
        if max_window_layers is not None and (cfg.get("model_type") or "").startswith("qwen"):
            return [LayerKind(SLIDING, sliding) if i >= max_window_layers else LayerKind(FULL)
                    for i in range(num_layers)]
        return [LayerKind(SLIDING, sliding) for _ in range(num_layers)]
    return [LayerKind(FULL) for _ in range(num_layers)]


def _ssm_geometry(cfg: dict, hidden: int, source: str = "config.json", prefix: str = "") -> SsmGeometry:
    if cfg.get("model_type") == "qwen3_next":
        # Gated DeltaNet: a (key_dim x value_dim) state per value head; conv over q, k and v.
        k_heads = _require(cfg, "linear_num_key_heads", source=source, prefix=prefix)[1]
        v_heads = _require(cfg, "linear_num_value_heads", source=source, prefix=prefix)[1]
        k_dim = _require(cfg, "linear_key_head_dim", source=source, prefix=prefix)[1]
        v_dim = _require(cfg, "linear_value_head_dim", source=source, prefix=prefix)[1]
        d_conv = cfg.get("linear_conv_kernel_dim") or 4
        return SsmGeometry(state_elements=v_heads * k_dim * v_dim,
                           conv_elements=(d_conv - 1) * (2 * k_heads * k_dim + v_heads * v_dim))
    d_state = cfg.get("mamba_d_state") or cfg.get("ssm_state_size") or cfg.get("state_size") or 128
    d_conv = cfg.get("mamba_d_conv") or cfg.get("conv_kernel") or cfg.get("mamba_conv_kernel") or 4
    n_heads = cfg.get("mamba_n_heads") or cfg.get("mamba_num_heads")
    head = cfg.get("mamba_head_dim") or cfg.get("mamba_d_head")
    if cfg.get("mamba_d_ssm"):
        d_inner = cfg["mamba_d_ssm"]
    elif n_heads and head:
        d_inner = n_heads * head
    else:
        d_inner = (cfg.get("mamba_expand") or cfg.get("expand") or 2) * hidden
    if cfg.get("model_type") == "jamba":  # Mamba-1: conv over x only
        return SsmGeometry(state_elements=d_inner * d_state, conv_elements=(d_conv - 1) * d_inner)
    n_groups = cfg.get("mamba_n_groups") or cfg.get("n_groups") or 1  # Mamba-2: conv over x, B and C
    return SsmGeometry(state_elements=d_inner * d_state,
                       conv_elements=(d_conv - 1) * (d_inner + 2 * n_groups * d_state))


def load_geometry(path: str | Path) -> ModelGeometry:
    return geometry_from_config(load_config(path), source=str(path))
