"""refine: whole-recipe measurements agree with a plain forward, and a refined recipe never measures worse."""

import json

import pytest
import torch


def _plain_kl(model_dir, chunks, assignment, data):
    """The recipe measured the simple way: every quantized tensor held at once, whole-model forwards."""
    from cardfit.engine.evaluate import measure
    from cardfit.formats import get_format
    from cardfit.engine import Engine
    from cardfit.sources import open_model

    source = open_model(model_dir)
    overrides = {}
    for g in data["groups"]:
        fmt = get_format(assignment[g["name"]])
        for name in g["tensors"]:
            weight = source.read(name)
            if weight.dim() >= 2:
                overrides[name] = fmt.roundtrip(name, weight, None, "rtn")
    return measure(Engine(source, "cpu"), chunks, overrides).kl


@pytest.fixture
def planned(tiny_model, tmp_path, calib_text):
    from cardfit.plan import plan
    from cardfit.scan import scan

    model_dir = tiny_model("llama")
    data = scan(model_dir, calib_text, max_tokens=256, formats="Q8_0,Q4_0,Q2_K", seq_len=32,
                out=tmp_path / "map.json", progress=False)
    sizes = [sum(g["bytes"][f] for g in data["groups"]) for f in data["formats"]]
    recipe = plan(tmp_path / "map.json", (min(sizes) + max(sizes)) // 2)
    return model_dir, data, recipe


def test_refine_measures_whole_recipes_exactly_and_never_returns_a_worse_one(planned, calib_text):
    from transformers import AutoTokenizer

    from cardfit.refine import refine
    from cardfit.text import load_text, token_chunks

    model_dir, data, recipe = planned
    refined = refine(recipe, data, model_dir, calib_text, top=4)
    record = refined["refinement"]
    text, _ = load_text(calib_text)
    chunks = token_chunks(AutoTokenizer.from_pretrained(str(model_dir)), text, 32, 256)
    before = {g["name"]: g["format"] for g in recipe["groups"]}
    assert record["measured_before"] == pytest.approx(_plain_kl(model_dir, chunks, before, data), rel=1e-4)
    assert 0 < len(record["savings"]) <= 4
    name, saving = next(iter(record["savings"].items()))
    restored = dict(before, **{name: saving["restored_to"]})
    assert saving["in_context"] == pytest.approx(
        record["measured_before"] - _plain_kl(model_dir, chunks, restored, data), rel=1e-3, abs=1e-7)
    cells = next(g for g in data["groups"] if g["name"] == name)["cells"]
    assert saving["alone"] == pytest.approx(cells[before[name]]["damage"] - cells[saving["restored_to"]]["damage"])
    assert record["measured_after"] <= record["measured_before"]
    after = {g["name"]: g["format"] for g in refined["groups"]}
    assert record["measured_after"] == pytest.approx(_plain_kl(model_dir, chunks, after, data), rel=1e-4)
    assert refined["bytes"] + refined["reserved_bytes"] <= refined["budget"]["weight_budget_bytes"]
    assert record["kept"] == (after != before)
    assert refined["map"]["sha256"] == recipe["map"]["sha256"]


def test_refine_refuses_another_maps_recipe_or_text(planned, calib_text, tmp_path):
    from cardfit.errors import CardfitError
    from cardfit.refine import refine

    model_dir, data, recipe = planned
    other = json.loads(json.dumps(data))
    other["groups"][0]["cells"]["Q8_0"]["damage"] += 1e-3
    with pytest.raises(CardfitError, match="not planned from this map"):
        refine(recipe, other, model_dir, calib_text)
    wrong = tmp_path / "other.txt"
    wrong.write_text(calib_text.read_text()[:-100], encoding="utf-8")
    with pytest.raises(CardfitError, match="not the text the map was scanned on"):
        refine(recipe, data, model_dir, wrong)


def test_refine_cli_writes_the_record_and_refuses_a_foreign_recipe(planned, calib_text, tmp_path, run_cli):
    model_dir, data, recipe = planned
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    code, out, err = run_cli("refine", tmp_path / "recipe.json", "--map", tmp_path / "map.json", "--model", model_dir,
                             "--calibration", calib_text, "--top", "2", "--out", tmp_path / "refined.json")
    assert code == 0, err
    refined = json.loads((tmp_path / "refined.json").read_text())
    assert len(refined["refinement"]["savings"]) <= 2 and "whole-recipe KLD" in out
    other = json.loads(json.dumps(data))
    other["groups"][0]["cells"]["Q8_0"]["damage"] += 1e-3
    (tmp_path / "other.json").write_text(json.dumps(other))
    code, _, err = run_cli("refine", tmp_path / "recipe.json", "--map", tmp_path / "other.json", "--model", model_dir,
                           "--out", tmp_path / "again.json")
    assert code == 2 and "not planned from this map" in err and not (tmp_path / "again.json").exists()
