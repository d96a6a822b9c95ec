"""Mixture-of-experts models: streamed with transformers' fused expert modules, priced per expert stack,
packed into llama.cpp's `*_exps` tensors. Tiny random models only: no real MoE weights exist offline."""

import json

import pytest
import torch

from cardfit.engine import Engine
from cardfit.errors import CardfitError
from cardfit.groups import expert_stack
from cardfit.sources import open_model

MOE_KINDS = ["qwen3-moe-sharp", "qwen2-moe-sharp", "mixtral-sharp"]


def _ids(n=2, length=24):
    return torch.randint(0, 49152, (n, length), generator=torch.Generator().manual_seed(1))


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_streamed_forward_equals_transformers(tiny_model, kind):
    """Each expert's checkpoint matrix lands in its slice of the fused stack, as from_pretrained puts it."""
    model_dir = tiny_model(kind)
    ids = _ids()
    ours = Engine(open_model(model_dir), "cpu", "float32").forward(ids)
    with torch.no_grad():
        theirs = _hf(model_dir)(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5), float((ours - theirs).abs().max())


def test_an_expert_copy_replaces_only_its_slice(tiny_model):
    """A replaced expert matrix changes the logits exactly as writing it into transformers' fused
    parameter by hand does, and the source's stack is intact afterwards."""
    model_dir = tiny_model("qwen3-moe-sharp")
    source = open_model(model_dir)
    engine = Engine(source, "cpu", "float32")
    ids = _ids()
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    replacement = -2 * source.read(name)
    ours = engine.forward(ids, {name: replacement})
    model = _hf(model_dir)
    fused = model.model.layers[1].mlp.experts.gate_up_proj
    rows = fused.shape[1] // 2
    with torch.no_grad():
        fused[2, rows:] = replacement
        theirs = model(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours, engine.forward(ids), atol=1e-3)  # the replacement mattered
    with torch.no_grad():
        assert torch.allclose(engine.forward(ids), _hf(model_dir)(ids).logits, atol=1e-5, rtol=1e-5)


def test_routers_stay_float32_and_stacks_are_one_group(tiny_model, tmp_path, calib_text):
    """llama.cpp never rounds a router (`ffn_gate_inp`); with --group-by tensor each projection's experts
    are one group, priced and planned together (one GGUF tensor holds them)."""
    from cardfit.formats import get_format
    from cardfit.scan import scan

    model_dir = tiny_model("mixtral-sharp")
    router = "model.layers.0.block_sparse_moe.gate.weight"
    assert get_format("Q4_0").storage(router, (4, 64)) == "F32"
    assert get_format("Q4_0").storage("model.layers.0.block_sparse_moe.experts.1.w1.weight", (64, 64)) == "Q4_0"
    result = scan(model_dir, calib_text, 256, "Q8_0,Q4_0", out=tmp_path / "m.json", seq_len=64, progress=False,
                  device="cpu", group_by="tensor")
    names = [g["name"] for g in result["groups"]]
    assert "model.layers.1.block_sparse_moe.experts.w1.weight" in names
    assert not any(expert_stack(n) for n in names)  # no single expert is a group
    stack = next(g for g in result["groups"] if g["name"] == "model.layers.1.block_sparse_moe.experts.w2.weight")
    assert stack["cells"]["Q4_0"]["damage"] > stack["cells"]["Q8_0"]["damage"] > 0


def test_cells_equal_the_slow_way_through_transformers(tiny_model, tmp_path, calib_text):
    """A layer's cell against KL computed in transformers itself, every expert's rounded copy written
    into the fused parameters by hand (the router rounded by its own storage rule: not at all)."""
    from transformers import AutoTokenizer

    from cardfit.formats import get_format
    from cardfit.metrics import token_kl
    from cardfit.scan import scan
    from cardfit.text import token_chunks

    model_dir = tiny_model("qwen3-moe-sharp")
    result = scan(model_dir, calib_text, 256, "Q4_0", out=tmp_path / "m.json", seq_len=64, progress=False,
                  device="cpu")
    source = open_model(model_dir)
    chunks = token_chunks(AutoTokenizer.from_pretrained(model_dir), calib_text.read_text(), 64, 256)
    fmt = get_format("Q4_0")
    model = _hf(model_dir)
    with torch.no_grad():
        reference = model(chunks).logits
        layer = model.model.layers[1]
        for t in source.groups()["layers.1"]:
            if len(t.shape) < 2:
                continue
            rounded = fmt.roundtrip(t.name, source.read(t.name))
            stack = expert_stack(t.name)
            if stack is None:
                model.get_parameter(t.name).copy_(rounded)
                continue
            expert, projection = stack[1], t.name.split(".")[-2]
            experts = layer.mlp.experts
            rows = experts.gate_up_proj.shape[1] // 2
            target = {"gate_proj": experts.gate_up_proj[expert, :rows], "up_proj": experts.gate_up_proj[expert, rows:],
                      "down_proj": experts.down_proj[expert]}[projection]
            target.copy_(rounded)
        slow = float(token_kl(reference, model(chunks).logits).mean())
    cell = next(g for g in result["groups"] if g["name"] == "layers.1")["cells"]["Q4_0"]["damage"]
    assert slow > 0 and abs(slow - cell) <= 1e-6 + 1e-3 * slow, (slow, cell)


