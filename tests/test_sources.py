"""Model sources list groups, shapes and dtypes from headers, and read one tensor at a time."""

import json

import pytest
import torch
from safetensors.torch import load_file

from cardfit.sources import GgufSource, HfDirectorySource, open_model


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_groups_cover_every_tensor_in_forward_order(tiny_models, kind):
    source = open_model(tiny_models[kind])
    groups = source.groups()
    layers = source.geometry.num_layers
    expected = ["embed"] + [f"layers.{i}" for i in range(layers)] + ["norm"]
    if not source.tied_embeddings:
        expected.append("lm_head")
    assert list(groups) == expected
    names = {t.name for ts in groups.values() for t in ts}
    on_disk = load_file(str(tiny_models[kind] / "model.safetensors"))
    assert names == set(on_disk)
    for info in source.tensors():
        assert info.shape == tuple(on_disk[info.name].shape)
        assert info.dtype == "F16"


def test_tied_embeddings_detected(tiny_models):
    assert open_model(tiny_models["qwen2"]).tied_embeddings
    assert not open_model(tiny_models["llama"]).tied_embeddings
    assert open_model(tiny_models["gemma3"]).tied_embeddings


def test_sharded_index_reads_match(tiny_sharded):
    index = json.loads((tiny_sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1, "fixture must really be sharded"
    source = HfDirectorySource(tiny_sharded)
    name = "model.layers.1.mlp.down_proj.weight"
    shard = tiny_sharded / index["weight_map"][name]
    assert torch.equal(source.read(name, dtype=None), load_file(str(shard))[name])


def test_listing_reads_no_weights(tiny_models, monkeypatch):
    import safetensors

    calls = []
    original = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self._h = original(*a, **k)

        def keys(self):
            return self._h.keys()

        def get_slice(self, name):
            return self._h.get_slice(name)

        def get_tensor(self, name):
            calls.append(name)
            return self._h.get_tensor(name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._h.__exit__(*exc)

    monkeypatch.setattr("cardfit.sources.hf_dir.safe_open", Spy)
    source = HfDirectorySource(tiny_models["llama"])
    source.groups()
    source.fingerprint()
    assert calls == []
    source.read("model.norm.weight")
    assert calls == ["model.norm.weight"]


def test_fingerprint_changes_with_config(tiny_models, tmp_path):
    import shutil

    a = open_model(tiny_models["llama"]).fingerprint()
    copy = tmp_path / "copy"
    shutil.copytree(tiny_models["llama"], copy)
    assert open_model(copy).fingerprint() == a
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (copy / "config.json").write_text(json.dumps(config))
    assert open_model(copy).fingerprint() != a


def test_gguf_source_lists_and_dequantizes_the_packaged_model(default_model_dir):
    from cardfit.default_model import default_gguf

    gguf = GgufSource(default_gguf())
    assert gguf.geometry.model_type == "llama" and gguf.geometry.num_layers == 30
    infos = {t.name: t for t in gguf.tensors()}
    down = infos["blk.3.ffn_down.weight"]
    assert down.shape == (576, 1536) and down.dtype == "Q4_1" and down.group == "layers.3"
    assert infos["token_embd.weight"].group == "embed"
    # ffn_down is not permuted by the converter, so it equals the f16 reference up to f16 rounding.
    hf = HfDirectorySource(default_model_dir).read("model.layers.3.mlp.down_proj.weight")
    values = gguf.read("blk.3.ffn_down.weight")
    assert torch.allclose(values.to(torch.float16).float(), hf, atol=0, rtol=0)


def test_default_model_is_a_working_transformers_model(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    ids = tok("The history of the city begins in the Roman era, when a small settlement grew along the river.",
              return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss
    assert torch.exp(loss) < 60  # a trained model; random weights give ~49152


def test_hub_id_resolves_from_the_local_cache_only(tiny_models, tmp_path, monkeypatch):
    import shutil

    from cardfit.errors import CardfitError

    cache = tmp_path / "hub"
    snapshot = cache / "models--someorg--tiny" / "snapshots" / "0123456789abcdef"
    shutil.copytree(tiny_models["llama"], snapshot)
    (cache / "models--someorg--tiny" / "refs").mkdir(parents=True)
    (cache / "models--someorg--tiny" / "refs" / "main").write_text("0123456789abcdef")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    source = open_model("someorg/tiny")
    assert source.geometry.num_layers == 2
    with pytest.raises(CardfitError, match="not in the local Hugging Face cache"):
        open_model("someorg/absent")
