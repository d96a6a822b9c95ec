"""What llama.cpp expects of each architecture: its name, hyper-parameter keys, tensor names and
the transforms its converter applies to Hugging Face weights.

These mirror llama.cpp's `convert_hf_to_gguf.py` for the supported families: LLaMA-style models
(Llama, SmolLM, Mistral) store q/k rows permuted for llama.cpp's interleaved rotary layout;
Gemma 3 stores its RMSNorm weights as (1 + w); Qwen2/Qwen3 take the weights as they are; Phi-3
keeps its fused qkv and gate_up matrices (llama.cpp splits them at run time) and carries its
longrope factors as two small tensors; gpt-oss takes the per-expert matrices cut from its fused stacks
(checkpoint_map.fused_views), its attention sinks and biases as they are, and YaRN's keys.
Anything llama.cpp would compute differently from transformers is refused here, before a byte
is written, rather than discovered by `check`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CardfitError

# HF model_type -> llama.cpp architecture name
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3",
             "gemma3_text": "gemma3", "phi3": "phi3", "mixtral": "llama", "qwen2_moe": "qwen2moe",
             "qwen3_moe": "qwen3moe", "gpt_oss": "gpt-oss"}
# Whether llama.cpp renormalises the chosen experts' weights to sum to one, per architecture (its graph
# hard-codes it: llama (Mixtral), qwen3moe and gpt-oss (a softmax over the chosen) do, qwen2moe does not);
# a config asking otherwise is refused. Mixtral and gpt-oss have no flag for it.
EXPERT_WEIGHTS_NORMALISED = {"llama": True, "qwen3moe": True, "qwen2moe": False, "gpt-oss": True}
UNFLAGGED = ("llama", "gpt-oss")
# gpt-oss's clamped SwiGLU, which llama.cpp hard-codes (alpha, limit)
SWIGLU_OAI = (1.702, 7.0)


@dataclass
class ArchSpec:
    arch: str  # llama.cpp architecture name
    config: dict  # the text part of config.json

    @classmethod
    def for_config(cls, config: dict) -> "ArchSpec":
        cfg = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        model_type = cfg.get("model_type") or config.get("model_type")
        arch = GGUF_ARCH.get(model_type)
        if arch is None:
            raise CardfitError(f"GGUF packing does not support architecture '{model_type}'",
                               "supported for GGUF: " + ", ".join(sorted(GGUF_ARCH)) +
                               "; use --format compressed-tensors for others")
        from ..architecture import geometry_from_config

        geometry_from_config(config)  # types and ranges of every key read below (cheap, and idempotent)
        prefix = "text_config." if cfg is not config else ""
        needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        for key in needed + (("sliding_window",) if arch == "gemma3" else ()):
            if cfg.get(key) is None:
                raise CardfitError(f"config.json lacks {prefix}{key}, which llama.cpp's {arch} loader needs",
                                   "restore the model's original config.json")
        spec = cls(arch, cfg)
        spec.refuse_what_llama_cpp_computes_differently()
        return spec

    # -- hyper-parameters ---------------------------------------------------------------------------
    @property
    def experts(self) -> int:
        """Routed experts per MoE layer (0: a dense model)."""
        return int(self.config.get("num_experts") or self.config.get("num_local_experts") or 0)

    @property
    def n_head(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def n_head_kv(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.n_head)

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self.config["hidden_size"] // self.n_head)

    @property
    def rope_theta(self) -> float:
        params = self.config.get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params:  # per-layer-type parameters (Gemma 3)
            params = params["full_attention"]
        if isinstance(params, dict) and "rope_theta" in params:
            return float(params["rope_theta"])
        return float(self.config.get("rope_theta", 10000.0))

    @property
    def rope_scaling(self) -> dict | None:
        params = self.config.get("rope_scaling") or self.config.get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params:
            params = params["full_attention"]
        if not isinstance(params, dict):
            return None
        kind = params.get("rope_type") or params.get("type")
        return None if kind in (None, "default") else params

    @property
    def rope_kind(self) -> str | None:
        scaling = self.rope_scaling
        return None if scaling is None else (scaling.get("rope_type") or scaling.get("type"))

    @property
    def longrope(self) -> bool:
        """Phi-3's long-context scaling ("su" is its older name)."""
        return self.arch == "phi3" and self.rope_kind in ("longrope", "su")

    @property
    def rope_dims(self) -> int:
        """Rotary dimensions per head; Phi-3 family models may rotate only part of each head."""
        params = self.config.get("rope_parameters") if isinstance(self.config.get("rope_parameters"), dict) else {}
        fraction = float(params.get("partial_rotary_factor", self.config.get("partial_rotary_factor", 1.0)))
        return int(fraction * int(self.config["hidden_size"])) // self.n_head

    @property
    def original_context(self) -> int:
        params = self.rope_scaling or {}
        return int(params.get("original_max_position_embeddings")
                   or self.config.get("original_max_position_embeddings")
                   or self.config.get("max_position_embeddings") or 4096)

    def refuse_what_llama_cpp_computes_differently(self) -> None:
        cfg = self.config
        allowed = ("linear", "llama3") + (("longrope", "su") if self.arch == "phi3" else ()) \
            + (("yarn",) if self.arch == "gpt-oss" else ())
        if self.rope_kind is not None and self.rope_kind not in allowed:
            raise CardfitError(f"rope scaling '{self.rope_kind}' is not packed to GGUF by cardfit for {self.arch}",
                               "models with default, linear or llama3 rope scaling (and Phi-3's longrope, "
                               "gpt-oss's YaRN) are")
        if self.rope_kind == "yarn":
            unmodelled = [k for k in ("attention_factor", "mscale", "mscale_all_dim") if self.rope_scaling.get(k)]
            if unmodelled:
                raise CardfitError(f"YaRN with {', '.join(unmodelled)} is not packed to GGUF by cardfit",
                                   self.elsewhere)
        if self.arch == "gpt-oss":
            self.refuse_gpt_oss_llama_cpp_computes_differently()
        if self.longrope:
            scaling = self.rope_scaling
            long, short = scaling.get("long_factor"), scaling.get("short_factor")
            if not long or not short or len(long) != len(short) or 2 * len(long) != self.rope_dims:
                raise CardfitError("this Phi-3 config's longrope factors do not match its rotary dimensions "
                                   f"({self.rope_dims // 2} each expected)", "restore the model's config.json")
        if self.experts:
            self.refuse_moe_llama_cpp_computes_differently()
        if self.arch == "gemma3":
            layers = int(cfg["num_hidden_layers"])
            types = cfg.get("layer_types")
            expected = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
            if isinstance(types, list) and types != expected:
                raise CardfitError("llama.cpp runs Gemma 3 with five sliding layers to one global; this "
                                   "config's layer_types differ", self.elsewhere)
            scalar = cfg.get("query_pre_attn_scalar")
            if scalar is not None and int(scalar) != self.head_dim and layers != 62:
                raise CardfitError(f"llama.cpp scales Gemma 3 attention by head_dim ({self.head_dim}), this config "
                                   f"by query_pre_attn_scalar={scalar}", self.elsewhere)
            if cfg.get("final_logit_softcapping") or cfg.get("attn_logit_softcapping"):
                raise CardfitError("Gemma 3 with logit soft-capping is not packed to GGUF by cardfit",
                                   self.elsewhere)

    def warnings(self) -> list[str]:
        """What llama.cpp computes differently and every GGUF of such a model shares (so it is said, not
        refused): YaRN's ramp ends rounded to whole dimensions where the config says not to (gpt-oss)."""
        if self.rope_kind == "yarn" and self.rope_scaling.get("truncate") is False:
            return ["llama.cpp rounds YaRN's ramp ends to whole dimensions and this config says not to "
                    "(truncate: false), so its rotary angles differ slightly from transformers' (every GGUF of "
                    "this model shares it; on a tiny test model ~1% of the logits); check measures what it costs"]
        return []

    @property
    def elsewhere(self) -> str:
        """Where a config llama.cpp cannot hold goes: compressed-tensors, unless transformers could not load its
        experts from one (gpt-oss: only its fused stacks, pack.refuse_unpackable)."""
        from ..checkpoint_map import fused_only

        if self.config.get("num_local_experts") or self.config.get("num_experts"):
            reason = fused_only(str(self.config.get("model_type", "")))
            if reason:
                return f"no file cardfit writes holds this config ({reason})"
        return "pack it as --format compressed-tensors"

    def refuse_gpt_oss_llama_cpp_computes_differently(self) -> None:
        """llama.cpp's gpt-oss: alpha and limit of its SwiGLU are constants, and even layers slide."""
        cfg = self.config
        swiglu = (float(cfg.get("swiglu_alpha", SWIGLU_OAI[0])), float(cfg.get("swiglu_limit", SWIGLU_OAI[1])))
        if swiglu != SWIGLU_OAI:
            raise CardfitError(f"llama.cpp's gpt-oss computes SwiGLU with alpha {SWIGLU_OAI[0]} and limit "
                               f"{SWIGLU_OAI[1]}; this config has {swiglu[0]} and {swiglu[1]}",
                               self.elsewhere)
        layers = int(cfg["num_hidden_layers"])
        expected = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        if cfg.get("layer_types") not in (None, expected) or not cfg.get("sliding_window"):
            raise CardfitError("llama.cpp runs gpt-oss with a sliding window on every even layer and full "
                               "attention on every odd one; this config differs", self.elsewhere)

    def refuse_moe_llama_cpp_computes_differently(self) -> None:
        cfg = self.config
        normalised = cfg.get("norm_topk_prob", self.arch in UNFLAGGED)  # Mixtral and gpt-oss have no flag
        if bool(normalised) != EXPERT_WEIGHTS_NORMALISED[self.arch]:
            does = "renormalises" if EXPERT_WEIGHTS_NORMALISED[self.arch] else "does not renormalise"
            raise CardfitError(f"llama.cpp's {self.arch} {does} the chosen experts' weights; this config's "
                               f"norm_topk_prob is {normalised}", self.elsewhere)
        if int(cfg.get("decoder_sparse_step") or 1) != 1 or cfg.get("mlp_only_layers"):
            raise CardfitError("this MoE config mixes dense and expert layers, which llama.cpp's "
                               f"{self.arch} does not", self.elsewhere)

    def metadata(self, writer) -> None:
        """Architecture keys, exactly the ones llama.cpp's loader reads for this family."""
        cfg = self.config
        writer.add_context_length(int(cfg.get("max_position_embeddings") or 4096))
        writer.add_embedding_length(int(cfg["hidden_size"]))
        writer.add_block_count(int(cfg["num_hidden_layers"]))
        writer.add_feed_forward_length(int(cfg["intermediate_size"]))
        writer.add_head_count(self.n_head)
        writer.add_head_count_kv(self.n_head_kv)
        writer.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
        writer.add_rope_freq_base(self.rope_theta)
        writer.add_vocab_size(int(cfg["vocab_size"]))
        if self.arch in ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe"):
            writer.add_rope_dimension_count(self.head_dim)
        if self.experts:  # as llama.cpp's converters write them
            writer.add_expert_count(self.experts)
            writer.add_expert_used_count(int(cfg["num_experts_per_tok"]))
            if cfg.get("moe_intermediate_size") or self.arch == "gpt-oss":  # gpt-oss: its intermediate_size
                writer.add_expert_feed_forward_length(int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]))
            if cfg.get("shared_expert_intermediate_size"):
                writer.add_expert_shared_feed_forward_length(int(cfg["shared_expert_intermediate_size"]))
        if self.arch == "phi3":  # as llama.cpp's Phi-3 converter writes them
            writer.add_rope_dimension_count(self.rope_dims)
            writer.add_rope_scaling_orig_ctx_len(self.original_context)
            writer.add_sliding_window(int(cfg.get("sliding_window") or 0))  # 0: no window (Phi-4)
            if self.longrope:
                writer.add_rope_scaling_attn_factors(self.longrope_attention_factor)
        if self.head_dim != int(cfg["hidden_size"]) // self.n_head or self.arch in ("gemma3", "qwen3", "qwen3moe",
                                                                                   "gpt-oss"):
            writer.add_key_length(self.head_dim)
            writer.add_value_length(self.head_dim)
        if self.arch in ("gemma3", "gpt-oss"):
            writer.add_sliding_window(int(cfg["sliding_window"]))
        if self.rope_kind == "yarn":  # as llama.cpp's converter writes YaRN (it always rounds the ramp's ends)
            import gguf

            scaling = self.rope_scaling
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(float(scaling["factor"]))
            writer.add_rope_scaling_orig_ctx_len(self.original_context)
            for key, add in (("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                             ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
                if scaling.get(key) is not None:
                    add(float(scaling[key]))
        if self.rope_kind == "linear":
            import gguf

            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(self.rope_scaling["factor"]))

    @property
    def longrope_attention_factor(self) -> float:
        """The attention scale transformers and llama.cpp both apply with Phi-3's longrope."""
        explicit = (self.rope_scaling or {}).get("attention_factor")
        if explicit is not None:
            return float(explicit)
        scale = int(self.config.get("max_position_embeddings") or self.original_context) / self.original_context
        return math.sqrt(1 + math.log(scale) / math.log(self.original_context)) if scale > 1.0 else 1.0

    def extra_tensors(self) -> dict[str, np.ndarray]:
        """Tensors llama.cpp needs that the checkpoint does not hold (llama3 rope frequency factors,
        Phi-3's longrope factors)."""
        scaling = self.rope_scaling
        if self.longrope:
            return {"rope_factors_long.weight": np.asarray(scaling["long_factor"], dtype=np.float32),
                    "rope_factors_short.weight": np.asarray(scaling["short_factor"], dtype=np.float32)}
        if self.rope_kind != "llama3":
            return {}
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_context = float(scaling.get("original_max_position_embeddings", 8192))
        freqs = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
        factors = []
        for freq in freqs:
            wavelength = 2 * math.pi / freq
            if wavelength < old_context / high:
                factors.append(1.0)
            elif wavelength > old_context / low:
                factors.append(factor)
            else:
                smooth = (old_context / wavelength - low) / (high - low)
                factors.append(1.0 / ((1 - smooth) / factor + smooth))
        return {"rope_freqs.weight": np.asarray(factors, dtype=np.float32)}

    # -- tensors ------------------------------------------------------------------------------------
    def tensor_name(self, hf_name: str) -> str:
        """llama.cpp's name for a checkpoint tensor; a routed expert's matrix is in its stack's `*_exps`."""
        from ..groups import expert_stack

        stack = expert_stack(hf_name)
        hf_name = stack[0] if stack else hf_name
        if not hf_name.endswith((".weight", ".bias")):  # gpt-oss's attention sinks: its converter adds .weight
            hf_name += ".weight"
        mapping = _name_map(self.arch, int(self.config["num_hidden_layers"]))
        name = mapping.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise CardfitError(f"llama.cpp has no tensor for '{hf_name}' in architecture {self.arch}",
                               self.elsewhere)
        return name

    def transform(self, hf_name: str, weight: torch.Tensor) -> torch.Tensor:
        """The converter's per-tensor transform, applied before quantization (so its rounding is llama.cpp's)."""
        if self.arch == "llama" and hf_name.endswith("q_proj.weight"):
            return _permute_rotary(weight, self.n_head)
        if self.arch == "llama" and hf_name.endswith("k_proj.weight"):
            return _permute_rotary(weight, self.n_head_kv)
        if self.arch == "gemma3" and hf_name.endswith("norm.weight"):
            return weight + 1.0
        return weight


def _permute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Half-split rotary rows (HF) -> interleaved pairs (llama.cpp's LLaMA rope)."""
    shape = weight.shape
    return weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


_MAPS: dict = {}


def _name_map(arch: str, blocks: int):
    import gguf

    key = (arch, blocks)
    if key not in _MAPS:
        arch_enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
        _MAPS[key] = gguf.get_tensor_name_map(arch_enum, blocks)
    return _MAPS[key]
