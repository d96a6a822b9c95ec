"""AWQ in a compressed-tensors checkpoint: scales folded into norms and rows (no extra tensor),
exact before rounding, and lower loss than RTN after it."""

from __future__ import annotations

import pytest
import torch

from cardfit.pack import pack
from cardfit.plan import uniform_recipe
from cardfit.sources import open_model


def _logits(model_dir, ids, overrides=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if overrides:
        state = model.state_dict()
        state.update({k: v.to(torch.float32) for k, v in overrides.items()})
        model.load_state_dict(state)
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("kind", ["llama-mha", "qwen2", "gemma3", "phi3"])
def test_the_fold_is_exact_before_rounding(tiny_model, kind, monkeypatch):
    """With random scales and no rounding, every layer's folded weights compute what the original
    computes: norms (Gemma's 1 + w), up rows (Phi-3's fused gate_up), v rows and bias (MHA, Qwen2)."""
    from cardfit.formats import Calibration, get_format
    from cardfit.pack import awq_fold

    model_dir = tiny_model(kind)
    source = open_model(model_dir)
    gen = torch.Generator().manual_seed(0)
    scales = []

    def random_scale(weights, inputs, rounder):
        s = torch.rand(weights[0].shape[1], generator=gen) * 3 + 0.25
        scales.append(s)
        return s

    monkeypatch.setattr(awq_fold, "awq_search", random_scale)
    fmt = get_format("W4A16-g32")
    overrides = {}
    for index in range(source.geometry.num_layers):
        tensors = source.groups()[f"layers.{index}"]
        weights = {t.name: source.read(t.name) for t in tensors}
        prefix = tensors[0].name.split(f"layers.{index}.")[0] + f"layers.{index}."
        calibration = {n: Calibration(inputs=torch.zeros(1, w.shape[-1])) for n, w in weights.items() if w.dim() == 2}
        formats = {n: fmt for n in weights}
        overrides.update(awq_fold.fold_layer(prefix, weights, calibration, formats, source.config,
                                             rounder=lambda name, f, m: m))
    assert len(scales) >= 3 * source.geometry.num_layers  # down, q/k/v and gate/up in every layer
    ids = torch.tensor([[504, 2365, 6354, 16438, 216, 33, 34, 35, 36, 37]])
    reference = _logits(model_dir, ids)
    folded = _logits(model_dir, ids, overrides)
    assert any(not torch.equal(overrides[n], source.read(n)) for n in overrides)
    torch.testing.assert_close(folded, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen2-moe-sharp", "mixtral-sharp"])
def test_the_fold_reaches_every_experts_down_and_is_exact(tiny_model, kind, monkeypatch):
    """In an MoE layer each routed expert's down (Mixtral's w2) and the shared expert's down take their own
    scale, folded into their own up (w3) rows; with no rounding the model computes what it did."""
    from cardfit.engine import Engine
    from cardfit.formats import Calibration, get_format
    from cardfit.groups import expert_stack
    from cardfit.pack import awq_fold

    source = open_model(tiny_model(kind))
    gen = torch.Generator().manual_seed(0)
    scaled = []

    def random_scale(weights, inputs, rounder):
        scaled.append(weights[0])
        return torch.rand(weights[0].shape[1], generator=gen) * 3 + 0.25

    monkeypatch.setattr(awq_fold, "awq_search", random_scale)
    fmt, overrides, downs = get_format("W4A16-g32"), {}, 0
    for index in range(source.geometry.num_layers):
        tensors = source.groups()[f"layers.{index}"]
        weights = {t.name: source.read(t.name) for t in tensors}
        prefix = tensors[0].name.split(f"layers.{index}.")[0] + f"layers.{index}."
        calibration = {n: Calibration(inputs=torch.zeros(1, w.shape[-1])) for n, w in weights.items() if w.dim() == 2}
        overrides.update(awq_fold.fold_layer(prefix, weights, calibration, {n: fmt for n in weights}, source.config,
                                             rounder=lambda name, f, m: m))
        downs += sum(1 for n in weights if n.endswith(("down_proj.weight", ".w2.weight")))
    # every down (no expert skipped), and q/k/v in each layer; the norm feeding router and experts is not scaled
    assert len(scaled) == downs + source.geometry.num_layers, (len(scaled), downs)
    assert any(not torch.equal(overrides[n], source.read(n)) for n in overrides if expert_stack(n))
    engine = Engine(source, "cpu", "float32")
    ids = torch.tensor([[504, 2365, 6354, 16438, 216, 33, 34, 35, 36, 37]])
    torch.testing.assert_close(engine.forward(ids, overrides), engine.forward(ids), rtol=1e-4, atol=1e-4)


def test_awq_packs_the_embedded_model_with_less_loss_than_rtn(default_model_dir, tmp_path):
    from cardfit.check import check

    recipe = uniform_recipe(open_model(default_model_dir), "W4A16-g128")
    results = {}
    for method in ("rtn", "awq"):
        out = tmp_path / method
        report = pack(recipe, default_model_dir, out, method=method, max_tokens=256, seq_len=256, progress=False)
        assert report["tensor_bytes"] == recipe["bytes"]  # folding adds no tensor
        results[method] = check(out, default_model_dir, max_tokens=512, seq_len=256)
    assert results["awq"]["verdict"] == "pass"
    assert results["awq"]["kld_mean"] < 0.9 * results["rtn"]["kld_mean"], results
