"""fit: the whole job on the embedded model, end to end, and a rerun that skips finished stages."""

import json


def test_fit_leaves_every_artifact(embedded_fit):
    out, summary = embedded_fit
    for name in ("sensitivity.json", "recipe.json", "model.gguf", "report.md", "sensitivity.png", "frontier.png",
                 "frontier.json", "check.json", "fit.json"):
        assert (out / name).exists(), name
    from PIL import Image

    for name in ("sensitivity.png", "frontier.png"):
        with Image.open(out / name) as image:
            assert image.width > 300 and image.height > 300
            assert len(image.convert("RGB").getcolors(maxcolors=10**6)) > 50  # a real picture, not a blank canvas
    report = (out / "report.md").read_text()
    assert "## Budget" in report and "## Check" in report and "| layers.11 |" in report


def test_fit_artifact_fits_loads_generates_and_passes_check(embedded_fit):
    from cardfit.runtimes import load_llama

    out, summary = embedded_fit
    recipe = summary["recipe"]
    budget = recipe["budget"]["weight_budget_bytes"]
    assert (out / "model.gguf").stat().st_size <= budget
    packed = summary["pack"]
    assert packed["tensor_bytes"] == recipe["bytes"]  # the file holds exactly the planned tensors
    assert packed["file_bytes"] - packed["tensor_bytes"] <= recipe["reserved_bytes"]  # plus what plan reserved
    # Bytes left under the budget could not have bought less damage: no group has a less-damaging format
    # that the margin would pay for (on this model the source's own grid, Q4_1, is the least-damaging
    # format of every layer, so the optimum may leave bytes unused rather than move off it).
    cells = {g["name"]: g for g in json.loads((out / "sensitivity.json").read_text())["groups"]}
    margin = budget - packed["file_bytes"]
    for g in recipe["groups"]:
        entry = cells[g["name"]]
        chosen = entry["cells"][g["format"]]["damage"]
        assert all(entry["bytes"][f] - g["bytes"] > margin for f, c in entry["cells"].items() if c["damage"] < chosen)
    assert len({g["format"] for g in recipe["groups"]}) > 1  # the ceiling squeezes: the solver had to decide
    assert recipe["uniform_bytes"]["Q2_K"] < recipe["bytes"] < recipe["uniform_bytes"]["Q8_0"]
    assert summary["check"]["verdict"] == "pass"
    assert summary["check"]["kld_mean"] < 0.5
    llm = load_llama(out / "model.gguf", n_ctx=128, verbose=False)
    text = llm("The capital of France is", max_tokens=6, temperature=0)["choices"][0]["text"]
    assert "Paris" in text


def test_rerun_skips_finished_stages(embedded_fit, monkeypatch):
    import importlib

    from cardfit.runner import StreamedModel

    fit_module = importlib.import_module("cardfit.fit")
    pack_module = importlib.import_module("cardfit.pack")

    out, summary = embedded_fit
    before = (out / "model.gguf").stat().st_mtime_ns

    def no(*args, **kwargs):
        raise AssertionError("a finished stage ran again")

    monkeypatch.setattr(pack_module, "pack", no)
    monkeypatch.setattr(StreamedModel, "__init__", no)  # neither the scan nor a check builds a model
    again = fit_module.fit(out=out, max_tokens=512, seq_len=256, full_check=True, check_tokens=1024, progress=False,
                           log=None)
    assert (out / "model.gguf").stat().st_mtime_ns == before
    assert again["recipe"] == summary["recipe"]
    assert json.loads((out / "fit.json").read_text())["check"]["verdict"] == "pass"


def test_fit_needs_vram_for_your_own_model(tiny_models, run_cli):
    code, _, err = run_cli("fit", tiny_models["llama"])
    assert code == 2 and "--vram" in err


def test_fit_refine_writes_the_refined_recipe_and_reuses_it(embedded_fit, tmp_path):
    """On a copy of the fit run, at a longer context (the default one fits the source's own grid, with
    nothing left to refine): the adaptive map measures what the new budget decides, then plan, refine,
    pack the refined recipe; a rerun reuses both."""
    import shutil

    from cardfit.fit import fit

    out = tmp_path / "run"
    shutil.copytree(embedded_fit[0], out)
    said = []
    kwargs = dict(max_tokens=512, seq_len=256, progress=False, refine=True, refine_tokens=512, log=said.append,
                  context=8192 + 512)
    first = fit(out=out, **kwargs)
    saved = json.loads((out / "recipe.json").read_text())
    record = saved["refinement"]
    assert record["calibration_tokens"] == 512 and saved == json.loads(json.dumps(first["recipe"]))
    assert record["measured_after"] <= record["measured_before"] and record["savings"]
    assert saved["bytes"] + saved["reserved_bytes"] <= saved["budget"]["weight_budget_bytes"]
    assert first["pack"]["file_bytes"] <= saved["budget"]["weight_budget_bytes"]
    assert json.loads((out / "fit.json").read_text())["refined_from"].startswith("sha256:")
    said.clear()
    again = fit(out=out, **kwargs)
    assert any("already measured; reused" in str(line) for line in said)
    assert any("already packed from this recipe" in str(line) for line in said)
    assert again["recipe"] == first["recipe"]


def test_fit_scans_the_sources_own_types_beside_the_default_menu(tiny_model):
    """The embedded model stores its layers as Q4_1: re-quantizing onto that grid costs ~0, so fit's exact
    menu carries it; an f16 model adds nothing; the adaptive menu is the target's whole menu."""
    from cardfit.fit import scan_menu
    from cardfit.sources import open_model, runnable
    from cardfit.targets import get_target

    target = get_target("llama.cpp")
    embedded = runnable(open_model(None))  # as fit opens it: the f16 conversion, knowing the GGUF it came from
    assert scan_menu(target, embedded, 10**12) == target.default_scan_formats + ",Q4_1"  # Q8_0 already on it
    assert scan_menu(target, open_model(tiny_model("llama-wide")), 10**12) == target.default_scan_formats
    assert scan_menu(target, embedded, 10**12, "adaptive") == target.whole_menu
    assert "Q4_1" in target.whole_menu.split(",") and "Q5_1" in target.whole_menu.split(",")
