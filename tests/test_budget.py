"""KV geometry and weight budget against hand-computed values for public configs."""

import json
from pathlib import Path

import pytest

from cardfit.architecture import FULL, NO_KV, SLIDING, geometry_from_config, load_geometry
from cardfit.budget import compute_budget
from cardfit.kv import kv_cache

CONFIGS = Path(__file__).parent / "configs"

# bytes/token (f16) = attention_layers x (K + V) x kv_heads x head_dim x 2 bytes, unless noted.
EXPECTED_KV_PER_TOKEN = {
    "qwen2.5-3b": 36 * 2 * 2 * 128 * 2,  # 36864: head_dim 2048/16 = 128, GQA 2 KV heads
    "llama-3.2-3b": 28 * 2 * 8 * 128 * 2,  # 114688
    "phi-3.5-mini": 32 * 2 * 32 * 96 * 2,  # 393216: MHA, head_dim 3072/32 = 96
    "gemma-3-270m": 18 * 2 * 1 * 256 * 2,  # 18432: explicit head_dim 256, one KV head
    "mistral-7b-v0.1": 32 * 2 * 8 * 128 * 2,  # 131072
    "jamba-v0.1": 4 * 2 * 8 * 128 * 2,  # 16384: only layers 4, 12, 20, 28 attend (period 8, offset 4)
    "deepseek-v2-lite": 27 * (512 + 64) * 2,  # 31104: MLA latent kv_lora_rank + qk_rope_head_dim
    "gemma-3-4b-it": 34 * 2 * 4 * 256 * 2,  # 139264: nested text_config
    "qwen3-next-80b-a3b": 12 * 2 * 2 * 256 * 2,  # 24576: every 4th of 48 layers is full attention
}


def geometry(name):
    return load_geometry(CONFIGS / f"{name}.json")


@pytest.mark.parametrize("name", sorted(EXPECTED_KV_PER_TOKEN))
def test_kv_bytes_per_token_matches_hand_computation(name):
    assert kv_cache(geometry(name), 4096).kv_bytes_per_token == EXPECTED_KV_PER_TOKEN[name]


def test_sliding_layers_keep_only_their_window():
    g = geometry("gemma-3-270m")
    assert [k.attention for k in g.layers[:6]] == [SLIDING] * 5 + [FULL]
    cache = kv_cache(g, 16384)
    # 3 global layers store 16384 tokens, 15 local layers store 512; 1024 bytes per layer-token.
    assert cache.kv_bytes == 1024 * (3 * 16384 + 15 * 512)
    mistral = kv_cache(geometry("mistral-7b-v0.1"), 16384)
    assert mistral.kv_bytes == 131072 * 4096  # every layer keeps its 4096-token window
    assert kv_cache(geometry("mistral-7b-v0.1"), 1000).kv_bytes == 131072 * 1000


def test_gemma3_pattern_from_sliding_window_pattern():
    g = geometry("gemma-3-4b-it")
    full = [i for i, k in enumerate(g.layers) if k.attention == FULL]
    assert full == [5, 11, 17, 23, 29]
    assert kv_cache(g, 8192).kv_bytes == 4096 * (5 * 8192 + 29 * 1024)


def test_qwen2_sliding_window_off_when_use_sliding_window_false():
    g = geometry("qwen2.5-3b")
    assert all(k.attention == FULL for k in g.layers)


def test_hybrid_models_count_only_attention_and_report_state():
    jamba = kv_cache(geometry("jamba-v0.1"), 8192)
    assert jamba.attention_layers == 4 and jamba.recurrent_layers == 28
    # Mamba-1: d_inner = 2 x 4096; state d_inner x d_state(16) + conv (d_conv-1) x d_inner, f32 in llama.cpp.
    assert jamba.state_bytes_per_sequence == 28 * (8192 * 16 + 3 * 8192) * 4
    assert jamba.kv_bytes == 16384 * 8192 + jamba.state_bytes_per_sequence
    nxt = kv_cache(geometry("qwen3-next-80b-a3b"), 8192)
    # Gated DeltaNet: 32 value heads x 128 x 128 state; conv 3 x (2 x 16 x 128 + 32 x 128).
    assert nxt.state_bytes_per_sequence == 36 * (32 * 128 * 128 + 3 * (2 * 16 * 128 + 32 * 128)) * 4


