"""config.json checked once, at the door, before any number is derived from it.

Every key cardfit reads from a config (here, in architecture, kv, budget, overhead, runner and the
GGUF packer) has one rule below: its type and its range. `validate_config` applies them when the
geometry is built, so a negative head count, a string where a width belongs or a zero period is
refused as one line naming the key and the value, instead of a negative KV cache, an inflated
weight budget, a TypeError deep in a stage, or (for a billion layers) a silent hang.

Relations between keys are checked only where a combination is impossible, not merely unusual:
many real models have num_attention_heads x head_dim != hidden_size (Gemma 3, Qwen3), so that
is allowed whenever head_dim is given; without head_dim the head count must divide hidden_size.

A sliding_window of 0 means "no window" (transformers writes it so for Qwen2-MoE with
use_sliding_window false, and llama.cpp uses 0 the same way); a model whose layers slide and
whose window is 0 or absent is refused.

Absent keys and JSON nulls mean "not given" and are left to the reader's defaults; whether a
required key is present is checked where it is read (architecture._require).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import CardfitError

FIX = "restore the model's original config.json"

MAX_LAYERS = 10_000  # deepest released models have ~120 decoder layers
MAX_WIDTH = 2**24  # hidden, intermediate and vocabulary widths (largest real vocabularies ~2^18)
MAX_HEADS = 2**16
MAX_HEAD_DIM = 2**16
MAX_POSITIONS = 2**32  # context lengths and sliding windows
MAX_KERNEL = 2**10  # short causal convolutions of SSM layers


@dataclass(frozen=True)
class Rule:
    """What one key may hold. `None` (JSON null) always passes: it means the key is not given."""

    kind: str  # "int", "number", "bool", "str", "str_list", "number_list", "rope"
    low: float | None = None
    high: float | None = None
    open_low: bool = False  # low itself is excluded (numbers that must be > 0)
    families: frozenset[str] | None = None  # only checked for these families (None: all)

    def expectation(self) -> str:
        if self.kind == "int":
            return f"an integer from {self.low} to {self.high}"
        if self.kind in ("number", "number_list"):
            what = "a number" if self.kind == "number" else "a list of numbers, each"
            parts = []
            if self.low is not None:
                parts.append(f"{'>' if self.open_low else '>='} {self.low:g}")
            if self.high is not None:
                parts.append(f"<= {self.high:g}")
            return f"{what} {' and '.join(parts)}" if parts else what
        return {"bool": "true or false", "str": "a string", "str_list": "a list of strings",
                "rope": "an object"}[self.kind]

    def accepts(self, value) -> bool:
        if self.kind == "int":
            return _is_int(value) and self.low <= value <= self.high
        if self.kind == "number":
            return _number_in(value, self)
        if self.kind == "number_list":
            return isinstance(value, list) and all(_number_in(v, self) for v in value)
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "str":
            return isinstance(value, str)
        if self.kind == "str_list":
            return isinstance(value, list) and all(isinstance(v, str) for v in value)
        if self.kind == "rope":
            return isinstance(value, dict)
        raise AssertionError(self.kind)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number_in(value, rule: Rule) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if rule.low is not None and (value <= rule.low if rule.open_low else value < rule.low):
        return False
    return rule.high is None or value <= rule.high


def Int(low: int, high: int, families: set[str] | None = None) -> Rule:
    return Rule("int", low, high, families=frozenset(families) if families else None)


def Num(low: float | None = None, high: float | None = None, open_low: bool = False) -> Rule:
    return Rule("number", low, high, open_low)


BOOL, STR, STR_LIST = Rule("bool"), Rule("str"), Rule("str_list")
HYBRID, MLA = {"hybrid"}, {"mla"}

# Every config key cardfit reads, with aliases (the first one given is the one used).
SCHEMA: dict[str, Rule] = {
    "model_type": STR,
    "num_hidden_layers": Int(1, MAX_LAYERS), "n_layer": Int(1, MAX_LAYERS), "num_layers": Int(1, MAX_LAYERS),
    "hidden_size": Int(1, MAX_WIDTH), "d_model": Int(1, MAX_WIDTH), "n_embd": Int(1, MAX_WIDTH),
    "num_attention_heads": Int(1, MAX_HEADS), "n_head": Int(1, MAX_HEADS),
    "num_key_value_heads": Int(1, MAX_HEADS),
    "head_dim": Int(1, MAX_HEAD_DIM),
    "vocab_size": Int(1, MAX_WIDTH),
    "intermediate_size": Int(1, MAX_WIDTH),
    "tie_word_embeddings": BOOL,
    "torch_dtype": STR, "dtype": STR,
    "max_position_embeddings": Int(1, MAX_POSITIONS),
    "original_max_position_embeddings": Int(2, MAX_POSITIONS),
    # sliding-window attention
    "sliding_window": Int(0, MAX_POSITIONS),  # 0: no window, as transformers writes it for Qwen2-MoE
    "use_sliding_window": BOOL,
    "max_window_layers": Int(0, MAX_LAYERS),
    "sliding_window_pattern": Int(1, MAX_LAYERS),
    "layer_types": STR_LIST, "layers_block_type": STR_LIST,
    # multi-token-prediction layers stored beside the decoder (DeepSeek-V3)
    "num_nextn_predict_layers": Int(0, MAX_LAYERS),
    # MLA
    "kv_lora_rank": Int(1, MAX_WIDTH, MLA), "qk_rope_head_dim": Int(1, MAX_HEAD_DIM, MLA),
    # hybrid layer patterns
    "hybrid_override_pattern": Rule("str", families=frozenset(HYBRID)),
    "attn_layer_period": Int(1, MAX_LAYERS, HYBRID), "attn_layer_offset": Int(0, MAX_LAYERS, HYBRID),
    "expert_layer_period": Int(1, MAX_LAYERS, HYBRID), "expert_layer_offset": Int(0, MAX_LAYERS, HYBRID),
    "full_attention_interval": Int(1, MAX_LAYERS, HYBRID),
    # recurrent state: Gated DeltaNet (Qwen3-Next)
    "linear_num_key_heads": Int(1, MAX_HEADS, HYBRID), "linear_num_value_heads": Int(1, MAX_HEADS, HYBRID),
    "linear_key_head_dim": Int(1, MAX_HEAD_DIM, HYBRID), "linear_value_head_dim": Int(1, MAX_HEAD_DIM, HYBRID),
    "linear_conv_kernel_dim": Int(1, MAX_KERNEL, HYBRID),
    # recurrent state: Mamba 1 / 2
    "mamba_d_state": Int(1, MAX_HEAD_DIM, HYBRID), "ssm_state_size": Int(1, MAX_HEAD_DIM, HYBRID),
    "state_size": Int(1, MAX_HEAD_DIM, HYBRID),
    "mamba_d_conv": Int(1, MAX_KERNEL, HYBRID), "conv_kernel": Int(1, MAX_KERNEL, HYBRID),
    "mamba_conv_kernel": Int(1, MAX_KERNEL, HYBRID),
    "mamba_n_heads": Int(1, MAX_HEADS, HYBRID), "mamba_num_heads": Int(1, MAX_HEADS, HYBRID),
    "mamba_head_dim": Int(1, MAX_HEAD_DIM, HYBRID), "mamba_d_head": Int(1, MAX_HEAD_DIM, HYBRID),
    "mamba_d_ssm": Int(1, MAX_WIDTH, HYBRID),
    "mamba_expand": Int(1, MAX_KERNEL, HYBRID), "expand": Int(1, MAX_KERNEL, HYBRID),
    "mamba_n_groups": Int(1, MAX_HEADS, HYBRID), "n_groups": Int(1, MAX_HEADS, HYBRID),
    # rotary embedding and norms (GGUF metadata), logit soft-capping (runner, GGUF packer)
    "rope_theta": Num(0, open_low=True),
    "rope_scaling": Rule("rope"), "rope_parameters": Rule("rope"),
    "partial_rotary_factor": Num(0, 1, open_low=True),
    "rms_norm_eps": Num(0, 1),
    "query_pre_attn_scalar": Num(0, open_low=True),
    "final_logit_softcapping": Num(0), "attn_logit_softcapping": Num(0),
    # mixture of experts (0: a dense config that names the keys)
    "num_experts": Int(0, MAX_HEADS), "num_local_experts": Int(0, MAX_HEADS), "num_experts_per_tok": Int(0, MAX_HEADS),
    "moe_intermediate_size": Int(0, MAX_WIDTH), "shared_expert_intermediate_size": Int(0, MAX_WIDTH),
    "norm_topk_prob": BOOL, "decoder_sparse_step": Int(0, MAX_LAYERS),
    "mlp_only_layers": Rule("number_list", 0, MAX_LAYERS),
    "swiglu_alpha": Num(0, open_low=True), "swiglu_limit": Num(0, open_low=True),  # gpt-oss's clamped SwiGLU
}

# Keys of a rope_scaling / rope_parameters object (or of each per-layer-type object inside it).
ROPE_SCHEMA: dict[str, Rule] = {
    "rope_type": STR, "type": STR,
    "rope_theta": Num(0, open_low=True),
    "factor": Num(0, open_low=True),
    "low_freq_factor": Num(0, open_low=True), "high_freq_factor": Num(0, open_low=True),
    "original_max_position_embeddings": Int(2, MAX_POSITIONS),
    "long_factor": Rule("number_list", 0, None, open_low=True),
    "short_factor": Rule("number_list", 0, None, open_low=True),
    "attention_factor": Num(0, open_low=True),
    "partial_rotary_factor": Num(0, 1, open_low=True),
    "beta_fast": Num(0, open_low=True), "beta_slow": Num(0, open_low=True),  # YaRN's ramp
    "mscale": Num(0), "mscale_all_dim": Num(0), "truncate": BOOL,
}
ROPE_NEEDS_FACTOR = ("linear", "llama3", "dynamic", "yarn")


def show(value, limit: int = 60) -> str:
    """A value as it appears in the config, cut short so the error stays one line."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _bad(source: str, key: str, value, expected: str) -> CardfitError:
    return CardfitError(f"{source} has {key}={show(value)}, expected {expected}", FIX)


