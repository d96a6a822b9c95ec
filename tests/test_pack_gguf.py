"""GGUF packing: llama.cpp loads what we write, computes what transformers computes, and our tensors
are the bytes llama.cpp's own quantizer writes."""

import weakref

import gguf
import numpy as np
import pytest
import torch

from cardfit.errors import CardfitError
from cardfit.pack import pack, reserve_bytes
from cardfit.plan import uniform_recipe
from cardfit.sources import open_model


def llama_cpp_logits(path, ids):
    from cardfit.targets.runtimes import GgufRuntime

    runtime = GgufRuntime(path, n_ctx=64)
    try:
        return runtime.logits(torch.tensor([ids]))[0]
    finally:
        runtime.close()


def hf_logits(model_dir, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def relative_error(a, b):
    a = a - a.mean(-1, keepdim=True)
    b = b - b.mean(-1, keepdim=True)
    return float((a - b).norm() / b.norm())


IDS = [504, 2365, 6354, 16438, 216, 33, 34, 35, 36, 37, 1792, 314, 253, 1015, 30, 2114, 601, 28, 5]


@pytest.mark.parametrize("kind", ["llama-sharp", "mistral-sharp", "qwen2-sharp", "qwen3-sharp", "gemma3-llamacpp-sharp",
                                  "phi3-sharp", "phi3-longrope-sharp", "qwen3-moe-sharp", "qwen2-moe-sharp",
                                  "mixtral-sharp", "gpt-oss-llamacpp-sharp"])
def test_llama_cpp_computes_what_transformers_computes(tiny_model, tmp_path, kind):
    """F16 storage: llama.cpp's logits equal transformers' up to f16 rounding, so names, q/k permutation
    (Llama), norm offset (Gemma 3), biases (Qwen2), q/k norms (Qwen3), fused matrices and longrope
    factors (Phi-3) are all right."""
    model_dir = tiny_model(kind)
    source = open_model(model_dir)
    out = tmp_path / f"{kind}.gguf"
    report = pack(uniform_recipe(source, "F16"), model_dir, out, progress=False, smoke=False)
    assert out.stat().st_size == report["file_bytes"] <= report["weight_budget_bytes"]
    error = relative_error(llama_cpp_logits(out, IDS), hf_logits(model_dir, IDS))
    assert error < 0.01, error


@pytest.mark.parametrize("kind", ["llama-sharp", "gemma3-llamacpp-sharp"])
def test_without_the_converter_transforms_llama_cpp_disagrees(tiny_model, tmp_path, monkeypatch, kind):
    """The agreement above is not vacuous: drop the q/k permutation (Llama) or the norm offset (Gemma 3)
    and llama.cpp computes something else."""
    from cardfit.pack import gguf_arch

    model_dir = tiny_model(kind)
    monkeypatch.setattr(gguf_arch.ArchSpec, "transform", lambda self, name, w: w)
    out = tmp_path / "wrong.gguf"
    pack(uniform_recipe(open_model(model_dir), "F16"), model_dir, out, progress=False, smoke=False)
    assert relative_error(llama_cpp_logits(out, IDS), hf_logits(model_dir, IDS)) > 0.05


def test_without_the_longrope_factors_llama_cpp_disagrees(tiny_model, tmp_path, monkeypatch):
    from cardfit.pack import gguf_arch

    model_dir = tiny_model("phi3-longrope-sharp")
    monkeypatch.setattr(gguf_arch.ArchSpec, "extra_tensors", lambda self: {})
    out = tmp_path / "plain-rope.gguf"
    pack(uniform_recipe(open_model(model_dir), "F16"), model_dir, out, progress=False, smoke=False)
    assert relative_error(llama_cpp_logits(out, IDS), hf_logits(model_dir, IDS)) > 0.05


def test_a_phi3_name_on_a_foreign_vocabulary_is_not_written(tiny_model, tmp_path):
    """llama.cpp applies Phi-3's token rules to any model named phi3 and fails to load a vocabulary
    without Phi-3's tokens ("unordered_map::at"): the tiny Phi-3 carries SmolLM2's vocabulary."""
    model_dir = tiny_model("phi3")
    assert "phi3" in model_dir.name
    out = tmp_path / "phi3.gguf"
    report = pack(uniform_recipe(open_model(model_dir), "Q8_0"), model_dir, out, progress=False, smoke=False)
    assert any("Phi-3's token rules" in w for w in report["warnings"])
    assert gguf.GGUFReader(str(out)).get_field("general.name").contents() == "model"
    assert torch.isfinite(llama_cpp_logits(out, IDS)).all()  # llama.cpp loads it


def test_planned_recipe_file_fits_its_budget_and_bytes_match_the_plan(tiny_model, tmp_path, calib_text):
    from cardfit.plan import plan
    from cardfit.scan import scan

    model_dir = tiny_model("llama")
    scan(model_dir, calib_text, max_tokens=256, formats="Q8_0,Q4_0,Q2_K", seq_len=32, out=tmp_path / "map.json",
         progress=False)
    source = open_model(model_dir)
    reserve = reserve_bytes(source, "llama.cpp")
    import json

    groups = json.loads((tmp_path / "map.json").read_text())["groups"]
    budget = reserve + (sum(max(g["bytes"].values()) for g in groups) + sum(min(g["bytes"].values()) for g in groups)) // 2
    recipe = plan(tmp_path / "map.json", budget, reserve_bytes=reserve)
    assert len({g["format"] for g in recipe["groups"]}) > 1  # the budget squeezes: a real mix
    report = pack(recipe, model_dir, tmp_path / "mix.gguf", progress=False, smoke=False)
    assert report["tensor_bytes"] == recipe["bytes"]  # tensor data is exactly what the plan counted
    assert report["file_bytes"] <= budget  # and the whole file, metadata included, fits
    assert report["file_bytes"] - report["tensor_bytes"] <= reserve
    reader = gguf.GGUFReader(str(tmp_path / "mix.gguf"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    for g in recipe["groups"]:
        if g["name"].startswith("layers."):
            i = g["name"].split(".")[1]
            assert types[f"blk.{i}.attn_q.weight"] == g["format"]


def test_uniform_tensors_are_the_bytes_llama_cpp_quantize_writes(default_model_dir, tmp_path):
    """Our F16 GGUF is our 'convert'; llama.cpp's own quantize on it must give our quantized file, bit for bit."""
    from cardfit.targets.shelf import llama_quantize

    source = open_model(default_model_dir)
    pack(uniform_recipe(source, "F16"), default_model_dir, tmp_path / "f16.gguf", progress=False, smoke=False)
    for fmt in ("Q8_0", "Q4_K"):
        ours = tmp_path / f"ours-{fmt}.gguf"
        pack(uniform_recipe(source, fmt), default_model_dir, ours, progress=False, smoke=False)
        theirs = llama_quantize(tmp_path / "f16.gguf", tmp_path / f"theirs-{fmt}.gguf", fmt, pure=True)
        a = {t.name: t for t in gguf.GGUFReader(str(ours)).tensors}
        b = {t.name: t for t in gguf.GGUFReader(str(theirs)).tensors}
        assert a.keys() == b.keys()
        for name in a:
            assert a[name].tensor_type == b[name].tensor_type, name
            assert np.array_equal(np.asarray(a[name].data).view(np.uint8), np.asarray(b[name].data).view(np.uint8)), name


def test_converted_metadata_and_values_match_the_original_gguf(default_model_dir, tmp_path):
    """The embedded model came as a llama.cpp-converted GGUF: our conversion of it reproduces that file's
    hyper-parameters and tokenizer exactly, and its values to f16 precision."""
    from cardfit.default_model import default_gguf

    out = tmp_path / "f16.gguf"
    pack(uniform_recipe(open_model(default_model_dir), "F16"), default_model_dir, out, progress=False, smoke=False)
    original, ours = gguf.GGUFReader(str(default_gguf())), gguf.GGUFReader(str(out))
    for key, field in original.fields.items():
        if key.startswith(("general.", "GGUF.")):
            continue
        assert key in ours.fields, key
        assert ours.fields[key].contents() == field.contents(), key
    by_name = {t.name: t for t in original.tensors}
    for t in ours.tensors:
        o = by_name[t.name]
        a = gguf.quants.dequantize(o.data, o.tensor_type).astype(np.float32).reshape(-1)
        b = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        assert np.allclose(a, b, rtol=1e-3, atol=1e-6), t.name


def test_pack_holds_one_tensor_at_a_time(tiny_model, tmp_path, monkeypatch):
    """Streaming: at no moment is more than one source tensor alive while packing."""
    from cardfit.sources.hf_dir import HfDirectorySource

    live, peak = {"bytes": 0}, {"bytes": 0, "largest": 0}
    original = HfDirectorySource.read

    def spy(self, name, dtype=torch.float32):
        tensor = original(self, name, dtype)
        size = tensor.numel() * tensor.element_size()
        live["bytes"] += size
        peak["bytes"] = max(peak["bytes"], live["bytes"])
        peak["largest"] = max(peak["largest"], size)
        weakref.finalize(tensor, lambda: live.__setitem__("bytes", live["bytes"] - size))
        return tensor

    monkeypatch.setattr(HfDirectorySource, "read", spy)
    model_dir = tiny_model("llama")
    pack(uniform_recipe(open_model(model_dir), "Q8_0"), model_dir, tmp_path / "q.gguf", progress=False, smoke=False)
    assert peak["largest"] > 0 and peak["bytes"] == peak["largest"]


def test_imatrix_rounding_changes_the_bytes_and_lowers_the_error(default_model_dir, tmp_path):
    """imatrix packing is data-aware for real: other bytes than RTN, and closer to the reference."""
    from cardfit.check import check

    source = open_model(default_model_dir)
    recipe = uniform_recipe(source, "Q4_0")
    pack(recipe, default_model_dir, tmp_path / "rtn.gguf", progress=False, smoke=False)
    pack(recipe, default_model_dir, tmp_path / "imat.gguf", method="imatrix", max_tokens=1024, progress=False,
         smoke=False)
    rtn = {t.name: bytes(np.asarray(t.data).view(np.uint8)) for t in gguf.GGUFReader(str(tmp_path / "rtn.gguf")).tensors}
    imat = {t.name: bytes(np.asarray(t.data).view(np.uint8)) for t in gguf.GGUFReader(str(tmp_path / "imat.gguf")).tensors}
    assert rtn["token_embd.weight"] == imat["token_embd.weight"]  # a lookup table takes no imatrix
    assert rtn["blk.3.attn_q.weight"] != imat["blk.3.attn_q.weight"]
    a = check(tmp_path / "rtn.gguf", default_model_dir, max_tokens=1024, seq_len=256)
    b = check(tmp_path / "imat.gguf", default_model_dir, max_tokens=1024, seq_len=256)
    assert b["kld_mean"] < a["kld_mean"]


def test_refusals(tiny_model, tmp_path, run_cli):
    import json

    llama, qwen = tiny_model("llama"), tiny_model("qwen2")
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(uniform_recipe(open_model(llama), "Q8_0")))
    # a recipe planned for another model
    code, _, err = run_cli("pack", recipe, "--model", qwen, "--out", tmp_path / "x.gguf")
    assert code == 2 and "another model" in err and not (tmp_path / "x.gguf").exists()
    # the output exists
    (tmp_path / "exists.gguf").write_bytes(b"keep")
    code, _, err = run_cli("pack", recipe, "--model", llama, "--out", tmp_path / "exists.gguf", "--no-smoke")
    assert code == 2 and "exists" in err and (tmp_path / "exists.gguf").read_bytes() == b"keep"
    # a method the format does not take
    code, _, err = run_cli("pack", recipe, "--model", llama, "--out", tmp_path / "y.gguf", "--method", "gptq")
    assert code == 2 and "does not apply" in err
    # an architecture llama.cpp would run differently from transformers (Gemma 3 with its own layer pattern)
    gemma = tiny_model("gemma3")
    with pytest.raises(CardfitError, match="sliding"):
        pack(uniform_recipe(open_model(gemma), "Q8_0"), gemma, tmp_path / "g.gguf", progress=False, smoke=False)
    assert not list(tmp_path.glob(".g.gguf*"))


def test_disk_full_leaves_nothing(tiny_model, tmp_path, monkeypatch):
    import errno

    model_dir = tiny_model("llama")
    recipe = uniform_recipe(open_model(model_dir), "Q8_0")
    calls = {"n": 0}
    original = gguf.GGUFWriter.write_tensor_data

    def fills_up(self, tensor, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, tensor, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", fills_up)
    with pytest.raises(CardfitError, match="disk filled up"):
        pack(recipe, model_dir, tmp_path / "full.gguf", progress=False, smoke=False)
    assert calls["n"] == 3 and list(tmp_path.iterdir()) == []


def test_too_little_free_space_is_refused_before_writing(tiny_model, tmp_path, monkeypatch):
    import collections
    import shutil

    model_dir = tiny_model("llama")
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(CardfitError, match="disk has"):
        pack(uniform_recipe(open_model(model_dir), "Q8_0"), model_dir, tmp_path / "n.gguf", progress=False,
             smoke=False)
    assert list(tmp_path.iterdir()) == []


def test_imatrix_file_round_trips_into_the_same_bytes(default_model_dir, tmp_path, run_cli):
    """`cardfit imatrix` writes llama.cpp's GGUF layout; packing with that file gives the very bytes that
    collecting the statistics inside pack gives, from the same tokens."""
    code, out, err = run_cli("imatrix", "--max-tokens", "512", "--seq-len", "256", "--out", tmp_path / "imatrix.gguf")
    assert code == 0, err
    said = out.splitlines()  # what it will do, then the rest's time from the first layer's, before the result
    assert said[0] == "imatrix: 512 tokens (2 chunks of 256) through 30 layers"
    assert said[1].startswith("the first layer took ") and "for the other 29 layers" in said[1]
    reader = gguf.GGUFReader(str(tmp_path / "imatrix.gguf"))
    assert reader.get_field("general.type").contents() == "imatrix"
    assert reader.get_field("general.architecture") is None
    assert reader.get_field("imatrix.chunk_size").contents() == 256
    assert reader.get_field("imatrix.chunk_count").contents() == 2
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 * 7 * 30  # q, k, v, o, gate, up, down in 30 layers; tied output has none
    q = tensors["blk.0.attn_q.weight.in_sum2"]
    assert q.data.size == 576 and float(tensors["blk.0.attn_q.weight.counts"].data[0, 0]) == 512
    assert (q.data > 0).all()
    recipe = uniform_recipe(open_model(default_model_dir), "Q4_K")
    pack(recipe, default_model_dir, tmp_path / "from-file.gguf", imatrix=tmp_path / "imatrix.gguf", progress=False,
         smoke=False)
    pack(recipe, default_model_dir, tmp_path / "collected.gguf", method="imatrix", max_tokens=512, seq_len=256,
         progress=False, smoke=False)
    pack(recipe, default_model_dir, tmp_path / "rtn.gguf", progress=False, smoke=False)

    def tensor_bytes(name):  # general.name differs: it is the file's stem
        return {t.name: bytes(t.data.tobytes()) for t in gguf.GGUFReader(str(tmp_path / name)).tensors}

    collected = tensor_bytes("collected.gguf")
    assert tensor_bytes("from-file.gguf") == collected != tensor_bytes("rtn.gguf")
    import json

    (tmp_path / "r.json").write_text(json.dumps(recipe))
    code, _, err = run_cli("pack", tmp_path / "r.json", "--imatrix", tmp_path / "rtn.gguf", "--out", tmp_path / "x.gguf")
    assert code == 2 and "not an imatrix" in err and not (tmp_path / "x.gguf").exists()
