"""compare: every cardfit row is no larger than the shelf row it meets, and every row is measured."""

import json

import gguf
import numpy as np


def test_compare_meets_each_preset_and_baseline_at_equal_bytes(tiny_model, tmp_path, calib_text):
    from cardfit.compare import compare
    from cardfit.formats import get_format
    from cardfit.scan import scan
    from cardfit.sources import open_model

    model_dir = tiny_model("llama-wide")
    text = calib_text
    scan(model_dir, text, max_tokens=256, formats="Q8_0,Q4_0,Q2_K", seq_len=32, out=tmp_path / "map.json",
         progress=False)
    result = compare(model_dir, tmp_path / "cmp", tmp_path / "map.json", ["Q8_0", "Q4_0"], text=text,
                     max_tokens=128, seq_len=32, scan_tokens=64, log=None, baselines=["rtn", "gptq", "nf4"],
                     speed=False)
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"llama.cpp F16 (runtime floor)", "llama.cpp Q8_0", "cardfit <= Q8_0", "llama.cpp Q4_0",
                         "cardfit <= Q4_0", "uniform body + embed/head <= Q8_0", "uniform body + embed/head <= Q4_0",
                         "weight-error allocator <= Q8_0", "weight-error allocator <= Q4_0",
                         "W4A16-g128 RTN", "W4A16-g128 GPTQ", "cardfit <= W4A16-g128",
                         "bitsandbytes NF4", "cardfit <= NF4"}
    for preset in ("Q8_0", "Q4_0"):
        shelf, mine = rows[f"llama.cpp {preset}"], rows[f"cardfit <= {preset}"]
        assert mine["bytes"] <= shelf["bytes"]
        assert mine["against"] == shelf["name"]
        assert mine["kld_reduction"] == 1 - mine["kld_mean"] / shelf["kld_mean"]
        assert (tmp_path / "cmp" / f"shelf-{preset}.gguf").stat().st_size == shelf["bytes"]
        # The smarter shelf row: one body format, one embedding/head format, searched over the map.
        simple = rows[f"uniform body + embed/head <= {preset}"]
        body = {f for g, f in simple["formats"].items() if g.startswith("layers.")}
        assert len(body) == 1 and simple["formats"]["embed"] == simple["formats"].get("lm_head", simple["formats"]["embed"])
        assert simple["bytes"] <= shelf["bytes"] and simple["kind"] == "uniform-body"
        assert mine["predicted_damage"] <= simple["predicted_damage"] + 1e-12  # an optimum over a superset
        assert mine["kld_vs_uniform_body"] == 1 - mine["kld_mean"] / simple["kld_mean"]
        # The weight-error allocator: the weight-signal map's optimum over the same formats, measured too.
        allocator = rows[f"weight-error allocator <= {preset}"]
        assert allocator["kind"] == "weight-allocator" and allocator["bytes"] <= shelf["bytes"]
        assert mine["kld_vs_weight_allocator"] == 1 - mine["kld_mean"] / allocator["kld_mean"]
    assert rows["llama.cpp Q4_0"]["kld_mean"] > rows["llama.cpp Q8_0"]["kld_mean"]  # measured, not assumed
    # Beside every recipe, what the source stores each group as (this tiny model: its own safetensors dtype).
    dtypes = {t.dtype for t in open_model(model_dir).tensors() if t.group == "layers.0" and len(t.shape) == 2}
    assert result["source_types"]["layers.0"] == sorted(dtypes)
    assert rows["llama.cpp F16 (runtime floor)"]["kld_mean"] < rows["llama.cpp Q8_0"]["kld_mean"]

    # Uniform W4A16: real checkpoints measured in transformers; cardfit meets the best of them at the size.
    rtn, gptq, mine = rows["W4A16-g128 RTN"], rows["W4A16-g128 GPTQ"], rows["cardfit <= W4A16-g128"]
    assert rtn["runtime"] == gptq["runtime"] == "transformers"
    assert rtn["bytes"] == gptq["bytes"] == sum(f.stat().st_size for f in (tmp_path / "cmp" / "w4a16-rtn").glob("*.safetensors"))
    assert rtn["kld_mean"] != gptq["kld_mean"]  # two roundings, two measurements
    best = min((rtn, gptq), key=lambda r: r["kld_mean"])
    assert mine["against"] == best["name"] and mine["bytes"] <= rtn["bytes"]
    assert mine["kld_reduction"] == 1 - mine["kld_mean"] / best["kld_mean"]

    # NF4: bitsandbytes itself quantizes at load; bytes are its storage (4-bit codes + fp32 absmax per 64).
    nf4 = rows["bitsandbytes NF4"]
    assert nf4["runtime"].startswith("transformers + bitsandbytes")
    source = open_model(model_dir)
    assert nf4["bytes"] == sum(get_format("NF4").tensor_bytes(t.name, t.shape) for t in source.tensors())
    assert 0 < nf4["kld_mean"] and rows["cardfit <= NF4"]["bytes"] <= nf4["bytes"]

    on_disk = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert on_disk["rows"] == json.loads(json.dumps(result["rows"]))
    table = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| cardfit <= Q4_0 | llama.cpp |" in table and "vs W4A16-g128" in table
    assert "| group | source type |" in table and "vs the best uniform body" in table
    assert "vs the weight-error allocator" in table
    weight_map = json.loads((tmp_path / "cmp" / "weight-map.json").read_text())
    assert weight_map["formats"] == ["Q8_0", "Q4_0", "Q2_K"] and weight_map["damage"]["method"].startswith("weight")
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 10_000


def test_compare_with_imatrix_rounds_both_sides_and_measures_speed(tiny_model, tmp_path, calib_text):
    from cardfit.compare import compare
    from cardfit.maps import read_map
    from cardfit.targets.shelf import llama_quantize

    model_dir = tiny_model("llama-wide")
    out = tmp_path / "cmp"
    result = compare(model_dir, out, None, ["Q4_0"], text=calib_text, max_tokens=128, seq_len=32, scan_tokens=128,
                     progress=False, log=None, imatrix=True, baselines=[])
    from cardfit.targets import for_artifact

    scanned = read_map(out / "sensitivity-imatrix.json")
    assert scanned["rounding"] == "imatrix"
    assert scanned["formats"] == for_artifact("gguf").whole_menu.split(",")  # every type, the own grid included
    assert result["rounding"] == "imatrix" and (out / "compare-imatrix.md").exists()
    # The preset was quantized with the imatrix: same types and sizes as plain Q4_0, different rounding.
    plain = llama_quantize(out / "f16.gguf", tmp_path / "plain.gguf", "Q4_0")
    weighted = {t.name: t for t in gguf.GGUFReader(str(out / "shelf-imatrix-Q4_0.gguf")).tensors}
    differs = 0
    for t in gguf.GGUFReader(str(plain)).tensors:
        assert weighted[t.name].tensor_type == t.tensor_type
        differs += not np.array_equal(np.asarray(weighted[t.name].data), np.asarray(t.data))
    assert differs > 0
    for row in result["rows"]:
        assert row["gen_tokens_per_s"] > 0 and row["speed_runtime"] == "llama.cpp"
