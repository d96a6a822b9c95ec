"""The low-bit ladder: i-quants scanned, planned, packed and run, with the imatrix they cannot round without."""

import copy
import json

import gguf
import pytest

from cardfit.formats import get_format
from cardfit.pack import pack
from cardfit.plan import plan, uniform_recipe
from cardfit.scan import scan
from cardfit.sources import open_model

LADDER = "Q4_K,IQ3_XXS,IQ2_XXS,IQ1_S"


@pytest.fixture(scope="module")
def ladder_map(tiny_model, tmp_path_factory, ):
    from cardfit.text import load_text

    model = tiny_model("qwen2-256")
    out = tmp_path_factory.mktemp("ladder")
    (out / "calib.txt").write_text(load_text(None)[0][:20000], encoding="utf-8")
    scan(model, out / "calib.txt", max_tokens=512, formats=LADDER, seq_len=64, out=out / "map.json", progress=False)
    return model, out


def test_rtn_scan_measures_the_imatrix_types_with_an_imatrix_and_fewer_bits_hurt_more(ladder_map):
    """RTN is asked, but IQ2_XXS/IQ1_S cannot round without an imatrix: the scan collects one for them
    (no ggml abort) and every layer's damage grows down the ladder."""
    _, out = ladder_map
    sensitivity = json.loads((out / "map.json").read_text())
    assert sensitivity["rounding"] == "rtn" and sensitivity["complete"]
    for group in sensitivity["groups"]:
        if group["name"].startswith("layers."):
            damage = [group["cells"][f]["damage"] for f in LADDER.split(",")]
            assert damage == sorted(damage) and damage[0] > 0, (group["name"], damage)


def test_a_planned_i_quant_mix_packs_exactly_and_runs_in_llama_cpp(ladder_map, tmp_path):
    """A budget only the ladder's lower rungs reach: the plan mixes i-quants; pack (RTN asked) collects the
    imatrix itself, writes exactly the planned types and bytes, and llama.cpp loads and runs the file."""
    from cardfit.pack import reserve_bytes

    model, out = ladder_map
    source = open_model(model)
    reserve = reserve_bytes(source, "llama.cpp")
    groups = json.loads((out / "map.json").read_text())["groups"]
    q4 = sum(g["bytes"]["Q4_K"] for g in groups)
    iq2 = sum(g["bytes"]["IQ2_XXS"] for g in groups)
    recipe = plan(out / "map.json", reserve + (q4 + iq2) // 2, reserve_bytes=reserve)
    chosen = {g["format"] for g in recipe["groups"]}
    assert chosen & {"IQ3_XXS", "IQ2_XXS", "IQ1_S"}, chosen
    report = pack(recipe, model, tmp_path / "mix.gguf", progress=False, smoke=True, calibration=out / "calib.txt",
                  max_tokens=512, seq_len=64, ceiling=1e9)
    assert report["tensor_bytes"] == recipe["bytes"] and report["smoke"]["perplexity"] > 0
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "mix.gguf")).tensors}
    for g in recipe["groups"]:
        if g["name"].startswith("layers."):
            i = g["name"].split(".")[1]
            assert types[f"blk.{i}.ffn_down.weight"] == g["format"]


@pytest.fixture(scope="module")
def embedded_i_quant_mix(default_model_dir, tmp_path_factory):
    """The embedded model with its layers on the ladder's rungs in turn (its 1536-wide ffn_down is the
    tensor llama.cpp can store in an i-quant; 576-wide rows take IQ4_NL, as llama.cpp does)."""
    source = open_model(default_model_dir)
    rungs = ["IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ4_XS", "Q4_K"]
    uniform = {r: uniform_recipe(source, r) for r in rungs + ["Q8_0"]}
    recipe = copy.deepcopy(uniform["Q8_0"])
    layer = 0
    for i, group in enumerate(recipe["groups"]):
        if group["name"].startswith("layers."):
            recipe["groups"][i] = dict(uniform[rungs[layer % len(rungs)]]["groups"][i])
            layer += 1
    recipe["bytes"] = sum(g["bytes"] for g in recipe["groups"])
    recipe["uniform_bytes"] = {}
    recipe["budget"]["weight_budget_bytes"] = recipe["bytes"] * 2
    recipe["margin_bytes"] = recipe["bytes"]
    out = tmp_path_factory.mktemp("iq-mix") / "mix.gguf"
    pack(recipe, default_model_dir, out, progress=False, max_tokens=512, seq_len=256)
    return out, recipe


def test_the_mixed_i_quant_gguf_passes_check_in_llama_cpp(embedded_i_quant_mix, default_model_dir):
    from cardfit.check import check

    out, recipe = embedded_i_quant_mix
    stored = {t.tensor_type.name for t in gguf.GGUFReader(str(out)).tensors}
    assert {"IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS"} <= stored
    report = check(out, default_model_dir, max_tokens=512, seq_len=256)
    assert report["verdict"] == "pass", report["reasons"]
    assert 0 < report["kld_mean"] < 1.0


def test_the_planner_floor_reaches_below_two_bits(tiny_model):
    """budget and plan know the ladder: the smallest llama.cpp recipe is the IQ1_S one, under 2 bits/weight."""
    from cardfit.sizes import minimum_bytes, priced_tensors

    source = open_model(tiny_model("qwen2-256"))
    params = sum(t.numel for t in priced_tensors(source) if len(t.shape) == 2)
    floor = minimum_bytes(source, "llama.cpp")
    assert floor * 8 / params < 2.0
    assert floor < sum(get_format("Q2_K").tensor_bytes(t.name, t.shape) for t in priced_tensors(source))


