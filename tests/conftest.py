import os
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):
    # README's command runs two test processes on two cores: one compute thread each (and in the
    # commands they start), or their OpenMP pools wait on each other's cores. Set before torch loads:
    # OpenMP reads it once, for every thread; torch.set_num_threads below reaches only the main thread,
    # and a thread-pool thread with two would sum in another order (test_fisher's threaded pricing).
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def _save_tiny(kind: str, path: Path, shard: str | None = None) -> Path:
    """A random model of a real architecture, with SmolLM2's tokenizer so text can be fed to it."""
    import shutil

    from transformers import (AutoModelForCausalLM, DeepseekV2Config, Gemma3TextConfig, GptOssConfig, LlamaConfig,
                              MistralConfig, MixtralConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config,
                              Qwen3MoeConfig)

    from cardfit.default_model import default_model_dir

    torch.manual_seed(0)
    sharp = kind.endswith("-sharp")  # large weights: peaky attention, so rotary layout errors show in logits
    kind = kind.removesuffix("-sharp")
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if kind == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=False)
    elif kind == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=True)
    elif kind == "gemma3":
        config = Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, head_dim=16, sliding_window=32,
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    elif kind == "gemma3-softcap":  # Gemma 2's final logit soft-capping, tight enough to bend the logits
        config = Gemma3TextConfig(**common, head_dim=16, sliding_window=32, final_logit_softcapping=0.5)
    elif kind == "gemma3-llamacpp":  # the geometry llama.cpp assumes for Gemma 3: 5 sliding to 1 global
        config = Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, head_dim=16, sliding_window=32,
                                  query_pre_attn_scalar=16)
    elif kind == "qwen3":
        config = Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    elif kind == "mistral":
        config = MistralConfig(**common, tie_word_embeddings=False, sliding_window=None)
    elif kind == "phi3":  # fused qkv_proj and gate_up_proj
        config = Phi3Config(**common, tie_word_embeddings=False, sliding_window=None, pad_token_id=0)
    elif kind == "phi3-longrope":  # Phi-3.5's long-context rotary scaling, factors far from 1
        half = common["hidden_size"] // common["num_attention_heads"] // 2
        factors = torch.linspace(1.0, 4.0, half).tolist()
        config = Phi3Config(**{**common, "max_position_embeddings": 2048}, tie_word_embeddings=False,
                            sliding_window=None, pad_token_id=0, original_max_position_embeddings=512,
                            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": factors,
                                             "short_factor": factors[::-1], "original_max_position_embeddings": 512})
    elif kind == "llama-mha":  # one key/value head per query head: v's rows feed o one to one
        config = LlamaConfig(**{**common, "num_key_value_heads": 4}, tie_word_embeddings=False)
    elif kind == "qwen2-256":  # rows of 256 and 512: every i-quant stores itself, none falls back
        config = Qwen2Config(**{**common, "hidden_size": 256, "intermediate_size": 512}, tie_word_embeddings=True)
    elif kind == "llama-wide":  # rows that group 128 divides, as in every real model
        config = LlamaConfig(**{**common, "hidden_size": 128, "intermediate_size": 256}, tie_word_embeddings=True)
    elif kind == "qwen3-moe":  # 4 routed experts, 2 per token, renormalised (as Qwen3-30B-A3B's config says)
        config = Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                norm_topk_prob=True, tie_word_embeddings=False)
    elif kind == "qwen3-moe-unnormalised":  # transformers' default, which llama.cpp's qwen3moe does not compute
        config = Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                                tie_word_embeddings=False)
    elif kind == "qwen2-moe":  # routed experts beside a gated shared expert
        config = Qwen2MoeConfig(**common, moe_intermediate_size=64, shared_expert_intermediate_size=128,
                                num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)
    elif kind == "mixtral":  # block_sparse_moe.experts.<e>.w1/w2/w3 in the checkpoint
        config = MixtralConfig(**{**common, "intermediate_size": 64}, num_local_experts=4, num_experts_per_tok=2,
                               tie_word_embeddings=False, sliding_window=None)
    elif kind in ("gpt-oss", "gpt-oss-llamacpp"):  # fused in x out expert stacks with biases, attention sinks,
        # a window (8) shorter than the test prompts, and YaRN as the real config has it (truncate false) or as
        # llama.cpp computes it (ramp ends rounded)
        yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": kind == "gpt-oss-llamacpp", "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
        config = GptOssConfig(**{**common, "intermediate_size": 64, "max_position_embeddings": 131072}, head_dim=16,
                              num_local_experts=4, num_experts_per_tok=2, sliding_window=8, rope_parameters=yarn,
                              tie_word_embeddings=False)
    elif kind == "deepseek-v2":  # MLA, a shared expert beside the routed ones, a dense first layer
        config = DeepseekV2Config(**{**common, "num_key_value_heads": 4}, moe_intermediate_size=32, n_routed_experts=4,
                                  n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
                                  q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                  tie_word_embeddings=False)
    else:
        raise ValueError(kind)
    if sharp:
        config.initializer_range = 0.25
    model = AutoModelForCausalLM.from_config(config).to(torch.float16)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_dir() / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {kind: _save_tiny(kind, root / kind) for kind in ("llama", "qwen2", "gemma3")}