def _check(table: dict[str, Rule], cfg: dict, family: str | None, source: str, prefix: str) -> None:
    for key, rule in table.items():
        if rule.families is not None and family not in rule.families:
            continue
        value = cfg.get(key)
        if value is not None and not rule.accepts(value):
            raise _bad(source, prefix + key, value, rule.expectation())


def _check_rope(value: dict, source: str, key: str) -> None:
    parts = ({f"{key}.{name}": sub for name, sub in value.items()}
             if value and all(isinstance(v, dict) for v in value.values()) else {key: value})
    for where, params in parts.items():
        _check(ROPE_SCHEMA, params, None, source, where + ".")
        kind = params.get("rope_type") or params.get("type")
        if kind in ROPE_NEEDS_FACTOR and params.get("factor") is None:
            raise CardfitError(f"{source} has {where} of type '{kind}' without a factor", FIX)
        if kind == "llama3":
            low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
            if high <= low:
                raise CardfitError(f"{source} has {where}.high_freq_factor={show(high)} <= "
                                   f"low_freq_factor={show(low)}, expected high > low", FIX)


def first(cfg: dict, *keys: str) -> tuple[str | None, object]:
    """The first of `keys` the config gives (not null), and its value."""
    for key in keys:
        if cfg.get(key) is not None:
            return key, cfg[key]
    return None, None


