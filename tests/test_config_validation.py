"""A config is validated once, at the door: every key cardfit reads is type- and range-checked when the
geometry is built, and a model's weights are checked against its config when it is opened. Each problem
is one CardfitError naming the key and the value (the CLI: one line, exit 2), never a TypeError,
KeyError, ZeroDivisionError, a negative KV cache or a hang."""

import copy
import dataclasses
import json
import math
import re
import time
from pathlib import Path

import pytest

from cardfit.architecture import geometry_from_config, load_geometry
from cardfit.budget import compute_budget
from cardfit.config_schema import ROPE_SCHEMA, SCHEMA
from cardfit.errors import CardfitError
from cardfit.kv import kv_cache

CONFIGS = Path(__file__).parent / "configs"
ALL_CONFIGS = sorted(p.stem for p in CONFIGS.glob("*.json"))

NEMOTRON_H = {"model_type": "nemotron_h", "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 1000, "hybrid_override_pattern": "M-M*-M*-",
              "mamba_num_heads": 32, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4}


LLAMA3_ROPE = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}
LONGROPE = {"type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48}
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}


def base(name: str) -> dict:
    if name == "nemotron-h":
        return copy.deepcopy(NEMOTRON_H)
    return json.loads((CONFIGS / f"{name}.json").read_text())


def mutate(config: dict, path: str, value) -> dict:
    """Set (or, with value ..., delete) a dotted key such as text_config.num_hidden_layers."""
    config = copy.deepcopy(config)
    *parents, key = path.split(".")
    target = config
    for p in parents:
        target = target[p]
    if value is ...:
        target.pop(key, None)
    else:
        target[key] = value
    return config


def assert_one_line(code, err, *needles):
    assert code == 2, err
    lines = [l for l in err.strip().splitlines() if l]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# (config, key to set, bad value, text the message must contain besides the key)
