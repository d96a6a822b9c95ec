"""What config.json says about the shape of a model, read without touching weights.

Budgeting needs the attention geometry of every layer (how many KV heads, how wide,
whether the layer is global, sliding-window, latent (MLA) or has no KV at all), and
sizing needs the hidden and vocabulary widths. Multimodal configs keep the language
model under `text_config`; we read that part.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CardfitError

# model_type -> family. The family decides how layer kinds are derived.
KNOWN_MODEL_TYPES = {
    "llama": "dense", "mistral": "dense", "qwen2": "dense", "qwen3": "dense", "phi3": "dense",
    "gemma": "dense", "gemma2": "gemma2", "gemma3": "gemma3", "gemma3_text": "gemma3",
    "smollm3": "dense", "granite": "dense", "olmo2": "dense", "cohere": "dense",
    "mixtral": "dense", "qwen2_moe": "dense", "qwen3_moe": "dense", "starcoder2": "dense",
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
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CardfitError(f"{path} is not valid JSON ({exc.__class__.__name__}: {exc})",
                           "restore the model's original config.json") from None
    if not isinstance(config, dict):
        raise CardfitError(f"{path} holds {type(config).__name__}, not a JSON object",
                           "restore the model's original config.json")
    return config


def _text_part(config: dict) -> dict:
    text = config.get("text_config")
    if isinstance(text, dict):
        merged = dict(text)
        merged.setdefault("model_type", config.get("model_type"))
        if "tie_word_embeddings" not in merged and "tie_word_embeddings" in config:
            merged["tie_word_embeddings"] = config["tie_word_embeddings"]
        return merged
    return config


def _require(config: dict, *keys: str, source: str = "config.json") -> int:
    for key in keys:
        value = config.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CardfitError(f"{source} has {key}={value!r}, expected a positive integer",
                                   "restore the model's original config.json")
            return value
    raise CardfitError(f"{source} lacks {' / '.join(keys)}", "restore the model's original config.json")


def geometry_from_config(config: dict, source: str = "config.json") -> ModelGeometry:
    """Turn a config dict into the geometry every stage uses."""
    outer_type = config.get("model_type")
    cfg = _text_part(config)
    model_type = cfg.get("model_type") or outer_type
    if model_type in ("gemma3",) and cfg is not config:
        model_type = "gemma3_text"
    if not model_type:
        raise CardfitError(f"{source} has no model_type", "restore the model's original config.json")
    family = KNOWN_MODEL_TYPES.get(model_type)
    if family is None:
        raise CardfitError(
            f"unknown architecture '{model_type}' in {source}",
            "supported: " + ", ".join(sorted(KNOWN_MODEL_TYPES)),
        )
    num_layers = _require(cfg, "num_hidden_layers", "n_layer", "num_layers", source=source)
    hidden = _require(cfg, "hidden_size", "d_model", "n_embd", source=source)
    heads = _require(cfg, "num_attention_heads", "n_head", source=source)
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or hidden // heads
    vocab = _require(cfg, "vocab_size", source=source)
    inter = cfg.get("intermediate_size")
    tie = bool(cfg.get("tie_word_embeddings", family in ("gemma2", "gemma3") or model_type == "gemma"))

    head_dim_k = head_dim_v = head_dim
    mla_latent = None
    if family == "mla":
        rank = _require(cfg, "kv_lora_rank", source=source)
        rope = _require(cfg, "qk_rope_head_dim", source=source)
        mla_latent = rank + rope

    layers = _layer_kinds(cfg, family, num_layers, source)
    ssm = _ssm_geometry(cfg, hidden) if any(k.recurrent for k in layers) else None
    return ModelGeometry(
        model_type=model_type, num_layers=num_layers, hidden_size=hidden, intermediate_size=inter,
        vocab_size=vocab, num_heads=heads, num_kv_heads=kv_heads, head_dim_k=head_dim_k,
        head_dim_v=head_dim_v, layers=layers, tie_word_embeddings=tie,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype"),
        mla_latent=mla_latent, ssm=ssm, raw=cfg,
    )


def _sliding(cfg: dict) -> int | None:
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return None
    return int(window)


_LAYER_TYPE_WORDS = {
    "full_attention": (FULL, False), "attention": (FULL, False), "global": (FULL, False),
    "sliding_attention": (SLIDING, False), "local": (SLIDING, False), "chunked_attention": (SLIDING, False),
    "linear_attention": (NO_KV, True), "mamba": (NO_KV, True), "mamba2": (NO_KV, True),
    "mlp": (NO_KV, False), "moe": (NO_KV, False),
    "hybrid": (FULL, True),
}


def _from_layer_types(types: list, window: int | None, num_layers: int, source: str) -> list[LayerKind]:
    if len(types) != num_layers:
        raise CardfitError(f"{source} lists {len(types)} layer_types for {num_layers} layers",
                           "restore the model's original config.json")
    kinds = []
    for word in types:
        if word not in _LAYER_TYPE_WORDS:
            raise CardfitError(f"{source} has unknown layer type '{word}'",
                               "known: " + ", ".join(sorted(_LAYER_TYPE_WORDS)))
        attention, recurrent = _LAYER_TYPE_WORDS[word]
        if attention == SLIDING and window is None:
            raise CardfitError(f"{source} has sliding layers but no sliding_window",
                               "restore the model's original config.json")
        kinds.append(LayerKind(attention, window if attention == SLIDING else None, recurrent))
    return kinds


def _layer_kinds(cfg: dict, family: str, num_layers: int, source: str) -> list[LayerKind]:
    window = cfg.get("sliding_window")
    for key in ("layer_types", "layers_block_type"):
        if isinstance(cfg.get(key), list):
            return _from_layer_types(cfg[key], window, num_layers, source)
    if family == "gemma2":
        # Gemma 2 alternates local and global, starting local.
        return [LayerKind(SLIDING, window) if i % 2 == 0 else LayerKind(FULL) for i in range(num_layers)]
    if family == "gemma3":
        pattern = cfg.get("sliding_window_pattern") or 6
        return [LayerKind(FULL) if (i + 1) % pattern == 0 else LayerKind(SLIDING, window)
                for i in range(num_layers)]
    if family == "hybrid":
        pattern = cfg.get("hybrid_override_pattern")
        if isinstance(pattern, str):  # Nemotron-H: M = mamba, * = attention, - = MLP, E = MoE
            if len(pattern) != num_layers:
                raise CardfitError(f"{source} hybrid_override_pattern has {len(pattern)} entries "
                                   f"for {num_layers} layers", "restore the model's original config.json")
            return [LayerKind(FULL) if c == "*" else LayerKind(NO_KV, recurrent=(c == "M")) for c in pattern]
        if "attn_layer_period" in cfg:  # Jamba
            period, offset = cfg["attn_layer_period"], cfg.get("attn_layer_offset", 0)
            return [LayerKind(FULL) if i % period == offset else LayerKind(NO_KV, recurrent=True)
                    for i in range(num_layers)]
        if "full_attention_interval" in cfg:  # Qwen3-Next
            interval = cfg["full_attention_interval"]
            return [LayerKind(FULL) if (i + 1) % interval == 0 else LayerKind(NO_KV, recurrent=True)
                    for i in range(num_layers)]
        if cfg.get("model_type") == "falcon_h1":  # attention and mamba heads side by side in every layer
            return [LayerKind(FULL, recurrent=True) for _ in range(num_layers)]
        raise CardfitError(f"{source} is a hybrid model but names no layer pattern",
                           "restore the model's original config.json")
    sliding = _sliding(cfg)
    if sliding is not None:
        max_window_layers = cfg.get("max_window_layers")
        if max_window_layers is not None and cfg.get("model_type", "").startswith("qwen"):
            return [LayerKind(SLIDING, sliding) if i >= max_window_layers else LayerKind(FULL)
                    for i in range(num_layers)]
        return [LayerKind(SLIDING, sliding) for _ in range(num_layers)]
    return [LayerKind(FULL) for _ in range(num_layers)]


def _ssm_geometry(cfg: dict, hidden: int) -> SsmGeometry:
    if cfg.get("model_type") == "qwen3_next":
        # Gated DeltaNet: a (key_dim x value_dim) state per value head; conv over q, k and v.
        k_heads, v_heads = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        k_dim, v_dim = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        d_conv = cfg.get("linear_conv_kernel_dim", 4)
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
