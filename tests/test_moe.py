"""Mixture-of-experts models: streamed with transformers' fused expert modules, priced per expert stack,
packed into llama.cpp's `*_exps` tensors. Tiny random models only: no real MoE weights exist offline."""

import json
import re

import pytest
import torch

from cardfit.engine import Engine
from cardfit.errors import CardfitError
from cardfit.groups import expert_stack
from cardfit.sources import open_model

MOE_KINDS = ["qwen3-moe-sharp", "qwen2-moe-sharp", "mixtral-sharp", "gpt-oss-sharp", "deepseek-v2-sharp"]


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


def _write_up_of_expert_2(experts, value):
    """Expert 2's up projection written into transformers' fused stack by hand: [gate; up] rows, or gpt-oss's
    in x out stack with gate and up interleaved column by column."""
    fused = experts.gate_up_proj
    if type(experts).__name__ == "GptOssExperts":
        fused[2, :, 1::2] = value.T
    else:
        fused[2, fused.shape[1] // 2:] = value


@pytest.mark.parametrize("kind", ["qwen3-moe-sharp", "gpt-oss-sharp"])
def test_an_expert_copy_replaces_only_its_slice(tiny_model, kind):
    """A replaced expert matrix changes the logits exactly as writing it into transformers' fused
    parameter by hand does, and the source's stack is intact afterwards."""
    model_dir = tiny_model(kind)
    source = open_model(model_dir)
    engine = Engine(source, "cpu", "float32")
    ids = _ids()
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    replacement = -2 * source.read(name)
    ours = engine.forward(ids, {name: replacement})
    model = _hf(model_dir)
    with torch.no_grad():
        _write_up_of_expert_2(model.model.layers[1].mlp.experts, replacement)
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
    from cardfit.engine.metrics import token_kl
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


@pytest.mark.parametrize("kind", ["qwen2-moe-sharp", "gpt-oss-llamacpp-sharp"])
def test_fit_squeezes_experts_attention_and_shared_expert_apart(tiny_model, tmp_path, calib_text, kind):
    """scan (one group per expert stack, imatrix rounding: statistics per expert), plan at a budget between
    the uniform sizes, pack to GGUF with the imatrix and check in llama.cpp: the recipe gives the routed
    experts, attention and the shared expert (Qwen2-MoE; gpt-oss has none) more than one format, and the
    artifact is every byte the plan said."""
    from cardfit.check import check
    from cardfit.pack import pack, reserve_bytes
    from cardfit.plan import plan
    from cardfit.scan import scan

    model_dir = tiny_model(kind)
    sensitivity = scan(model_dir, calib_text, 256, "Q8_0,Q4_0", out=tmp_path / "map.json", seq_len=64,
                       progress=False, device="cpu", group_by="tensor", rounding="imatrix")
    reserve = reserve_bytes(open_model(model_dir), "llama.cpp")
    sizes = {f: sum(g["bytes"][f] for g in sensitivity["groups"]) for f in ("Q8_0", "Q4_0")}
    budget = reserve + (sizes["Q8_0"] + sizes["Q4_0"]) // 2
    recipe = plan(sensitivity, budget, reserve_bytes=reserve)
    chosen = {g["name"]: g["format"] for g in recipe["groups"]}
    roles = {"experts": [f for n, f in chosen.items() if ".experts." in n],
             "attention": [f for n, f in chosen.items() if ".self_attn." in n],
             "shared": [f for n, f in chosen.items() if ".shared_expert." in n]}
    if kind.startswith("gpt-oss"):
        del roles["shared"]
    assert all(roles.values()) and len({f for formats in roles.values() for f in formats}) == 2, roles
    out = tmp_path / "moe.gguf"
    report = pack(recipe, model_dir, out, method="imatrix", calibration=calib_text, max_tokens=256, seq_len=64,
                  progress=False, smoke=False)
    assert out.stat().st_size == report["file_bytes"] <= budget and report["tensor_bytes"] == recipe["bytes"]
    verdict = check(out, model_dir, calib_text, max_tokens=256, seq_len=64)
    assert 0 < verdict["kld_mean"] < 0.5, json.dumps(verdict, default=str)[:400]


def test_every_signal_reaches_experts(tiny_model, tmp_path, run_cli, calib_text):
    """The fast (Fisher) and weight signals price every expert stack."""
    model_dir = tiny_model("qwen3-moe-sharp")
    for method in ("fast", "weight"):
        code, _, err = run_cli("scan", model_dir, "--calibration", calib_text, "--max-tokens", "256", "--seq-len",
                               "64", "--out", tmp_path / f"{method}.json", "--method", method, "--group-by", "tensor",
                               "--formats", "Q8_0,Q4_0")
        assert code == 0, err
        cells = {g["name"]: g["cells"] for g in json.loads((tmp_path / f"{method}.json").read_text())["groups"]}
        stack = cells["model.layers.0.mlp.experts.down_proj.weight"]
        assert stack["Q4_0"]["damage"] > stack["Q8_0"]["damage"] > 0, (method, stack)


def _experts_apart(source, dense_format: str, experts_format: str) -> dict:
    """A recipe with every layer in `dense_format` and each expert stack in `experts_format` (as a plan from
    a per-tensor map names them), its bytes the sum of what each tensor stores."""
    from cardfit.formats import get_format
    from cardfit.plan import uniform_recipe

    recipe = uniform_recipe(source, dense_format)
    dense, experts = get_format(dense_format), get_format(experts_format)
    stacks: dict[str, int] = {}
    by_group = {g["name"]: g for g in recipe["groups"]}
    for t in source.tensors():
        if expert_stack(t.name) and len(t.shape) == 2:
            by_group[t.group]["bytes"] -= dense.tensor_bytes(t.name, t.shape)
            stack = expert_stack(t.name)[0]
            stacks[stack] = stacks.get(stack, 0) + experts.tensor_bytes(t.name, t.shape)
    recipe["groups"] += [{"name": n, "format": experts.name, "damage": None, "bytes": b} for n, b in stacks.items()]
    recipe["bytes"] = sum(g["bytes"] for g in recipe["groups"])
    recipe["budget"]["weight_budget_bytes"] = max(recipe["budget"]["weight_budget_bytes"], recipe["bytes"] * 2)
    recipe["margin_bytes"] = recipe["budget"]["weight_budget_bytes"] - recipe["bytes"]
    return recipe


@pytest.mark.parametrize("kind", ["qwen3-moe-sharp", "qwen2-moe-sharp", "mixtral-sharp", "deepseek-v2-sharp",
                                  "qwen3-moe-unnormalised"])  # what llama.cpp refuses, sending it here
def test_compressed_tensors_experts_run_back_in_transformers(tiny_model, tmp_path, kind):
    """Experts packed one per expert (as llmcompressor writes them) under one `re:` target, attention in
    another scheme, routers and the shared expert's gate ignored: transformers stacks and decompresses them
    into its fused experts, and its logits are the model's with every matrix replaced by what was stored."""
    from cardfit.pack import pack
    from cardfit.formats import is_packed_matrix
    from cardfit.pack.compressed import EXPERTS_TARGET
    from test_pack_gguf import relative_error

    model_dir = tiny_model(kind)
    source = open_model(model_dir)
    recipe = _experts_apart(source, "W8A16", "W4A16-g32")
    out = tmp_path / "ct"
    pack(recipe, model_dir, out, progress=False, smoke=False)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    schemes = {g["weights"]["num_bits"]: g["targets"] for g in config["config_groups"].values()}
    assert schemes[4] == [EXPERTS_TARGET] and all(".experts." not in t for t in schemes[8]), schemes
    routers = {t.name.removesuffix(".weight") for t in source.tensors() if t.name.endswith(("mlp.gate.weight",
               "block_sparse_moe.gate.weight", "shared_expert_gate.weight"))}
    assert routers and routers <= set(config["ignore"]), (routers, config["ignore"])
    from cardfit.recipes import tensor_formats

    formats = tensor_formats(recipe, source)
    stored = {t.name: formats[t.name].roundtrip(t.name, source.read(t.name)) for t in source.tensors()
              if is_packed_matrix(t.name, t.shape)}
    model = _hf(out)
    params = dict(model.named_parameters())
    for name, weight in stored.items():  # each expert's slice of the fused stack, rebuilt in float16
        if expert_stack(name):
            prefix, expert, projection = re.match(r"(.*\.experts)\.(\d+)\.(\w+)\.weight$", name).groups()
            prefix = prefix.replace(".block_sparse_moe.", ".mlp.")  # transformers 5 renames Mixtral's
            if projection in ("down_proj", "w2"):
                got = params[f"{prefix}.down_proj"][int(expert)]
            else:
                fused = params[f"{prefix}.gate_up_proj"][int(expert)]
                half = fused.shape[0] // 2
                got = fused[:half] if projection in ("gate_proj", "w1") else fused[half:]
            assert torch.equal(got.float(), weight.half().float()), name
    ids = _ids()
    engine = Engine(source, "cpu", "float32")
    expected, plain = engine.forward(ids, stored), engine.forward(ids)
    with torch.no_grad():
        loaded = model(ids).logits
    # transformers runs those float16 experts in float16 (7.6e-4 relative on the Qwen3-MoE model)
    off, rounding = relative_error(loaded, expected), relative_error(expected, plain)
    assert off < 3e-3 and off < rounding / 10, (off, rounding)


def test_a_vllm_plan_gives_every_expert_one_symmetric_packed_format(tiny_model, tmp_path, calib_text):
    """transformers decompresses every expert with one symmetric scheme: the plan ties all expert stacks to
    one format and keeps them off 16-bit and zero-point formats, while attention and the shared expert are
    still planned apart; the packed artifact is checked in transformers (planned without zero-point formats:
    transformers 5.24 loads no packed zero point, for any layer, llm-compressor#1618)."""
    from cardfit.check import check
    from cardfit.formats import get_format
    from cardfit.pack import pack, reserve_bytes
    from cardfit.plan import plan
    from cardfit.scan import scan

    model_dir = tiny_model("qwen2-moe-sharp")
    menu = "BF16-dense,W8A16,W4A16-g128,W4A16-g128-asym"
    sensitivity = scan(model_dir, calib_text, 256, menu, out=tmp_path / "map.json", seq_len=64, progress=False,
                       device="cpu", group_by="tensor")
    reserve = reserve_bytes(open_model(model_dir), "vllm")
    sizes = {f: sum(g["bytes"][f] for g in sensitivity["groups"]) for f in ("W8A16", "W4A16-g128")}
    budget = reserve + (sizes["W8A16"] + sizes["W4A16-g128"]) // 2
    for formats in (None, ["BF16-dense", "W8A16", "W4A16-g128"]):  # transformers loads no zero point (below)
        recipe = plan(sensitivity, budget, formats=formats, reserve_bytes=reserve)
        chosen = {g["name"]: g["format"] for g in recipe["groups"]}
        experts = {f for n, f in chosen.items() if ".experts." in n}
        assert len(experts) == 1 and get_format(experts.pop()).name in ("W8A16", "W4A16-g128"), chosen
        assert len({f for n, f in chosen.items() if ".experts." not in n and ".layers." in n}) >= 2, chosen
    out = tmp_path / "ct"
    pack(recipe, model_dir, out, progress=False, smoke=False)
    verdict = check(out, model_dir, calib_text, max_tokens=256, seq_len=64)
    assert verdict["runtime"].startswith("transformers") and 0 < verdict["kld_mean"] < 0.5, verdict


def test_compressed_tensors_experts_it_cannot_hold_are_refused(tiny_model, tmp_path, run_cli):
    """gpt-oss (transformers loads only its fused stacks), experts left 16-bit or with zero points, experts in
    two formats: one line each, exit 2, nothing written (fit refuses gpt-oss before its scan)."""
    source_dir = tiny_model("qwen3-moe-sharp")
    source = open_model(source_dir)
    cases = {"16-bit": _experts_apart(source, "W4A16-g32", "BF16-dense"),
             "asymmetric": _experts_apart(source, "W8A16", "W4A16-g128-asym"),
             "two formats": _experts_apart(source, "W8A16", "W4A16-g32")}
    cases["two formats"]["groups"][-1]["format"] = "W8A16"
    says = {"16-bit": "loads experts only in", "asymmetric": "loads experts only in", "two formats": "2 formats"}
    for case, recipe in cases.items():
        (tmp_path / "r.json").write_text(json.dumps(recipe))
        code, _, err = run_cli("pack", tmp_path / "r.json", "--model", source_dir, "--out", tmp_path / "ct")
        assert code == 2 and says[case] in err and not (tmp_path / "ct").exists(), (case, err)
    gpt = tiny_model("gpt-oss-sharp")
    from cardfit.plan import uniform_recipe

    (tmp_path / "g.json").write_text(json.dumps(uniform_recipe(open_model(gpt), "W4A16-g32")))
    code, _, err = run_cli("pack", tmp_path / "g.json", "--model", gpt, "--out", tmp_path / "ct")
    assert code == 2 and "fused stacks" in err and not (tmp_path / "ct").exists(), err
    code, _, err = run_cli("fit", gpt, "--vram", "24GiB", "--format", "compressed-tensors", "--out", tmp_path / "run")
    assert code == 2 and "fused stacks" in err and not (tmp_path / "run").exists()  # before the scan


def _never_route(model, expert: int):
    """Hooks making every router of `model` choose another expert wherever it chose `expert` (an expert no
    calibration token reaches, as happens to some of a real MoE's experts on a short text)."""
    def hook(module, args, output):
        logits, weights, chosen = output
        taken = torch.zeros(chosen.shape[0], module.num_experts + 1, dtype=torch.bool).scatter_(1, chosen, True)
        spare = (~taken[:, :module.num_experts]).float().argmax(-1, keepdim=True).expand_as(chosen)
        return logits, weights, torch.where(chosen == expert, spare, chosen)

    return [m.register_forward_hook(hook) for name, m in model.named_modules() if name.endswith("mlp.gate")]


@pytest.mark.parametrize("kind", ["qwen3-moe-sharp", "gpt-oss-sharp"])
def test_expert_inputs_are_what_each_expert_multiplies(tiny_model, kind):
    """The tap's rows for each expert rebuild the fused module's own output: its tokens are the ones
    routed to it, its down projection's input is act(gate) * up of them (gpt-oss: its clamped, biased
    gating); a swapped gate/up, a wrong token or a wrong activation would not add up."""
    from cardfit.quant.experts import READS_ACTIVATION, READS_TOKENS, ExpertTap

    model_dir = tiny_model(kind)
    model = _hf(model_dir)
    experts = model.model.layers[1].mlp.experts
    names = {f"e{e}.{part}": type("P", (), {"param": f"x.{part}", "expert": e})
             for e in range(4) for part in (READS_TOKENS, READS_ACTIVATION)}
    rows, routing, calls = {}, {}, []

    def record(key, x, weight):
        rows.setdefault(key, []).append(x)
        routing.setdefault(key, []).append(weight)

    tap = ExpertTap(experts, "layer1", list(names.items()), record)
    experts.register_forward_hook(lambda m, args, out: calls.append((args, out)))
    with torch.no_grad():
        model(_ids())
    tap.close()
    (hidden, chosen, weights), out = calls[0]
    assert tap.tokens == hidden.shape[0]
    rebuilt = torch.zeros_like(out)
    for e in range(4):
        picked = (chosen == e).nonzero()
        assert torch.equal(rows[("layer1", e, READS_TOKENS)][0], hidden[picked[:, 0]])
        down_input = rows[("layer1", e, READS_ACTIVATION)][0]
        if kind.startswith("gpt-oss"):  # in x out, with a bias
            down = down_input @ experts.down_proj[e] + experts.down_proj_bias[e]
        else:
            down = down_input @ experts.down_proj[e].T
        assert torch.equal(routing[("layer1", e, READS_ACTIVATION)][0], weights[picked[:, 0], picked[:, 1]])
        contribution = down * routing[("layer1", e, READS_TOKENS)][0][:, None]
        rebuilt.index_add_(0, picked[:, 0], contribution)
    assert torch.allclose(rebuilt, out, atol=1e-5, rtol=1e-4), float((rebuilt - out).abs().max())


def test_an_expert_no_token_reached_is_rounded_as_llama_quantize_does(tiny_model):
    """Statistics per expert; one the router never chose gets llama-quantize's stand-in (importance one
    per column), GPTQ's identity (its rounding is RTN's) and an empty AWQ sample (the identity scale)."""
    from cardfit.groups import GroupId
    from cardfit.quant.awq import awq_search
    from cardfit.quant.model import layer_statistics

    engine = Engine(open_model(tiny_model("mixtral-sharp")), "cpu", "float32")
    hooks = _never_route(engine.stream.model, 3)
    hidden = engine.embed([_ids(2, 40)])
    names = [t.name for t in engine.stream.groups[GroupId.layer_group(0)] if len(t.shape) == 2]
    stats = layer_statistics(engine, 0, names, {"imatrix", "gptq", "awq"}, hidden)
    for h in hooks:
        h.remove()
    prefix = "model.layers.0.block_sparse_moe.experts."
    assert sorted(stats.unvisited()) == [f"{prefix}3.w{i}.weight" for i in (1, 2, 3)]
    visited = [stats.calibration(f"{prefix}{e}.w1.weight").tokens for e in range(3)]
    assert sum(visited) == 2 * 40 * 2 and min(visited) > 0  # every token reached two of experts 0-2
    gate, up = stats.calibration(f"{prefix}1.w1.weight"), stats.calibration(f"{prefix}1.w3.weight")
    assert torch.equal(gate.imatrix, up.imatrix) and gate.tokens == up.tokens  # they read the same rows
    lost = stats.calibration(f"{prefix}3.w2.weight")
    assert lost.tokens == 0 and torch.equal(lost.imatrix, torch.ones(64)) and torch.equal(lost.hessian, torch.eye(64))
    weight = torch.randn(64, 64)
    assert torch.equal(awq_search([weight], lost.inputs, lambda m: m.round()), torch.ones(64))


def test_the_weight_signal_prices_an_expert_by_what_the_layer_sees_of_it(tiny_model, tmp_path, calib_text):
    """A routed expert's cell in the weight signal is its squared output error weighted by each token's
    routing weight, over all the layer's tokens: the same sum computed by brute force from transformers'
    router choices and the layer's inputs (an expert nobody chooses would add nothing)."""
    from transformers import AutoTokenizer

    from cardfit.formats import get_format
    from cardfit.scan import scan
    from cardfit.text import load_text, token_chunks

    model_dir = tiny_model("qwen3-moe-sharp")
    result = scan(model_dir, calib_text, 256, "Q4_0", out=tmp_path / "m.json", seq_len=64, progress=False,
                  device="cpu", group_by="tensor", method="weight")
    stack = "model.layers.1.mlp.experts.up_proj.weight"
    cell = next(g for g in result["groups"] if g["name"] == stack)["cells"]["Q4_0"]["damage"]

    chunks = token_chunks(AutoTokenizer.from_pretrained(str(model_dir)), load_text(calib_text)[0], 64, 256)
    model, source, fmt = _hf(model_dir), open_model(model_dir), get_format("Q4_0")
    calls = []
    model.model.layers[1].mlp.experts.register_forward_hook(lambda m, args, out: calls.append(args))
    with torch.no_grad():
        model(chunks)
    expected = 0.0
    for hidden, chosen, weights in calls:
        for e in range(4):
            name = f"model.layers.1.mlp.experts.{e}.up_proj.weight"
            weight = source.read(name)
            error = (fmt.roundtrip(name, weight) - weight) ** 2  # (out, in)
            token, slot = (chosen == e).nonzero(as_tuple=True)
            x = hidden[token].to(torch.float64) * weights[token, slot, None].to(torch.float64)
            expected += float(((x * x) @ error.to(torch.float64).T).sum())
    expected /= chunks.numel()
    assert expected > 0 and cell == pytest.approx(expected, rel=1e-3)


def test_imatrix_per_expert_in_llama_cpps_layout_packs_and_runs(tiny_model, tmp_path, calib_text, run_cli):
    """`cardfit imatrix` writes a stack's statistics one row per expert with its own count (0 for an
    expert no token reached), as llama-imatrix does; pack rounds each expert with its own row, the
    GGUF's expert slices are exactly ggml's quantization with it, and llama.cpp runs the file."""
    import gguf
    import numpy as np

    from cardfit.formats import get_format
    from cardfit.formats import ggml_lib
    from cardfit.imatrix import ImatrixFile, collect_imatrix
    from cardfit.plan import uniform_recipe

    from test_pack_gguf import IDS, hf_logits, llama_cpp_logits, relative_error

    model_dir = tiny_model("qwen3-moe-sharp")
    source = open_model(model_dir)
    report = collect_imatrix(model_dir, calib_text, 256, 64, tmp_path / "im.gguf", "cpu", progress=False)
    assert report["unvisited"] == []
    fields = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(tmp_path / "im.gguf")).tensors}
    assert fields["blk.1.ffn_down_exps.weight.in_sum2"].shape == (4, 64)
    counts = fields["blk.1.ffn_down_exps.weight.counts"].reshape(-1)
    assert counts.sum() == 2 * report["tokens"] and (counts > 0).all()  # two experts per token
    assert fields["blk.1.attn_q.weight.counts"].reshape(-1).tolist() == [report["tokens"]]

    # an expert with no token: zeros, as llama-imatrix writes it; the reader weighs it equally and says so
    writer = gguf.GGUFWriter(str(tmp_path / "lost.gguf"), arch="imatrix")
    writer.kv_data[0].pop("general.architecture", None)
    writer.add_type(gguf.GGUFType.IMATRIX)
    for name, value in fields.items():
        value = value.copy()
        if name.startswith("blk.1.ffn_up_exps"):
            value[2] = 0
        writer.add_tensor(name, value)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    lost = ImatrixFile(tmp_path / "lost.gguf", source)
    assert lost.unvisited == ["model.layers.1.mlp.experts.2.up_proj.weight"]
    assert torch.equal(lost.means["model.layers.1.mlp.experts.2.up_proj.weight"], torch.ones(64))

    (tmp_path / "r.json").write_text(json.dumps(uniform_recipe(source, "Q4_0")))
    code, out, err = run_cli("pack", tmp_path / "r.json", "--model", model_dir, "--imatrix", tmp_path / "lost.gguf",
                             "--out", tmp_path / "m.gguf", "--no-smoke")
    assert code == 0, err
    assert "1 routed expert(s) saw no calibration token (model.layers.1.mlp expert 2)" in out
    packed = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "m.gguf")).tensors}["blk.1.ffn_up_exps.weight"]
    raw = np.asarray(packed.data).reshape(4, -1)
    for expert in (1, 2):
        name = f"model.layers.1.mlp.experts.{expert}.up_proj.weight"
        weight = source.read(name, dtype=torch.float32).numpy()
        assert np.array_equal(raw[expert].reshape(-1), ggml_lib.quantize("Q4_0", weight, lost.means[name].numpy()))
    rtn = ggml_lib.quantize("Q4_0", source.read("model.layers.1.mlp.experts.1.up_proj.weight", dtype=torch.float32).numpy(), None)
    assert not np.array_equal(raw[1].reshape(-1), rtn)  # the imatrix changed the rounding
    assert get_format("Q4_0").storage("model.layers.1.mlp.experts.1.up_proj.weight", (64, 64)) == "Q4_0"
    code, _, err = run_cli("pack", tmp_path / "r.json", "--model", model_dir, "--out", tmp_path / "rtn.gguf", "--no-smoke")
    assert code == 0, err
    reference = hf_logits(model_dir, IDS)
    errors = [relative_error(llama_cpp_logits(tmp_path / f, IDS), reference) for f in ("m.gguf", "rtn.gguf")]
    assert errors[0] < 1.2 * errors[1], errors  # llama.cpp computes it, and to Q4_0's error


