"""Difference form (difference.py): a track's layer as the reference's float32 intermediates plus bfloat16
products of its change; faithful where whole bfloat16 layers are not, refused where it cannot be checked."""

import json

import pytest
import torch

from cardfit.engine.difference import DifferenceLayer, unsupported
from cardfit.engine import DIFFERENCES, Engine, Track, resolve_compute
from cardfit.errors import CardfitError
from cardfit.groups import GroupId
from cardfit.sources import open_model


def _inputs(engine, seed=0, n=2, length=24):
    ids = torch.randint(0, 1000, (n, length), generator=torch.Generator().manual_seed(seed))
    track = Track(engine.embed([ids]))
    engine.walk([track], end=1)
    return track.hidden[0]


def _layer_output(layer, h, kwargs):
    out = layer(h, **kwargs)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_small_change_survives_difference_form_and_not_bfloat16_layers(tiny_models, kind):
    """A change of 1e-3 of the hidden state (a Q8_0 cell's size) through one layer: difference form gets the
    layer's change within bfloat16's rounding of the *change* (< 1 %, against float64), while the same layer
    run whole in bfloat16 loses it (its error is of the order of the change itself). The reference pass
    reproduces the layer's own float32 output."""
    engine = Engine(open_model(tiny_models[kind], run=True), "cpu", "float32")
    stream = engine.stream
    h = _inputs(engine)
    change = 1e-3 * h.abs().mean() * torch.randn(h.shape, generator=torch.Generator().manual_seed(1))
    kwargs = stream.layer_kwargs(h.shape[0], h.shape[1])[1]
    with stream.resident(GroupId.layer_group(1)):
        layer = stream.layers[1]
        assert unsupported(layer) is None
        form = DifferenceLayer(layer)
        ref = form.reference(h, kwargs)
        own = _layer_output(layer, h, kwargs)
        assert float((ref.out - own).abs().max() / own.abs().max()) <= 1e-5
        moved = form.forward(ref, h + change, kwargs)
        layer64 = layer.double()
        kwargs64 = {**kwargs, "position_embeddings": tuple(t.double() for t in kwargs["position_embeddings"])}
        truth = _layer_output(layer64, (h + change).double(), kwargs64) - _layer_output(layer64, h.double(), kwargs64)
        layer.bfloat16()
        kwargs16 = {**kwargs, "position_embeddings": tuple(t.bfloat16() for t in kwargs["position_embeddings"])}
        whole16 = (_layer_output(layer, (h + change).bfloat16(), kwargs16).double()
                   - _layer_output(layer, h.bfloat16(), kwargs16).double())
        layer.float()
    error = float(((moved - ref.out).double() - truth).norm() / truth.norm())
    assert error < 1e-2
    assert float((whole16 - truth).norm() / truth.norm()) > 20 * error
    engine.close()


def test_auto_is_differences_only_where_bfloat16_is_fast(monkeypatch):
    from cardfit.engine import difference

    cpu = torch.device("cpu")
    monkeypatch.setattr(difference, "fast_bfloat16", lambda device: True)
    assert resolve_compute("auto", cpu) == DIFFERENCES
    assert resolve_compute("float32", cpu) == "float32"  # the opt-out: whole float32 layers
    monkeypatch.setattr(difference, "fast_bfloat16", lambda device: False)
    assert resolve_compute("auto", cpu) == "float32"
    assert resolve_compute(DIFFERENCES, cpu) == DIFFERENCES  # asked for, it is used (slower, same numbers)
    with pytest.raises(CardfitError, match="bfloat16-differences"):
        resolve_compute("half", cpu)


def _scan(model, out, calib_text, **kw):
    from cardfit.scan import scan

    common = dict(max_tokens=96, formats="Q8_0,Q2_K", seq_len=32, progress=False, device="cpu")
    return scan(str(model), str(calib_text), out=out, **{**common, **kw})


