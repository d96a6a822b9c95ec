"""compare: every cardfit row is no larger than the llama.cpp preset it meets, and both are measured."""

import json


def test_compare_meets_each_preset_at_equal_bytes(tiny_model, tmp_path, calib_text):
    from cardfit.compare import compare
    from cardfit.scan import scan

    model_dir = tiny_model("llama-wide")
    text = calib_text
    scan(model_dir, text, max_tokens=256, formats="Q8_0,Q4_0,Q2_K", seq_len=32, out=tmp_path / "map.json",
         progress=False)
    result = compare(model_dir, tmp_path / "cmp", tmp_path / "map.json", ["Q8_0", "Q4_0"], text=text,
                     max_tokens=128, seq_len=32, log=None)
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"llama.cpp Q8_0", "cardfit <= Q8_0", "llama.cpp Q4_0", "cardfit <= Q4_0"}
    for preset in ("Q8_0", "Q4_0"):
        shelf, mine = rows[f"llama.cpp {preset}"], rows[f"cardfit <= {preset}"]
        assert mine["bytes"] <= shelf["bytes"]
        assert mine["kld_reduction"] == 1 - mine["kld_mean"] / shelf["kld_mean"]
        assert (tmp_path / "cmp" / f"shelf-{preset}.gguf").stat().st_size == shelf["bytes"]
    assert rows["llama.cpp Q4_0"]["kld_mean"] > rows["llama.cpp Q8_0"]["kld_mean"]  # measured, not assumed
    on_disk = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert on_disk["rows"] == json.loads(json.dumps(result["rows"]))
    assert "| cardfit <= Q4_0 |" in (tmp_path / "cmp" / "compare.md").read_text()
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 10_000