def test_gpt_oss_as_llama_cpp_runs_it(tiny_model, tmp_path, run_cli):
    """gpt-oss's fused in x out stacks are read as llama.cpp's per-expert matrices (gate and up cut from
    interleaved columns; only an expert's block read), and its config as llama.cpp computes it: the real
    YaRN (truncate false) is packed with a warning saying llama.cpp rounds the ramp (and the logits move
    by about that), a SwiGLU or layer pattern llama.cpp does not compute is refused, and so is the MXFP4
    release format (cardfit re-rounds from 16-bit weights)."""
    from cardfit.pack import pack
    from cardfit.plan import uniform_recipe

    from test_pack_gguf import IDS, hf_logits, llama_cpp_logits, relative_error

    model_dir = tiny_model("gpt-oss-sharp")
    source = open_model(model_dir)
    names = {t.name: t.shape for t in source.tensors()}
    assert names["model.layers.0.mlp.experts.3.up_proj.weight"] == (64, 64)
    assert names["model.layers.0.mlp.experts.3.gate_proj.bias"] == (64,)
    assert not any(n.endswith("gate_up_proj") for n in names)
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        fused = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj")
    assert torch.equal(source.read("model.layers.0.mlp.experts.3.up_proj.weight", dtype=None), fused[3][:, 1::2].T)
    report = pack(uniform_recipe(source, "F16"), model_dir, tmp_path / "real.gguf", progress=False, smoke=False)
    assert any("YaRN" in w for w in report["warnings"])
    assert 0.003 < relative_error(llama_cpp_logits(tmp_path / "real.gguf", IDS), hf_logits(model_dir, IDS)) < 0.05
    config = json.loads((model_dir / "config.json").read_text())
    for change, says in (({"swiglu_limit": 9.0}, "SwiGLU"),
                         ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding window")):
        other = tmp_path / says.replace(" ", "-")
        other.mkdir()
        for file in model_dir.iterdir():
            (other / file.name).symlink_to(file)
        (other / "config.json").unlink()
        (other / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(CardfitError, match=says) as refused:
            pack(uniform_recipe(open_model(other), "F16"), other, tmp_path / "no.gguf", progress=False, smoke=False)
        assert not (tmp_path / "no.gguf").exists()
        assert "fused stacks" in str(refused.value)  # not sent on to compressed-tensors, which refuses it too
    from safetensors.torch import save_file

    (tmp_path / "SwiGLU" / "config.json").unlink()
    (tmp_path / "SwiGLU" / "config.json").symlink_to(model_dir / "config.json")
    save_file({"model.layers.0.mlp.experts.down_proj_blocks": torch.zeros(4, 64, 2, 16, dtype=torch.uint8)},
              str(tmp_path / "SwiGLU" / "mxfp4.safetensors"))
    code, _, err = run_cli("scan", tmp_path / "SwiGLU", "--out", tmp_path / "m.json")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "MXFP4" in errors[0] and not (tmp_path / "m.json").exists()


def test_deepseek_v2_scans_and_fit_refuses_its_gguf_before_the_scan(tiny_model, tmp_path, run_cli, calib_text):
    """DeepSeek-V2 (MLA, a shared expert, a dense first layer) streams and scans with its expert stacks as
    groups; llama.cpp's deepseek2 GGUF is not written yet, and fit says so before it scans."""
    from cardfit.scan import scan

    model_dir = tiny_model("deepseek-v2-sharp")
    result = scan(model_dir, calib_text, 256, "Q8_0,Q4_0", out=tmp_path / "m.json", seq_len=64, progress=False,
                  device="cpu", group_by="tensor")
    stack = next(g for g in result["groups"] if g["name"] == "model.layers.1.mlp.experts.gate_proj.weight")
    assert stack["cells"]["Q4_0"]["damage"] > stack["cells"]["Q8_0"]["damage"] > 0
    code, _, err = run_cli("fit", model_dir, "--vram", "1GiB", "--out", tmp_path / "run")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "deepseek_v2" in errors[0] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind, missing, says", [
    ("qwen3-moe-sharp", "model.layers.1.mlp.experts.3.up_proj.weight", "expert 3 of model.layers.1.mlp.experts.gate_up_proj"),
    ("gpt-oss-sharp", "model.layers.1.mlp.experts.down_proj_bias", "mlp.experts.down_proj_bias")])
