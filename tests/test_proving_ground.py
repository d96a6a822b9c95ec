"""The proving ground: fit the real Qwen2.5-Coder-1.5B (standard widths, k-quants without fallbacks)
at a ceiling that squeezes it between uniform Q3_K and Q4_K, and check the GGUF in llama.cpp.

It runs only where the model was fetched (`cardfit models get qwen2.5-coder-1.5b`, 1.1 GB; CI does
not download it) and takes about an hour on 2 CPU cores, hence small scan and check token counts."""

import json

import pytest

from cardfit.catalog import CATALOG

MODEL = "qwen2.5-coder-1.5b"


@pytest.mark.slow
def test_fit_squeezes_the_real_1_5b_between_q3_k_and_q4_k(tmp_path):
    if not CATALOG[MODEL].path().is_file():
        pytest.skip(f"{MODEL} is not fetched: run `cardfit models get {MODEL}` (or scripts/get-models.sh)")
    from cardfit.budget import budget
    from cardfit.fit import fit

    vram, context = "1.75GiB", 8192
    ceiling = budget(MODEL, vram, context)
    sizes = ceiling.sizes["uniform_bytes"]
    weight_budget = ceiling.weight_budget_bytes
    assert sizes["Q3_K"] < weight_budget < sizes["Q4_K"]  # the squeeze the test is about
    out = tmp_path / "fit"
    fit(MODEL, vram, context, out=out, max_tokens=128, seq_len=128, full_check=True, check_tokens=256,
        progress=False, log=None)  # raises when the check fails
    recipe = json.loads((out / "recipe.json").read_text())
    checked = json.loads((out / "check.json").read_text())
    size = (out / "model.gguf").stat().st_size
    assert weight_budget * 0.99 <= size <= weight_budget  # the whole file, within 1 % under the budget
    assert len({g["format"] for g in recipe["groups"] if g["name"].startswith("layers.")}) >= 2
    assert checked["runtime"] == "llama.cpp" and checked["verdict"] == "pass"