@pytest.fixture(scope="session")
def tiny_sharded(tmp_path_factory):
    return _save_tiny("llama", tmp_path_factory.mktemp("sharded") / "llama", shard="2MB")


@pytest.fixture(scope="session")
def default_model_dir():
    from cardfit.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture()
def run_cli(capsys):
    from cardfit.cli import main

    def run(*args):
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """Any tiny architecture by name, built once per session."""
    root = tmp_path_factory.mktemp("tiny-any")
    built = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = _save_tiny(kind, root / kind)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def embedded_fit(tmp_path_factory):
    """`cardfit fit` on the embedded model, run once: budget, scan, plan, pack, full check."""
    from cardfit.fit import fit

    out = tmp_path_factory.mktemp("fit") / "run"
    summary = fit(out=out, max_tokens=512, seq_len=256, full_check=True, check_tokens=1024, progress=False, log=None)
    return out, summary


@pytest.fixture()
def calib_text(tmp_path):
    """A short calibration text (the start of the bundled one) as a file."""
    from cardfit.text import load_text

    path = tmp_path / "calib.txt"
    path.write_text(load_text(None)[0][:20000], encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def planned_vllm_artifact(tmp_path_factory, default_model_dir):
    """The embedded model scanned for vLLM, planned at a budget between uniform W4A16 and W8A16 (so the
    recipe mixes them), packed as compressed-tensors: (map, recipe, pack report, checkpoint dir)."""
    from cardfit.pack import pack
    from cardfit.plan import plan
    from cardfit.scan import scan

    root = tmp_path_factory.mktemp("vllm-artifact")
    sensitivity = scan(default_model_dir, None, max_tokens=256, formats="W8A16,W4A16-g128", seq_len=128,
                       out=root / "map.json", progress=False)
    low = sum(g["bytes"]["W4A16-g128"] for g in sensitivity["groups"])
    high = sum(g["bytes"]["W8A16"] for g in sensitivity["groups"])
    recipe = plan(root / "map.json", (low + high) // 2)
    report = pack(recipe, default_model_dir, root / "ct", progress=False)
    return sensitivity, recipe, report, root / "ct"


@pytest.fixture(scope="session")
def planned_vllm_cpu_artifact(tmp_path_factory, default_model_dir):
    """The same for vLLM's CPU build, which serves 4-bit and dense layers: half the budget between
    uniform W4A16 and dense, so the recipe keeps the most sensitive layers dense."""
    from cardfit.pack import pack
    from cardfit.plan import plan
    from cardfit.scan import scan

    root = tmp_path_factory.mktemp("vllm-cpu-artifact")
    sensitivity = scan(default_model_dir, None, max_tokens=256, formats="BF16-dense,W4A16-g128", seq_len=128,
                       out=root / "map.json", progress=False)
    low = sum(g["bytes"]["W4A16-g128"] for g in sensitivity["groups"])
    high = sum(g["bytes"]["BF16-dense"] for g in sensitivity["groups"])
    recipe = plan(root / "map.json", (low + high) // 2, runtime="vllm-cpu")
    report = pack(recipe, default_model_dir, root / "ct", progress=False)
    return sensitivity, recipe, report, root / "ct"


def pytest_addoption(parser):
    parser.addoption("--fuzz-long", action="store_true",
                     help="tests/test_fuzz.py: draw many times the CI's examples, at random (not a fixed seed)")


def pytest_configure(config):
    # read by tests/test_fuzz.py when it is imported, after this hook
    if config.getoption("--fuzz-long", default=False):
        os.environ["CARDFIT_FUZZ_LONG"] = "1"