BAD = [
    # layer count: signs, types, and sizes that would hang
    ("llama-3.2-3b", "num_hidden_layers", -1, "-1"),
    ("llama-3.2-3b", "num_hidden_layers", 0, "=0"),
    ("llama-3.2-3b", "num_hidden_layers", "28", "'28'"),
    ("llama-3.2-3b", "num_hidden_layers", 28.5, "28.5"),
    ("llama-3.2-3b", "num_hidden_layers", True, "True"),
    ("llama-3.2-3b", "num_hidden_layers", [28], "[28]"),
    ("llama-3.2-3b", "num_hidden_layers", 100_000_000, "100000000"),
    # widths
    ("llama-3.2-3b", "hidden_size", -3072, "-3072"),
    ("llama-3.2-3b", "hidden_size", "3072", "'3072'"),
    ("llama-3.2-3b", "vocab_size", -1, "-1"),
    ("llama-3.2-3b", "vocab_size", 2**40, str(2**40)),
    ("llama-3.2-3b", "vocab_size", {"n": 5}, "{'n': 5}"),
    ("llama-3.2-3b", "intermediate_size", -8192, "-8192"),
    ("llama-3.2-3b", "intermediate_size", [8192], "[8192]"),
    # heads
    ("llama-3.2-3b", "num_attention_heads", 0, "=0"),
    ("llama-3.2-3b", "num_attention_heads", -24, "-24"),
    ("llama-3.2-3b", "num_key_value_heads", -8, "-8"),
    ("llama-3.2-3b", "num_key_value_heads", 0, "=0"),
    ("llama-3.2-3b", "num_key_value_heads", "8", "'8'"),
    ("llama-3.2-3b", "num_key_value_heads", 48, "48"),  # more KV heads than query heads
    ("llama-3.2-3b", "num_key_value_heads", 7, "7"),  # 24 query heads do not split into 7 groups
    ("llama-3.2-3b", "head_dim", -128, "-128"),
    ("llama-3.2-3b", "head_dim", 0, "=0"),
    ("llama-3.2-3b", "head_dim", "128", "'128'"),
    ("llama-3.2-3b", "head_dim", 128.0, "128.0"),
    ("mistral-7b-v0.1", "num_attention_heads", 8192, "8192"),  # more heads than hidden, no head_dim: 0-wide heads
    ("mistral-7b-v0.1", "num_attention_heads", 24, "24"),  # 4096 is not 24 whole heads, no head_dim
    # sliding window
    ("mistral-7b-v0.1", "sliding_window", -4096, "-4096"),
    ("mistral-7b-v0.1", "sliding_window", "4096", "'4096'"),
    ("mistral-7b-v0.1", "use_sliding_window", "no", "'no'"),
    ("qwen2.5-3b", "max_window_layers", -1, "-1"),
    ("gemma-3-270m", "sliding_window", 0, "sliding_window"),  # sliding layers, but no window
    ("gemma-3-270m", "sliding_window", ..., "sliding_window"),
    ("gemma-3-4b-it", "text_config.sliding_window_pattern", 0, "=0"),
    ("gemma-3-4b-it", "text_config.sliding_window", -1, "-1"),
    ("gemma-3-4b-it", "text_config.num_hidden_layers", -34, "-34"),
    ("gemma-3-4b-it", "text_config", "gemma", "'gemma'"),
    # strings where lists belong, lists where strings belong
    ("gemma-3-270m", "layer_types", "sliding_attention", "'sliding_attention'"),
    ("gemma-3-270m", "layer_types", [["full_attention"]] * 18, "[['full_attention']"),
    ("gemma-3-270m", "layer_types", ["full_attention"] * 17, "17"),
    ("gemma-3-270m", "layer_types", ["full_attention"] * 17 + ["spinning"], "'spinning'"),
    ("llama-3.2-3b", "model_type", ["llama"], "['llama']"),
    ("llama-3.2-3b", "tie_word_embeddings", "false", "'false'"),
    ("llama-3.2-3b", "torch_dtype", 16, "16"),
    # rotary embedding and norms (read by the GGUF packer)
    ("llama-3.2-3b", "rope_theta", -500000.0, "-500000.0"),
    ("llama-3.2-3b", "rope_theta", math.nan, "nan"),
    ("llama-3.2-3b", "rope_scaling", "llama3", "'llama3'"),
    ("llama-3.2-3b", "rope_scaling", {**LLAMA3_ROPE, "factor": -32.0}, "rope_scaling.factor=-32.0"),
    ("llama-3.2-3b", "rope_scaling", {k: v for k, v in LLAMA3_ROPE.items() if k != "factor"}, "factor"),
    ("llama-3.2-3b", "rope_scaling", {**LLAMA3_ROPE, "high_freq_factor": 1.0}, "high_freq_factor=1.0"),
    ("llama-3.2-3b", "rope_scaling", {**LLAMA3_ROPE, "original_max_position_embeddings": 0}, "=0"),
    ("llama-3.2-3b", "rope_scaling", {**LLAMA3_ROPE, "rope_type": 3}, "rope_type=3"),
    ("gemma-3-4b-it", "text_config.rope_parameters", {"full_attention": {"rope_type": "linear", "factor": "8"}},
     "text_config.rope_parameters.full_attention.factor='8'"),
    ("llama-3.2-3b", "rms_norm_eps", "1e-5", "'1e-5'"),
    ("llama-3.2-3b", "max_position_embeddings", 0, "=0"),
    ("phi-3.5-mini", "rope_scaling", {**LONGROPE, "long_factor": ["a"]}, "['a']"),
    ("phi-3.5-mini", "rope_scaling", {**LONGROPE, "short_factor": [1.0, -2.0]}, "-2.0"),
    ("phi-3.5-mini", "partial_rotary_factor", 0, "=0"),
    # MLA
    ("deepseek-v2-lite", "kv_lora_rank", 0, "=0"),
    ("deepseek-v2-lite", "qk_rope_head_dim", "64", "'64'"),
    ("deepseek-v2-lite", "kv_lora_rank", ..., "kv_lora_rank"),
    # hybrids: zero periods and intervals, bad patterns, bad state sizes
    ("jamba-v0.1", "attn_layer_period", 0, "=0"),
    ("jamba-v0.1", "attn_layer_period", "8", "'8'"),
    ("jamba-v0.1", "attn_layer_offset", 8, "8"),  # >= period: no attention layer at all
    ("jamba-v0.1", "attn_layer_offset", -4, "-4"),
    ("jamba-v0.1", "expert_layer_period", 0, "=0"),
    ("jamba-v0.1", "mamba_d_state", -16, "-16"),
    ("jamba-v0.1", "mamba_expand", 0, "=0"),
    ("jamba-v0.1", "mamba_d_conv", "4", "'4'"),
    ("qwen3-next-80b-a3b", "full_attention_interval", 0, "=0"),
    ("qwen3-next-80b-a3b", "full_attention_interval", -4, "-4"),
    ("qwen3-next-80b-a3b", "linear_num_value_heads", -32, "-32"),
    ("qwen3-next-80b-a3b", "linear_key_head_dim", "128", "'128'"),
    ("qwen3-next-80b-a3b", "linear_num_key_heads", ..., "linear_num_key_heads"),
    ("qwen3-next-80b-a3b", "linear_conv_kernel_dim", 0, "=0"),
    ("nemotron-h", "hybrid_override_pattern", "M-M*-M*X", "'X'"),
    ("nemotron-h", "hybrid_override_pattern", ["M", "-"], "['M', '-']"),
    ("nemotron-h", "hybrid_override_pattern", "M-M*", "4 entries"),
    ("nemotron-h", "n_groups", 0, "=0"),
    ("nemotron-h", "mamba_num_heads", -32, "-32"),
]