def _walks(model, log):
    """A track (layer 0's MLP halved) walked whole and walked against the reference, on one engine."""
    engine = Engine(open_model(model, run=True), "cpu", DIFFERENCES, log=log)
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    base = Track(engine.embed([ids]))
    cached = {}
    engine.walk([base], before_layer=lambda i, active: cached.__setitem__(i, active[0].hidden[0]))
    cached[engine.layers] = base.hidden[0]
    name = "model.layers.0.mlp.down_proj.weight"
    overrides = {name: engine.stream.source.read(name) * 0.5}
    whole = engine.walk([Track([cached[0]], 0, overrides)])[0].hidden[0]
    differing = engine.walk([Track([cached[0]], 0, overrides)], reference=lambda i, b: cached[i])[0].hidden[0]
    engine.close()
    return whole, differing


def test_layers_that_cannot_be_checked_run_whole_in_float32(tiny_models, monkeypatch):
    """A layer form difference.py does not write out (Gemma 3's), or a reference pass that does not
    reproduce the layer's own output (here: a tolerance nothing meets), runs the tracks whole in float32,
    the same bits as without a reference, and says so once; a checked Llama layer runs in difference form."""
    from cardfit.engine import difference

    lines = []
    whole, differing = _walks(tiny_models["llama"], lines.append)
    assert not torch.equal(whole, differing) and torch.allclose(whole, differing, rtol=1e-2, atol=1e-3)
    assert not any("float32" in line for line in lines[1:]), lines
    for kind, said in (("gemma3", "is not a Llama-form layer"), ("llama", "off its own output")):
        if kind == "llama":
            monkeypatch.setattr(difference, "CHECK_TOLERANCE", -1.0)
        lines = []
        whole, differing = _walks(tiny_models[kind], lines.append)
        assert torch.equal(whole, differing)
        assert sum(said in line for line in lines) == 1, lines


def test_difference_maps_are_the_same_bits_whatever_walks_them(tiny_models, tmp_path, calib_text, monkeypatch):
    """An exact scan in difference form walks its layer groups in rounds (measure.walk_windows); a cell's bits do
    not depend on which tracks share its walk: one round per layer and one round for all give the same map.
    It reads layers fewer times than a walk per group, and stays within 1 % and two standard errors of the
    float32 map (the Q8_0 cells of these random models are ~1e-7 nats, near float32's own noise)."""
    from cardfit.scan import measure
    from cardfit import scan as scan_module

    maps, loads = {}, {}
    for windows in (1, 100):
        monkeypatch.setattr(measure, "WINDOWS", windows)
        lines = []
        maps[windows] = _scan(tiny_models["qwen2"], tmp_path / f"w{windows}.json", calib_text, dtype=DIFFERENCES,
                              log=lines.append)
        loads[windows] = next(line for line in lines if line.startswith("read decoder layers"))
    assert (tmp_path / "w1.json").read_bytes() == (tmp_path / "w100.json").read_bytes()
    assert loads[1] != loads[100]
    f32 = _scan(tiny_models["qwen2"], tmp_path / "f32.json", calib_text, dtype="float32")
    for a, b in zip(f32["groups"], maps[1]["groups"]):
        for name, cell in a["cells"].items():
            assert abs(b["cells"][name]["damage"] - cell["damage"]) <= 0.01 * cell["damage"] + 2 * cell["stderr"], (a["name"], name)


def test_a_map_is_resumed_only_in_the_compute_it_was_begun_in(tiny_models, tmp_path, calib_text):
    out = tmp_path / "map.json"
    _scan(tiny_models["llama"], out, calib_text, dtype="float32")
    with pytest.raises(CardfitError, match="another model, text or settings"):
        _scan(tiny_models["llama"], out, calib_text, dtype=DIFFERENCES, resume=True)
    old = json.loads(out.read_text())
    del old["compute"]  # a map from before the key: it was float32
    old["complete"] = False
    out.write_text(json.dumps(old))
    assert _scan(tiny_models["llama"], out, calib_text, dtype="float32", resume=True)["compute"] == "float32"



def test_the_map_schema_knows_every_compute():
    """A map's `compute` is one of the engine's `--dtype` values (less auto, which a map records resolved)."""
    from typing import get_args

    from cardfit.engine import DTYPES
    from cardfit.schemas import SensitivityMap

    assert set(get_args(SensitivityMap.model_fields["compute"].annotation)) == set(DTYPES) - {"auto"}