def validate_config(cfg: dict, family: str, source: str = "config.json", prefix: str = "") -> None:
    """Types and ranges of every key cardfit reads, then the combinations no model can have.

    `cfg` is the language-model part of the config; `prefix` names where it sits ("text_config.")
    so messages point at the key the user must fix.
    """
    _check(SCHEMA, cfg, family, source, prefix)
    for key in ("rope_scaling", "rope_parameters"):
        if cfg.get(key) is not None:
            _check_rope(cfg[key], source, prefix + key)

    heads_key, heads = first(cfg, "num_attention_heads", "n_head")
    hidden_key, hidden = first(cfg, "hidden_size", "d_model", "n_embd")
    kv_heads = cfg.get("num_key_value_heads")
    if heads is not None and kv_heads is not None:
        if kv_heads > heads:
            raise CardfitError(f"{source} has {prefix}num_key_value_heads={kv_heads} > "
                               f"{prefix}{heads_key}={heads}, expected at most one KV head per query head", FIX)
        if heads % kv_heads:
            raise CardfitError(f"{source} has {prefix}{heads_key}={heads} not divisible by "
                               f"{prefix}num_key_value_heads={kv_heads}, expected whole query groups", FIX)
    if family != "mla" and heads is not None and hidden is not None and cfg.get("head_dim") is None:
        if heads > hidden:
            raise CardfitError(f"{source} has {prefix}{heads_key}={heads} > {prefix}{hidden_key}={hidden} "
                               "and no head_dim, so each head would be 0 wide", FIX)
        if hidden % heads:
            raise CardfitError(f"{source} has {prefix}{hidden_key}={hidden} not divisible by "
                               f"{prefix}{heads_key}={heads} and no head_dim to say how wide a head is", FIX)
    if family == "hybrid":
        for period_key, offset_key in (("attn_layer_period", "attn_layer_offset"),
                                       ("expert_layer_period", "expert_layer_offset")):
            period, offset = cfg.get(period_key), cfg.get(offset_key)
            if period is not None and offset is not None and offset >= period:
                raise CardfitError(f"{source} has {prefix}{offset_key}={offset} >= {prefix}{period_key}={period}, "
                                   "so no layer would match", FIX)