def _id(case):
    name, key, value, _ = case
    return f"{name}:{key}={'<absent>' if value is ... else repr(value)[:20]}"


@pytest.mark.parametrize("case", BAD, ids=[_id(c) for c in BAD])
def test_bad_config_is_one_cardfit_error_naming_the_key(case):
    name, key, value, needle = case
    config = mutate(base(name), key, value)
    with pytest.raises(CardfitError) as info:  # any other exception type fails the test
        geometry_from_config(config, source="config.json")
    message = str(info.value)
    assert "\n" not in message
    assert any(part in message for part in key.split(".")), message
    assert needle in message, message
    if key.startswith("text_config.") and value is not ...:
        assert key in message  # nested keys are named where they sit


@pytest.mark.parametrize("case", BAD, ids=[_id(c) for c in BAD])
def test_bad_config_via_cli_is_one_line_exit_2(case, tmp_path, capsys):
    from cardfit.cli import main

    name, key, value, needle = case
    path = tmp_path / "config.json"
    path.write_text(json.dumps(mutate(base(name), key, value)))
    code = main(["budget", "--vram", "6GiB", "--config", str(path)])
    assert_one_line(code, capsys.readouterr().err, key.split(".")[-1] if value is not ... else "", needle)


def test_a_billion_layers_is_refused_at_once():
    config = mutate(base("llama-3.2-3b"), "num_hidden_layers", 1_000_000_000)
    start = time.monotonic()
    with pytest.raises(CardfitError, match="num_hidden_layers=1000000000, expected an integer from 1 to 10000"):
        geometry_from_config(config)
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize("name", ALL_CONFIGS)
def test_every_real_config_still_loads_with_a_positive_cache(name):
    g = load_geometry(CONFIGS / f"{name}.json")
    cache = kv_cache(g, 8192)
    assert cache.kv_bytes_per_token > 0 and cache.kv_bytes > 0
    b = compute_budget(g, "80GiB", 8192)
    assert 0 < b.weight_budget_bytes < b.vram_bytes


def test_real_rope_objects_pass():
    geometry_from_config(mutate(base("llama-3.2-3b"), "rope_scaling", LLAMA3_ROPE))
    geometry_from_config(mutate(base("phi-3.5-mini"), "rope_scaling", LONGROPE))
    geometry_from_config(mutate(base("gemma-3-4b-it"), "text_config.rope_parameters", GEMMA3_ROPE))


def test_sliding_window_zero_means_no_window():
    """transformers writes sliding_window 0 for Qwen2-MoE with use_sliding_window false; llama.cpp too."""
    g = geometry_from_config(mutate(base("mistral-7b-v0.1"), "sliding_window", 0))
    assert all(k.attention == "full" for k in g.layers)


def test_head_dim_times_heads_may_differ_from_hidden_when_head_dim_is_given():
    g = geometry_from_config(base("gemma-3-270m"))  # 4 heads x 256 = 1024 != hidden 640
    assert g.num_heads * g.head_dim_k != g.hidden_size


TRANSFORMERS_DEFAULTS_UNSUPPORTED = {"bamba", "nemotron_h", "kimi_k2"}  # no pattern / no layer count / no class


def test_transformers_default_configs_of_known_types_validate():
    """The schema is not stricter than transformers: every supported type's default config passes."""
    from transformers import AutoConfig

    from cardfit.architecture import KNOWN_MODEL_TYPES

    for model_type in sorted(set(KNOWN_MODEL_TYPES) - TRANSFORMERS_DEFAULTS_UNSUPPORTED):
        config = json.loads(AutoConfig.for_model(model_type).to_json_string())
        geometry_from_config(config, source=model_type)


