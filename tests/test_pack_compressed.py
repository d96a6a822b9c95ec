"""compressed-tensors packing: transformers (compressed-tensors' own decompression) loads exactly our
weights, the config declares what llmcompressor's W4A16 recipe declares, and mixed recipes say per module."""

import json

import pytest
import torch

from cardfit.formats import get_format
from cardfit.pack import pack
from cardfit.plan import uniform_recipe
from cardfit.sources import open_model


def loaded_weights(path):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    return {n: p.detach() for n, p in model.named_parameters()}


def test_uniform_w4a16_declares_llmcompressors_scheme(tiny_model, tmp_path):
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme

    model_dir = tiny_model("llama-wide")
    out = tmp_path / "w4a16"
    pack(uniform_recipe(open_model(model_dir), "W4A16-g128"), model_dir, out, progress=False, smoke=False)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    assert config["ignore"] == ["lm_head"]
    (group,) = config["config_groups"].values()
    assert group["targets"] == ["Linear"]
    preset = preset_name_to_scheme("W4A16", ["Linear"]).weights
    ours = QuantizationArgs.model_validate(group["weights"])
    for key in ("num_bits", "type", "symmetric", "strategy", "group_size"):
        assert getattr(ours, key) == getattr(preset, key), key


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_transformers_loads_exactly_our_weights(tiny_model, tmp_path, method):
    from cardfit.quant import quantize_int

    model_dir = tiny_model("llama-wide")
    source = open_model(model_dir)
    out = tmp_path / method
    report = pack(uniform_recipe(source, "W4A16-g128"), model_dir, out, method=method, max_tokens=256, seq_len=64,
                  progress=False, smoke=False)
    assert report["tensor_bytes"] == report["planned_bytes"]
    weights = loaded_weights(out)
    fmt = get_format("W4A16-g128")
    name = "model.layers.1.mlp.down_proj.weight"
    w = source.read(name)
    q, s, z, _ = quantize_int(fmt, w, None, "rtn")
    rtn = fmt.dequantize(q, s.half().float(), z)
    loaded = weights[name]
    if method == "rtn":  # the very integers and scales we chose are what the runtime computes with
        scale = s.half().float().repeat_interleave(128, dim=1)
        assert torch.equal(torch.round(loaded / scale), q.float())
        assert torch.allclose(loaded, rtn, rtol=1e-3, atol=0)  # the product is taken in float16 there
    else:  # GPTQ rounds differently from RTN, still 16 levels per row and group of 128
        assert not torch.allclose(loaded, rtn, rtol=1e-3, atol=0)
        groups = loaded.reshape(loaded.shape[0], -1, 128)
        assert max(len(torch.unique(groups[r, g])) for r in range(0, loaded.shape[0], 7)
                   for g in range(groups.shape[1])) <= 16
    assert torch.equal(weights["model.embed_tokens.weight"], source.read("model.embed_tokens.weight"))


def test_mixed_recipe_names_each_module_and_ignores_dense_ones(tiny_model, tmp_path):
    model_dir = tiny_model("llama-wide")
    source = open_model(model_dir)
    recipe = uniform_recipe(source, "W4A16-g128")
    for g in recipe["groups"]:
        if g["name"] == "layers.0":
            g["format"] = "W8A16"
        if g["name"] == "layers.1":
            g["format"] = "BF16-dense"
    recipe["groups"] = [dict(g, bytes=sum(get_format(g["format"]).tensor_bytes(t.name, t.shape)
                                          for t in source.groups()[g["name"]]))
                        if g["name"].startswith("layers.") else g for g in recipe["groups"]]
    recipe["bytes"] = sum(g["bytes"] for g in recipe["groups"])  # a recipe's total is its groups' sum
    recipe["budget"]["weight_budget_bytes"] = 10**9
    out = tmp_path / "mixed"
    pack(recipe, model_dir, out, progress=False, smoke=False)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    by_bits = {g["weights"]["num_bits"]: g["targets"] for g in config["config_groups"].values()}
    assert "model.layers.0.self_attn.q_proj" in by_bits[8]
    assert all(t.startswith("model.layers.0.") for t in by_bits[8])
    assert "model.layers.1.mlp.down_proj" in config["ignore"] and "lm_head" in config["ignore"]
    weights = loaded_weights(out)
    kept = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(weights[kept], source.read(kept))  # a dense group is stored untouched


def test_asymmetric_artifact_is_refused_by_name_in_transformers(tiny_model, tmp_path, run_cli, calib_text):
    """transformers cannot load a packed zero point (llm-compressor#1618): check says that, and where to
    check it instead, rather than "cannot load"; the artifact itself is left as it was."""
    model_dir = tiny_model("llama-wide")
    out = tmp_path / "asym"
    pack(uniform_recipe(open_model(model_dir), "W4A16-g128-asym"), model_dir, out, progress=False, smoke=False)
    before = sorted((p.name, p.stat().st_size) for p in out.iterdir())
    code, _, err = run_cli("check", out, "--reference", model_dir, "--text", calib_text, "--max-tokens", "128",
                           "--seq-len", "64")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "llm-compressor#1618" in errors[0] and "--runtime vllm" in errors[0], err
    assert sorted((p.name, p.stat().st_size) for p in out.iterdir()) == before


def test_embedded_model_packs_and_generates(default_model_dir, tmp_path):
    """The real model, W4A16 (groups fall back to 64 on its 576-wide rows): loads, generates, and is close."""
    from cardfit.check import check

    out = tmp_path / "smol-w4a16"
    report = pack(uniform_recipe(open_model(default_model_dir), "W4A16-g128"), default_model_dir, out,
                  progress=False)
    assert report["smoke"]["perplexity"] < 100
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    text = tokenizer.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0][ids.shape[1]:])
    assert "Paris" in text
    result = check(out, default_model_dir, max_tokens=512, seq_len=256)
    assert result["verdict"] == "pass" and result["runtime"] == "transformers" and 0 < result["kld_mean"] < 1


def test_planned_vllm_recipe_for_the_embedded_model(planned_vllm_artifact):
    """Scan for vLLM, plan at a budget that squeezes, pack, and run the checkpoint in transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sensitivity, recipe, report, out = planned_vllm_artifact
    assert sensitivity["runtime"] == "vllm"
    assert {g["format"] for g in recipe["groups"]} == {"W8A16", "W4A16-g128"}
    assert report["tensor_bytes"] == recipe["bytes"] <= recipe["budget"]["weight_budget_bytes"]
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert sorted(g["weights"]["num_bits"] for g in config["config_groups"].values())[-1] == 8
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    assert "Paris" in tokenizer.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0][ids.shape[1]:])