def test_llama_cpp_refuses_what_it_computes_differently(tiny_model, tmp_path, monkeypatch):
    """transformers' Qwen3-MoE default leaves the chosen experts' weights unnormalised; llama.cpp's
    qwen3moe renormalises them. The pack refuses; forced through, llama.cpp indeed computes another model."""
    from cardfit.pack import gguf_arch, pack
    from cardfit.plan import uniform_recipe

    from test_pack_gguf import IDS, hf_logits, llama_cpp_logits, relative_error

    model_dir = tiny_model("qwen3-moe-unnormalised-sharp")
    with pytest.raises(CardfitError, match="renormalises the chosen experts"):
        pack(uniform_recipe(open_model(model_dir), "F16"), model_dir, tmp_path / "refused.gguf", progress=False,
             smoke=False)
    assert not (tmp_path / "refused.gguf").exists()
    monkeypatch.setattr(gguf_arch.ArchSpec, "refuse_moe_llama_cpp_computes_differently", lambda self: None)
    forced = tmp_path / "forced.gguf"
    pack(uniform_recipe(open_model(model_dir), "F16"), model_dir, forced, progress=False, smoke=False)
    assert relative_error(llama_cpp_logits(forced, IDS), hf_logits(model_dir, IDS)) > 0.05


def test_fit_squeezes_experts_attention_and_shared_expert_apart(tiny_model, tmp_path, calib_text):
    """scan (one group per expert stack), plan at a budget between the uniform sizes, pack to GGUF and
    check in llama.cpp: the recipe gives the routed experts, attention and the shared expert more than
    one format, and the artifact is every byte the plan said."""
    from cardfit.check import check
    from cardfit.pack import pack, reserve_bytes
    from cardfit.plan import plan
    from cardfit.scan import scan

    model_dir = tiny_model("qwen2-moe-sharp")
    sensitivity = scan(model_dir, calib_text, 256, "Q8_0,Q4_0", out=tmp_path / "map.json", seq_len=64,
                       progress=False, device="cpu", group_by="tensor")
    reserve = reserve_bytes(open_model(model_dir), "llama.cpp")
    sizes = {f: sum(g["bytes"][f] for g in sensitivity["groups"]) for f in ("Q8_0", "Q4_0")}
    budget = reserve + (sizes["Q8_0"] + sizes["Q4_0"]) // 2
    recipe = plan(sensitivity, budget, reserve_bytes=reserve)
    chosen = {g["name"]: g["format"] for g in recipe["groups"]}
    roles = {"experts": [f for n, f in chosen.items() if ".experts." in n],
             "attention": [f for n, f in chosen.items() if ".self_attn." in n],
             "shared": [f for n, f in chosen.items() if ".shared_expert." in n]}
    assert all(roles.values()) and len({f for formats in roles.values() for f in formats}) == 2, roles
    out = tmp_path / "moe.gguf"
    report = pack(recipe, model_dir, out, progress=False, smoke=False)
    assert out.stat().st_size == report["file_bytes"] <= budget and report["tensor_bytes"] == recipe["bytes"]
    verdict = check(out, model_dir, calib_text, max_tokens=256, seq_len=64)
    assert 0 < verdict["kld_mean"] < 0.5, json.dumps(verdict, default=str)[:400]


def test_what_does_not_reach_experts_is_refused_before_anything_is_written(tiny_model, tmp_path, run_cli,
                                                                           calib_text):
    """Statistics per expert (imatrix/GPTQ/AWQ rounding, the fast and weight signals) and compressed-tensors
    expert stacks are not built yet: one line each, exit 2, no file."""
    model_dir = tiny_model("qwen3-moe-sharp")
    for args in (["--rounding", "imatrix", "--formats", "Q4_K"], ["--method", "fast"], ["--method", "weight"]):
        code, _, err = run_cli("scan", model_dir, "--calibration", calib_text, "--max-tokens", "256",
                               "--seq-len", "64", "--out", tmp_path / "m.json", *args)
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(errors) == 1 and "routed experts" in errors[0], (args, err)
        assert not (tmp_path / "m.json").exists()
    from cardfit.plan import uniform_recipe

    (tmp_path / "vllm.json").write_text(json.dumps(uniform_recipe(open_model(model_dir), "W4A16-g128")))
    code, _, err = run_cli("pack", tmp_path / "vllm.json", "--model", model_dir, "--out", tmp_path / "ct")
    assert code == 2 and "compressed-tensors" in err and not (tmp_path / "ct").exists()
    (tmp_path / "gguf.json").write_text(json.dumps(uniform_recipe(open_model(model_dir), "Q4_K")))
    code, _, err = run_cli("pack", tmp_path / "gguf.json", "--model", model_dir, "--method", "imatrix",
                           "--out", tmp_path / "m.gguf")
    assert code == 2 and "routed experts" in err and not (tmp_path / "m.gguf").exists()


def test_a_stack_with_two_types_is_refused(tiny_model):
    """One GGUF tensor holds every expert of a projection: a format per expert cannot be written."""
    from cardfit.formats import get_format
    from cardfit.pack.gguf_pack import GgufPlan

    source = open_model(tiny_model("qwen3-moe-sharp"))
    formats = {t.name: get_format("Q8_0") for t in source.tensors()}
    formats["model.layers.0.mlp.experts.1.up_proj.weight"] = get_format("Q4_0")
    with pytest.raises(CardfitError, match="one GGUF tensor holds every expert"):
        GgufPlan(source, formats)
    del formats["model.layers.0.mlp.experts.1.up_proj.weight"]
    formats["model.layers.0.mlp.experts.1.up_proj.weight"] = get_format("Q8_0")
    stacked = {e[1]: e for e in GgufPlan(source, formats).entries}["blk.0.ffn_up_exps.weight"]
    assert stacked[0] == tuple(f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(4))
    assert stacked[3] == (4, 64, 64)