def test_fit_scans_the_ladder_only_when_the_budget_is_below_the_default_menus_floor(tiny_model):
    from cardfit.fit import scan_menu
    from cardfit.sizes import priced_tensors
    from cardfit.targets import get_target

    target = get_target("llama.cpp")
    source = open_model(tiny_model("qwen2-256"))
    q2 = sum(get_format("Q2_K").tensor_bytes(t.name, t.shape) for t in priced_tensors(source))
    assert scan_menu(target, source, q2) == target.default_scan_formats
    low = scan_menu(target, source, q2 - 1)
    assert low.startswith(target.default_scan_formats + ",") and "IQ2_XXS" in low


def test_an_imatrix_file_missing_a_tensor_an_i_quant_needs_is_refused_before_writing(ladder_map, tmp_path):
    import numpy as np

    from cardfit.errors import CardfitError
    from cardfit.imatrix import collect_imatrix

    model, out = ladder_map
    whole = tmp_path / "imatrix.gguf"
    collect_imatrix(model, out / "calib.txt", max_tokens=256, seq_len=64, out=whole, progress=False)
    reader = gguf.GGUFReader(str(whole))
    partial = tmp_path / "partial.gguf"
    writer = gguf.GGUFWriter(str(partial), arch="imatrix")
    writer.kv_data[0].pop("general.architecture", None)
    writer.add_type(gguf.GGUFType.IMATRIX)
    for t in reader.tensors:
        if not t.name.startswith("blk.1.attn_q."):
            writer.add_tensor(t.name, np.asarray(t.data).reshape(1, -1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    recipe = uniform_recipe(open_model(model), "IQ2_XXS")
    before = partial.read_bytes()
    with pytest.raises(CardfitError, match="no entry for blk.1.attn_q"):
        pack(recipe, model, tmp_path / "out.gguf", progress=False, imatrix=partial)
    assert not (tmp_path / "out.gguf").exists() and partial.read_bytes() == before
    report = pack(recipe, model, tmp_path / "out.gguf", progress=False, imatrix=whole, smoke=False)
    assert report["tensor_bytes"] == recipe["bytes"]


def test_per_tensor_groups_plan_and_pack_the_ladder(ladder_map, tmp_path):
    """--group-by tensor at i-quant sizes: every matrix its own cell (each with its own imatrix), the plan
    mixes types inside a layer, and pack writes exactly that."""
    from cardfit.pack import reserve_bytes

    model, out = ladder_map
    scan(model, out / "calib.txt", max_tokens=256, formats="Q4_K,IQ2_XXS", group_by="tensor", seq_len=64,
         out=tmp_path / "map.json", progress=False)
    groups = json.loads((tmp_path / "map.json").read_text())["groups"]
    assert any(g["name"].endswith("down_proj.weight") and g["cells"]["IQ2_XXS"]["damage"] > 0 for g in groups)
    reserve = reserve_bytes(open_model(model), "llama.cpp")
    # the embedding at IQ2_XXS, the matrices halfway between Q4_K and IQ2_XXS: they must mix
    matrices = [g for g in groups if g["name"] != "embed"]
    embed = next(g for g in groups if g["name"] == "embed")
    budget = (reserve + embed["bytes"]["IQ2_XXS"]
              + sum(g["bytes"]["Q4_K"] + g["bytes"]["IQ2_XXS"] for g in matrices) // 2)
    recipe = plan(tmp_path / "map.json", budget, reserve_bytes=reserve)
    report = pack(recipe, model, tmp_path / "mix.gguf", progress=False, smoke=False, calibration=out / "calib.txt",
                  max_tokens=512)
    assert report["tensor_bytes"] == recipe["bytes"]
    from cardfit.imatrix import gguf_tensor_names

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "mix.gguf")).tensors}
    names = gguf_tensor_names(open_model(model))
    per_tensor = [g for g in recipe["groups"] if g["name"] in names]
    assert per_tensor and all(types[names[g["name"]]] == g["format"] for g in per_tensor)
    assert {"Q4_K", "IQ2_XXS"} <= {g["format"] for g in per_tensor}


@pytest.mark.parametrize("layer_of", [lambda n: n + 7, lambda n: None if n == 1 else n])  # deeper; a layer short
def test_an_imatrix_of_another_depth_is_refused(ladder_map, tmp_path, layer_of):
    """An imatrix made for a model with more or fewer layers: refused before writing, not used for the layers
    it happens to share."""
    import re

    import numpy as np

    from cardfit.errors import CardfitError
    from cardfit.imatrix import collect_imatrix

    model, out = ladder_map
    whole = tmp_path / "imatrix.gguf"
    collect_imatrix(model, out / "calib.txt", max_tokens=256, seq_len=64, out=whole, progress=False)
    other = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(other), arch="imatrix")
    writer.kv_data[0].pop("general.architecture", None)
    writer.add_type(gguf.GGUFType.IMATRIX)
    for t in gguf.GGUFReader(str(whole)).tensors:
        found = re.match(r"blk\.(\d+)\.(.*)", t.name)
        moved = layer_of(int(found.group(1))) if found else None
        if found and moved is None:
            continue
        writer.add_tensor(f"blk.{moved}.{found.group(2)}" if found else t.name, np.asarray(t.data).reshape(1, -1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CardfitError, match="it was made for another model"):
        pack(uniform_recipe(open_model(model), "Q4_0"), model, tmp_path / "out.gguf", progress=False, imatrix=other)
    assert not (tmp_path / "out.gguf").exists()