def test_nemotron_h_pattern_string():
    config = {"model_type": "nemotron_h", "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
              "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 1000, "hybrid_override_pattern": "M-M*-M*-",
              "mamba_num_heads": 32, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8, "conv_kernel": 4}
    g = geometry_from_config(config)
    assert [k.attention for k in g.layers].count(FULL) == 2
    assert sum(k.recurrent for k in g.layers) == 3
    cache = kv_cache(g, 100)
    assert cache.kv_bytes_per_token == 2 * 2 * 2 * 128 * 2
    # Mamba-2: d_inner 32 x 64 = 2048; state 2048 x 128; conv 3 x (2048 + 2 x 8 x 128).
    assert cache.state_bytes_per_sequence == 3 * (2048 * 128 + 3 * (2048 + 2 * 8 * 128)) * 4


@pytest.mark.parametrize("dtype,factor", [("f16", 1.0), ("bf16", 1.0), ("q8_0", 34 / 64), ("q4_0", 18 / 64)])
def test_block_kv_dtypes(dtype, factor):
    per = kv_cache(geometry("llama-3.2-3b"), 10, kv_dtype=dtype).kv_bytes_per_token
    assert per == int(114688 * factor)


def test_fp8_only_for_vllm_and_q8_only_for_llama_cpp():
    from cardfit.errors import CardfitError

    g = geometry("llama-3.2-3b")
    assert kv_cache(g, 10, kv_dtype="fp8", runtime="vllm").kv_bytes_per_token == 114688 // 2
    with pytest.raises(CardfitError):
        kv_cache(g, 10, kv_dtype="fp8", runtime="llama.cpp")
    with pytest.raises(CardfitError):
        kv_cache(g, 10, kv_dtype="q8_0", runtime="vllm")


@pytest.mark.parametrize("runtime", ["llama.cpp", "vllm"])
@pytest.mark.parametrize("name", sorted(EXPECTED_KV_PER_TOKEN))
def test_budget_identity_is_exact(name, runtime):
    b = compute_budget(geometry(name), "80GiB", 16384, batch=2, runtime=runtime)
    assert b.vram_bytes == b.kv_bytes + b.overhead_bytes + b.weight_budget_bytes
    assert b.overhead_bytes == sum(b.overhead_terms.values())


def test_overhead_grows_with_context_only_without_flash_attention():
    from cardfit.overhead import OverheadSettings

    g = geometry("llama-3.2-3b")
    fa = [compute_budget(g, "24GiB", c).overhead_bytes for c in (4096, 16384)]
    assert fa[0] == fa[1]
    no_fa = [compute_budget(g, "24GiB", c, settings=OverheadSettings(flash_attention=False)).overhead_bytes
             for c in (4096, 16384)]
    assert no_fa[1] - no_fa[0] == 4 * 512 * (16384 - 4096) * 24


def test_vllm_reserves_one_minus_utilization():
    g = geometry("llama-3.2-3b")
    b = compute_budget(g, 10 * 2**30, 4096, runtime="vllm")
    assert b.overhead_terms["reserved"] == 10 * 2**30 - int(10 * 2**30 * 0.9)


def test_budget_json_cli(run_cli):
    code, out, err = run_cli("budget", "--vram", "24GiB", "--context", "16384",
                             "--config", CONFIGS / "qwen2.5-3b.json", "--json")
    assert code == 0, err
    data = json.loads(out)
    for key in ("attention_layers", "kv_bytes_per_token", "kv_bytes", "overhead_bytes", "weight_budget_bytes",
                "vram_bytes"):
        assert key in data
    assert data["vram_bytes"] == 24 * 2**30
    assert data["kv_bytes"] == 36864 * 16384
    assert data["vram_bytes"] == data["kv_bytes"] + data["overhead_bytes"] + data["weight_budget_bytes"]


def test_budget_table_cli(run_cli):
    code, out, _ = run_cli("budget", "--vram", "24GiB", "--context", "16384", "--config",
                           CONFIGS / "llama-3.2-3b.json")
    assert code == 0
    assert "attention layers 28 (KV 114688 bytes/token, f16)" in out
    assert "- KV cache 1.75 GiB (16384 tokens x 1 seq)" in out
    assert "= weight budget" in out


def test_budget_names_the_model_as_every_command_does(tiny_models, run_cli):
    """`cardfit budget MODEL` as scan, fit and sizes take it (it was refused); --model keeps working, and two
    different models named are refused."""
    model = str(tiny_models["llama"])
    positional = run_cli("budget", model, "--vram", "1GiB")
    assert positional[0] == 0 and positional == run_cli("budget", "--model", model, "--vram", "1GiB")
    code, _, err = run_cli("budget", model, "--vram", "1GiB", "--config", str(tiny_models["qwen2"]))
    assert code == 2 and "two models named" in err
