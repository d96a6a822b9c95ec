"""fit: the whole job on the embedded model, end to end, and a rerun that skips finished stages."""

import json
from pathlib import Path

import pytest

from cardfit.errors import CardfitError


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
    from cardfit.targets.runtimes import load_llama

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

    from cardfit.engine.streamed import StreamedModel

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


def _file_size(source, format_name):
    from cardfit.formats import get_format
    from cardfit.pack import reserve_bytes
    from cardfit.sizes import priced_tensors

    fmt = get_format(format_name)
    return reserve_bytes(source, "llama.cpp") + sum(fmt.tensor_bytes(t.name, t.shape) for t in priced_tensors(source))


@pytest.fixture()
def unsmoked(monkeypatch):
    """pack without its smoke check: a random model's perplexity is its vocabulary's size, over the ceiling."""
    import functools

    from cardfit import pack as pack_module

    monkeypatch.setattr(pack_module, "pack", functools.partial(pack_module.pack, smoke=False))
    return pack_module


def _tiny_sizes(tiny_models) -> tuple:
    """The tiny Llama and two whole-file sizes between its uniform Q4_0 and Q8_0 GGUFs."""
    from cardfit.sources import open_model, runnable

    model = tiny_models["llama"]
    source = runnable(open_model(model))
    low, high = _file_size(source, "Q4_0"), _file_size(source, "Q8_0")
    return model, [low + (high - low) // 4, low + 3 * (high - low) // 4]


def test_fit_size_packs_the_best_file_no_larger_than_each_size_from_one_scan(tiny_models, tmp_path, unsmoked):
    """`fit --size A,B`: one map decided at both sizes, then per size its own directory whose GGUF (the whole
    file) is no larger than the size; the larger size buys no more damage; the report names the file size.
    (A random model's perplexity is its vocabulary's size: the smoke check's ceiling is not for it.)"""
    from cardfit.fit import fit

    model, sizes = _tiny_sizes(tiny_models)
    out = tmp_path / "run"
    summary = fit(model, sizes=f"{sizes[0]},{sizes[1]}", out=out, max_tokens=128, seq_len=32, progress=False,
                  log=None, device="cpu")
    runs = summary["sizes"]
    assert [r["size_bytes"] for r in runs] == sorted(sizes, reverse=True)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [f"size-{s}" for s in sorted(sizes)]
    scanned = json.loads((out / "sensitivity.json").read_text())
    assert scanned["adaptive"]["weight_budgets"] == sorted(sizes, reverse=True)
    for run in runs:
        gguf = Path(run["artifact"])
        assert gguf.parent == Path(run["out"]) and gguf.stat().st_size <= run["size_bytes"]
        assert run["pack"]["file_bytes"] == gguf.stat().st_size
        assert "| file size |" in (gguf.parent / "report.md").read_text()
        assert not (gguf.parent / "sensitivity.json").exists()  # one map, at the top
    assert runs[0]["recipe"]["predicted_damage"] <= runs[1]["recipe"]["predicted_damage"]
    assert runs[0]["recipe"]["bytes"] > runs[1]["recipe"]["bytes"]


def test_fit_size_refuses_a_second_budget_or_a_bad_size_before_any_work(tiny_models, tmp_path, run_cli):
    out = tmp_path / "run"
    for args, said in ((["--size", "100MB", "--vram", "1GiB"], "--size and --vram"),
                       (["--size", ""], "empty value"), (["--size", "1MB,,2MB"], "names no size"),
                       (["--size", "1MB,1MB"], "twice"), (["--size", "1MB,1000KB"], "twice"),
                       (["--size", "lots"], "--size")):
        code, _, err = run_cli("fit", tiny_models["llama"], "--out", out, *args)
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, (args, err)
        assert not out.exists()


def test_fit_refuses_a_size_no_recipe_reaches_before_the_scan(tiny_models, tmp_path, run_cli):
    out = tmp_path / "run"
    code, _, err = run_cli("fit", tiny_models["llama"], "--out", out, "--size", "2KB")
    assert code == 2 and "minimum achievable is" in err and not out.exists()


def test_size_labels_keep_what_the_user_wrote_and_refuse_nothing_sizes():
    from cardfit.errors import CardfitError
    from cardfit.fit import parse_sizes

    assert parse_sizes("1e-3GB, 900MB") == [("size-900MB", 900 * 10**6), ("size-1e-3GB", 10**6)]
    for bad in ("0", "0.4", "1e-12GB"):
        try:
            parse_sizes(bad)
        except CardfitError as error:
            assert "under one byte" in str(error)
        else:
            raise AssertionError(bad)


def test_fit_refuses_a_rounding_its_artifact_does_not_take_before_the_scan(tiny_models, tmp_path, run_cli):
    """`fit --method gptq` for a GGUF was refused by pack after the scan, leaving the scan's files."""
    out = tmp_path / "run"
    code, _, err = run_cli("fit", tiny_models["llama"], "--vram", "1GiB", "--method", "gptq", "--out", out)
    assert code == 2 and "--method gptq does not apply to gguf" in err and not out.exists(), err


def test_a_fit_that_fails_before_writing_anything_leaves_no_directory(tiny_models, tmp_path, run_cli):
    """The scan refuses a text shorter than one chunk after the output directory is made: the directory (and
    the parents this run made) go again, since nothing was written in them."""
    text = tmp_path / "short.txt"
    text.write_text("a few words only", encoding="utf-8")
    out = tmp_path / "new" / "run"
    code, _, err = run_cli("fit", tiny_models["llama"], "--vram", "1GiB", "--calibration", text, "--out", out)
    assert code == 2 and "fewer than one chunk" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["short.txt"]


def test_fit_with_an_imatrix_scans_and_packs_every_size_with_the_scan_s_own(tiny_models, tmp_path, monkeypatch,
                                                                          unsmoked):
    """`fit --method imatrix --size A,B`: the map measures imatrix rounding, the pricing walk leaves
    DIR/imatrix.gguf, and both sizes are packed with it: no other calibration walk runs."""
    from cardfit import imatrix as imatrix_module
    from cardfit.fit import fit
    from cardfit.imatrix import job_key, made_from

    def no_walk(*args, **kwargs):
        raise AssertionError("a second calibration walk")

    monkeypatch.setattr(unsmoked, "_calibration", no_walk)
    monkeypatch.setattr(imatrix_module, "collect_imatrix", no_walk)
    model, sizes = _tiny_sizes(tiny_models)
    out = tmp_path / "run"
    summary = fit(model, sizes=f"{sizes[0]},{sizes[1]}", out=out, max_tokens=128, seq_len=32, progress=False,
                  log=None, device="cpu", method="imatrix", formats="Q8_0,Q4_0,IQ4_XS,Q2_K")
    scanned = json.loads((out / "sensitivity.json").read_text())
    assert scanned["rounding"] == "imatrix"
    assert made_from(out / "imatrix.gguf", job_key(scanned["model"], scanned["calibration"]))
    assert [r["pack"]["method"] for r in summary["sizes"]] == ["imatrix", "imatrix"]


def test_fit_resumes_a_map_with_the_rounding_it_was_begun_with(tiny_models, tmp_path, unsmoked):
    """A directory scanned with RTN rerun with --method imatrix: the map resumes as it was begun (not refused
    as another job), and the imatrix every artifact is packed with is made by a walk of its own."""
    from cardfit.fit import fit

    model, (size, _) = _tiny_sizes(tiny_models)
    out = tmp_path / "run"
    said = []
    kwargs = dict(sizes=str(size), out=out, max_tokens=128, seq_len=32, progress=False, device="cpu",
                  formats="Q8_0,Q4_0")
    fit(model, log=None, **kwargs)
    summary = fit(model, log=said.append, method="imatrix", **kwargs)
    assert json.loads((out / "sensitivity.json").read_text())["rounding"] == "rtn"
    assert any("begun with rtn rounding" in line for line in said)
    assert (out / "imatrix.gguf").is_file() and summary["sizes"][0]["pack"]["method"] == "imatrix"


def test_fit_owns_its_imatrix_file(tiny_models, tmp_path, unsmoked):
    """Junk at DIR/imatrix.gguf is fit's own output name: replaced; an imatrix of this job whose values were
    damaged, or another job's with no map beside it, is made again rather than packed with; a directory there is
    refused before any work."""
    import gguf

    from cardfit.fit import fit
    from cardfit.imatrix import job_key, made_from

    model, (size, _) = _tiny_sizes(tiny_models)
    out = tmp_path / "run"
    kwargs = dict(sizes=str(size), out=out, max_tokens=128, seq_len=32, progress=False, device="cpu",
                  formats="Q8_0,Q4_0", method="imatrix", log=None)
    out.mkdir()
    (out / "imatrix.gguf").write_bytes(b"junk")
    fit(model, **kwargs)
    scanned = json.loads((out / "sensitivity.json").read_text())
    job = job_key(scanned["model"], scanned["calibration"])
    assert made_from(out / "imatrix.gguf", job)
    reader = gguf.GGUFReader(str(out / "imatrix.gguf"), "r+")
    reader.tensors[0].data[...] = float("nan")  # the header still names this job
    del reader
    assert not made_from(out / "imatrix.gguf", job)
    fit(model, **kwargs)
    assert made_from(out / "imatrix.gguf", job)
    fit(model, **{**kwargs, "out": tmp_path / "other", "max_tokens": 64})  # another job's imatrix, and no map
    (out / "imatrix.gguf").write_bytes((tmp_path / "other" / "imatrix.gguf").read_bytes())
    (out / "sensitivity.json").unlink()
    fit(model, **kwargs)
    assert made_from(out / "imatrix.gguf", job)
    (out / "imatrix.gguf").unlink()
    (out / "imatrix.gguf").mkdir()
    with pytest.raises(CardfitError, match="is a directory, where fit writes its importance matrix"):
        fit(model, **kwargs)


def test_fit_scan_method_fast_plans_on_the_fisher_alone(tiny_models, tmp_path, monkeypatch, unsmoked):
    """`fit --scan-method fast --method imatrix --size A,B`: the whole menu priced by the Fisher under imatrix
    rounding, no cell measured, the walk's imatrix packs both sizes, each file no larger than its size; a rerun
    keeps the map as begun."""
    from cardfit.scan import measure
    from cardfit.fit import fit

    def no_measuring(*args, **kwargs):
        raise AssertionError("a cell measured")

    monkeypatch.setattr(measure, "measure_round", no_measuring)
    monkeypatch.setattr(measure.Scanner, "reference", no_measuring)
    model, sizes = _tiny_sizes(tiny_models)
    out = tmp_path / "run"
    kwargs = dict(sizes=f"{sizes[0]},{sizes[1]}", out=out, max_tokens=128, seq_len=32, progress=False, device="cpu",
                  method="imatrix", formats="Q8_0,Q4_0,IQ4_XS,Q2_K")
    summary = fit(model, log=None, scan_method="fast", **kwargs)
    scanned = json.loads((out / "sensitivity.json").read_text())
    assert scanned["damage"]["method"].startswith("fast") and scanned["rounding"] == "imatrix"
    assert scanned["group_by"] == "tensor"  # fast scans per tensor unless told otherwise
    assert (out / "imatrix.gguf").is_file()
    assert [r["pack"]["method"] for r in summary["sizes"]] == ["imatrix", "imatrix"]
    assert all(row["pack"]["file_bytes"] <= row["size_bytes"] for row in summary["sizes"])
    report = (Path(summary["sizes"][0]["out"]) / "report.md").read_text()
    assert "no cell was measured" in report and "| ~" in report
    said = []
    fit(model, log=said.append, **kwargs)  # no --scan-method: resumed as begun
    assert any("== 2. scan (fast" in line for line in said)