@pytest.mark.parametrize("module", ["architecture.py", "pack/gguf_arch.py"])
def test_every_key_read_has_a_rule(module):
    """Guard for the 'one place' rule: a key read from a config dict must have a schema entry."""
    src = (Path(__file__).parent.parent / "cardfit" / module).read_text()
    read = set(re.findall(r'(?:cfg|config|params|scaling|\{\}\))(?:\.get\(|\[)"(\w+)"', src))
    assert read, "the pattern no longer finds config reads"
    structural = {"text_config", "full_attention"}  # the nested config itself, per-layer-type rope objects
    assert read - set(SCHEMA) - set(ROPE_SCHEMA) - structural == set()


# -- config vs weights, at open ---------------------------------------------------------------------------

def _with_config(model_dir: Path, out: Path, **changes) -> Path:
    """The tiny model's weights (linked, not copied) under an edited config.json."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config))
    return out


MISMATCHES = [
    ("llama", {"vocab_size": 50000}, ["vocab_size=50000", "49152 rows"]),
    ("llama", {"vocab_size": 32000}, ["vocab_size=32000", "49152 rows"]),
    ("llama", {"num_hidden_layers": 3}, ["num_hidden_layers=3", "2 decoder layers"]),
    ("llama", {"num_hidden_layers": 1}, ["num_hidden_layers=1", "2 decoder layers"]),
    ("llama", {"hidden_size": 128}, ["hidden_size=128"]),
    ("llama", {"intermediate_size": 256}, ["intermediate_size=256", ".mlp."]),
    ("llama", {"num_key_value_heads": 4}, ["num_key_value_heads=4", ".self_attn."]),
    ("llama", {"head_dim": 32, "num_key_value_heads": 4}, ["head_dim=32"]),
    ("qwen2", {"num_attention_heads": 8}, ["num_attention_heads=8"]),
    ("phi3", {"intermediate_size": 64}, ["intermediate_size=64", ".mlp."]),
    ("phi3", {"num_key_value_heads": 4}, ["num_key_value_heads=4", "qkv_proj"]),
]


@pytest.mark.parametrize("kind,changes,needles", MISMATCHES,
                         ids=[f"{k}-{'-'.join(f'{a}={b}' for a, b in c.items())}" for k, c, _ in MISMATCHES])
def test_config_that_is_not_the_weights_is_refused_at_open(tiny_model, tmp_path, monkeypatch, kind, changes,
                                                            needles):
    from cardfit.sources import HfDirectorySource, open_model

    path = _with_config(tiny_model(kind), tmp_path / "m", **changes)

    def no_reads(*args, **kwargs):
        raise AssertionError("a tensor was read before the config was checked")

    monkeypatch.setattr(HfDirectorySource, "read", no_reads)
    with pytest.raises(CardfitError) as info:
        open_model(path)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_mismatch_via_cli_is_one_line_exit_2(tiny_model, tmp_path, capsys):
    from cardfit.cli import main

    path = _with_config(tiny_model("llama"), tmp_path / "m", vocab_size=50000)
    code = main(["budget", "--vram", "6GiB", "--config", str(path)])
    assert_one_line(code, capsys.readouterr().err, "vocab_size=50000", "49152 rows")
    code = main(["scan", str(path), "--out", str(tmp_path / "map.json")])
    assert_one_line(code, capsys.readouterr().err, "vocab_size=50000")
    assert not (tmp_path / "map.json").exists()


def test_matching_config_opens_and_mtp_layers_are_allowed(tiny_model, tmp_path):
    from cardfit.sources import open_model

    for kind in ("llama", "qwen2", "gemma3", "phi3"):
        open_model(tiny_model(kind))
    # DeepSeek-V3 stores its multi-token-prediction layer after the decoder's
    path = _with_config(tiny_model("llama"), tmp_path / "m", num_hidden_layers=1, num_nextn_predict_layers=1)
    assert open_model(path).geometry.num_layers == 1


def test_gguf_source_checks_against_its_config():
    """The same check reads GGUF tensor names (token_embd, blk.N.attn_q, ...)."""
    from cardfit.default_model import default_gguf
    from cardfit.sources import GgufSource

    source = GgufSource(default_gguf())
    source.check_against_config()
    g = source.geometry
    source.geometry = dataclasses.replace(g, vocab_size=g.vocab_size + 1)
    with pytest.raises(CardfitError, match="vocab_size"):
        source.check_against_config()
    source.geometry = dataclasses.replace(g, num_layers=g.num_layers + 1)
    with pytest.raises(CardfitError, match="num_hidden_layers"):
        source.check_against_config()
    source.geometry = dataclasses.replace(g, intermediate_size=g.intermediate_size * 2)
    with pytest.raises(CardfitError, match="intermediate_size"):
        source.check_against_config()