def test_a_checkpoint_missing_an_expert_or_a_bias_is_refused(tiny_model, tmp_path, run_cli, kind, missing, says):
    """A fused stack with an unfilled expert slice, or a layer parameter the checkpoint does not hold, would
    compute with whatever memory held: one line, exit 2, no map."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model(kind), model_dir)
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors[missing]
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    code, _, err = run_cli("scan", model_dir, "--max-tokens", "128", "--seq-len", "64", "--out", tmp_path / "m.json")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and says in errors[0] and not (tmp_path / "m.json").exists(), err


def test_fit_groups_an_moe_model_per_tensor(tiny_model, tmp_path, monkeypatch):
    """fit's default grouping for an MoE model is per tensor (expert stacks apart from attention), per layer
    otherwise; the random model's perplexity is past the corpse ceiling, so the ceiling is lifted here."""
    import cardfit.check
    from cardfit.fit import fit

    monkeypatch.setattr(cardfit.check, "DEFAULT_CEILING", 1e9)
    model_dir = tiny_model("qwen3-moe-sharp")
    fit(model_dir, "1GiB", context=256, out=tmp_path / "run", formats="Q8_0,Q4_0", max_tokens=128, seq_len=64,
        progress=False, log=None, device="cpu")
    names = [g["name"] for g in json.loads((tmp_path / "run" / "sensitivity.json").read_text())["groups"]]
    assert "model.layers.0.mlp.experts.down_proj.weight" in names and "model.layers.0.self_attn.q_proj.weight" in names
    recipe = json.loads((tmp_path / "run" / "recipe.json").read_text())
    assert recipe["groups"] and (tmp_path / "run" / "model.gguf").exists()


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


def test_the_weight_signal_s_walk_records_each_expert_s_imatrix_row(tiny_model, tmp_path, calib_text):
    """scan --imatrix-out on a mixture of experts: the pricing walk's file is `cardfit imatrix`'s, a row and a
    count per expert."""
    import gguf
    import numpy as np

    from cardfit.imatrix import collect_imatrix
    from cardfit.scan import scan

    model_dir = tiny_model("qwen3-moe-sharp")
    collect_imatrix(model_dir, calib_text, 256, 64, tmp_path / "alone.gguf", "cpu", progress=False)
    scan(model_dir, calib_text, 256, "Q8_0,Q4_0", "tensor", tmp_path / "map.json", device="cpu", seq_len=64,
         progress=False, method="weight", rounding="imatrix", imatrix_out=tmp_path / "walk.gguf")
    want = {t.name: np.asarray(t.data).copy() for t in gguf.GGUFReader(str(tmp_path / "alone.gguf")).tensors}
    got = {t.name: np.asarray(t.data).copy() for t in gguf.GGUFReader(str(tmp_path / "walk.gguf")).tensors}
    assert sorted(got) == sorted(want) and got["blk.1.ffn_down_exps.weight.in_sum2"].shape == (4, 64)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)
