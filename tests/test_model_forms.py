"""Every command that takes a model takes every form README names — a model directory, a .gguf, a
cached hub id (of a directory or of a GGUF repo), the default — and gives the same answer for each.

The GGUF here is the tiny Llama packed at F16 by cardfit itself, so its weights are the directory's
exactly: priced from its header it must cost what the directory costs, and run (converted once to
an f16 directory in the cache) it must measure what the directory measures.
"""

import contextlib
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest

from cardfit.cli import main

FORMS = ("directory", "gguf", "hub", "hub-gguf")
HUB_DIR = "cardfit-forms/tiny-llama"
HUB_GGUF = "cardfit-forms/tiny-llama-gguf"
REVISION = "0123456789abcdef0123456789abcdef01234567"
SCAN = ("--max-tokens", "64", "--seq-len", "32")


def _snapshot(cache: Path, repo_id: str, files) -> None:
    """A repo as `huggingface-cli download` leaves it in the hub cache: snapshot links into blobs (a
    GGUF blob is a hard link to the file, which is what a download of the same bytes would hold)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, file in enumerate(files):
        blob = repo / "blobs" / f"blob{i}"
        if file.suffix == ".gguf":
            os.link(file, blob)
        else:
            shutil.copy(file, blob)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)


@contextlib.contextmanager
def _env(world):
    """This module's cardfit cache (conversions land there) and hub cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CARDFIT_CACHE", str(world.cache))
        mp.setenv("HF_HUB_CACHE", str(world.hub))
        mp.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(world.hub))
        yield


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_models, default_model_dir):
    from cardfit.pack import pack
    from cardfit.plan import uniform_recipe
    from cardfit.sources import open_model
    from cardfit.text import load_text

    root = tmp_path_factory.mktemp("forms")
    cache = root / "cardfit-cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / default_model_dir.name).symlink_to(default_model_dir, target_is_directory=True)
    directory = tiny_models["llama"]
    gguf_file = root / "tiny-llama.gguf"
    pack(uniform_recipe(open_model(directory), "F16"), directory, gguf_file, progress=False, smoke=False)
    hub = root / "hub"
    _snapshot(hub, HUB_DIR, sorted(p for p in directory.iterdir() if p.is_file()))
    _snapshot(hub, HUB_GGUF, [gguf_file])
    calib = root / "calib.txt"
    calib.write_text(load_text(None)[0][:20000], encoding="utf-8")
    return SimpleNamespace(root=root, cache=cache, hub=hub, calib=calib, gguf=gguf_file, directory=directory,
                           forms={"directory": str(directory), "gguf": str(gguf_file), "hub": HUB_DIR,
                                  "hub-gguf": HUB_GGUF})


@pytest.fixture(autouse=True)
def _isolated(world):
    with _env(world):
        yield


@pytest.fixture(scope="module")
def maps(world):
    """`cardfit scan FORM` for every form, once."""
    out = {}
    with _env(world):
        for form, spec in world.forms.items():
            path = world.root / f"map-{form}.json"
            assert main(["scan", spec, "--calibration", str(world.calib), *SCAN, "--formats", "Q8_0,Q4_0",
                         "--out", str(path)]) == 0
            out[form] = json.loads(path.read_text())
            out[form]["path"] = path
    return out


def _json(run_cli, *args) -> dict:
    code, out, err = run_cli(*args)
    assert code == 0, err
    return json.loads(out)


def _gguf_tensor_bytes(path) -> int:
    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)


def _converted(world) -> Path:
    from cardfit.sources import open_model

    return open_model(world.gguf, run=True).path


# -- pricing: from headers, no conversion ---------------------------------------------------------------

@pytest.mark.parametrize("runtime", ["llama.cpp", "vllm"])
def test_budget_is_the_same_for_every_form(run_cli, world, runtime):
    specs = {**world.forms, "config.json": str(world.directory / "config.json")}
    answers = {form: _json(run_cli, "budget", "--vram", "8GiB", "--context", "512", "--runtime", runtime,
                           "--model", spec, "--json") for form, spec in specs.items()}
    stored = {form: a["sizes"].pop("stored_bytes") for form, a in answers.items()}
    for form, answer in answers.items():
        assert answer == answers["directory"], form
    sizes = answers["gguf"]["sizes"]["uniform_bytes"]
    # The reported bug: from a .gguf, W8A16 and W4A16 came out at the F16 size (nothing quantized).
    assert sizes["W4A16-g128"] < sizes["W8A16"] < sizes["F16"]
    # As stored is what each holds: the directory's f16 shards, the GGUF's tensor data (its 1-D norms in F32).
    assert stored["directory"] == stored["hub"] == stored["config.json"]
    assert stored["gguf"] == stored["hub-gguf"] == _gguf_tensor_bytes(world.gguf) > stored["directory"]


def test_budget_of_the_default_model_equals_its_packaged_gguf(run_cli):
    from cardfit.default_model import default_gguf

    base = ("budget", "--vram", "1GiB", "--context", "2048", "--json")
    answers = [_json(run_cli, *base), _json(run_cli, *base, "--model", "default"),
               _json(run_cli, *base, "--model", default_gguf())]
    stored = [a["sizes"].pop("stored_bytes") for a in answers]
    assert answers[0] == answers[1] == answers[2]
    assert stored[0] == stored[1] > stored[2]  # the f16 reference, and the Q4_1 file it was made from


def test_sizes_are_the_same_for_every_form(run_cli, world):
    answers = {form: _json(run_cli, "sizes", spec, "--json") for form, spec in world.forms.items()}
    for answer in answers.values():
        answer.pop("stored_bytes")
    assert all(answer == answers["directory"] for answer in answers.values())


@pytest.mark.parametrize("kind", ["qwen3", "mistral", "phi3-longrope", "gemma3-llamacpp"])
def test_a_gguf_prices_as_its_directory(tiny_model, tmp_path, kind):
    """Across architectures: Qwen 3's head size (the header's key_length, which transformers' mapping
    drops), Mistral as llama.cpp runs it (no sliding window), Phi-3's fused matrices and its longrope
    factors (the converter's, not weights), Gemma 3's sliding layers and tied head."""
    from cardfit.budget import budget
    from cardfit.pack import pack
    from cardfit.plan import uniform_recipe
    from cardfit.sources import open_model

    model_dir = tiny_model(kind)
    path = tmp_path / f"{kind}.gguf"
    pack(uniform_recipe(open_model(model_dir), "F16"), model_dir, path, progress=False, smoke=False)
    for runtime in ("llama.cpp", "vllm"):
        a = budget(model_dir, "8GiB", 4096, runtime=runtime).to_dict()
        b = budget(path, "8GiB", 4096, runtime=runtime).to_dict()
        a["sizes"].pop("stored_bytes"), b["sizes"].pop("stored_bytes")
        assert a == b, runtime


# -- running: a .gguf is converted once, then runs as its directory does ---------------------------------

def test_scan_gives_the_same_map_for_every_form(world, maps):
    from cardfit.sources import open_model

    reference = maps["directory"]
    for form, data in maps.items():
        assert [(g["name"], g["bytes"]) for g in data["groups"]] == [(g["name"], g["bytes"]) for g in reference["groups"]]
        for group, expected in zip(data["groups"], reference["groups"]):
            for fmt, cell in group["cells"].items():
                assert cell["damage"] == pytest.approx(expected["cells"][fmt]["damage"], rel=1e-3, abs=1e-7), (form, group["name"])
        assert data["calibration"] == reference["calibration"]  # the same tokens, from the same tokenizer
    # The model identity maps record: the hub copy is the directory; the hub GGUF and the converted
    # directory are the .gguf (a map of one serves the other).
    assert maps["hub"]["model"]["fingerprint"] == reference["model"]["fingerprint"]
    fingerprint = maps["gguf"]["model"]["fingerprint"]
    assert maps["hub-gguf"]["model"]["fingerprint"] == fingerprint
    assert open_model(_converted(world)).fingerprint() == fingerprint


def test_plan_and_pack_take_every_form(run_cli, world, maps, tmp_path):
    recipes, packed = {}, {}
    for form, spec in world.forms.items():
        recipe = tmp_path / f"recipe-{form}.json"
        code, _, err = run_cli("plan", maps[form]["path"], "--model", spec, "--weight-budget", "64MiB",
                               "--out", recipe)
        assert code == 0, err
        recipes[form] = json.loads(recipe.read_text())
        packed[form] = _json(run_cli, "pack", recipe, "--model", spec, "--out", tmp_path / f"{form}.gguf",
                             "--no-smoke", "--json")
        assert (tmp_path / f"{form}.gguf").stat().st_size == packed[form]["file_bytes"]
    shape = {form: [(g["name"], g["format"], g["bytes"]) for g in r["groups"]] for form, r in recipes.items()}
    assert all(s == shape["directory"] for s in shape.values())
    assert len({p["tensor_bytes"] for p in packed.values()}) == 1
    # The .gguf's map serves its hub copy and its converted directory; the directory's map is another model's.
    for spec in (HUB_GGUF, str(_converted(world))):
        code, _, err = run_cli("plan", maps["gguf"]["path"], "--model", spec, "--weight-budget", "64MiB",
                               "--out", tmp_path / "again.json")
        assert code == 0, err
    code, _, err = run_cli("plan", maps["directory"]["path"], "--model", world.forms["gguf"], "--weight-budget",
                           "64MiB", "--out", tmp_path / "other.json")
    assert code == 2 and "scanned on another model" in err


def test_imatrix_is_the_same_for_every_form(run_cli, world, tmp_path):
    import numpy as np

    values = {}
    for form, spec in world.forms.items():
        out = tmp_path / f"imatrix-{form}.gguf"
        code, _, err = run_cli("imatrix", spec, "--calibration", world.calib, *SCAN, "--out", out)
        assert code == 0, err
        values[form] = {t.name: np.array(t.data, dtype=np.float64) for t in gguf.GGUFReader(str(out)).tensors}
    for form, tensors in values.items():
        assert tensors.keys() == values["directory"].keys()
        for name, v in tensors.items():
            assert np.allclose(v, values["directory"][name], rtol=1e-3, atol=1e-6), (form, name)


def test_check_takes_every_form_as_reference(run_cli, world, tmp_path):
    from cardfit.pack import pack
    from cardfit.plan import uniform_recipe
    from cardfit.sources import open_model

    artifact = tmp_path / "q8.gguf"
    pack(uniform_recipe(open_model(world.directory), "Q8_0"), world.directory, artifact, progress=False, smoke=False)
    reports = {}
    for form, spec in world.forms.items():
        out = tmp_path / f"check-{form}.json"
        code, _, err = run_cli("check", artifact, "--reference", spec, "--text", world.calib, *SCAN,
                               "--ceiling", "1e12", "--min-top1", "0", "--out", out)
        assert code == 0, err
        reports[form] = json.loads(out.read_text())
    for form, report in reports.items():
        assert report["tokens"] == reports["directory"]["tokens"]
        for key in ("kld_mean", "reference_perplexity", "perplexity", "top1"):
            assert report[key] == pytest.approx(reports["directory"][key], rel=1e-3), (form, key)


def test_refine_takes_every_form(run_cli, world, maps, tmp_path):
    groups = maps["directory"]["groups"]
    low, high = (sum(min(g["bytes"].values()) for g in groups), sum(max(g["bytes"].values()) for g in groups))
    budget = str((low + high) // 2 + 4 * 2**20)  # between all-Q4_0 and all-Q8_0, header reserved
    refined = {}
    for form, spec in world.forms.items():
        recipe, out = tmp_path / f"recipe-{form}.json", tmp_path / f"refined-{form}.json"
        code, _, err = run_cli("plan", maps[form]["path"], "--model", spec, "--weight-budget", budget, "--out", recipe)
        assert code == 0, err
        code, _, err = run_cli("refine", recipe, "--map", maps[form]["path"], "--model", spec, "--calibration",
                               world.calib, "--top", "1", "--max-tokens", "64", "--out", out)
        assert code == 0, err
        refined[form] = json.loads(out.read_text())["refinement"]
    for form, record in refined.items():
        assert record["measured_before"] == pytest.approx(refined["directory"]["measured_before"], rel=1e-3), form


@pytest.fixture(scope="module")
def fits(world, tmp_path_factory):
    """`fit` of one form, run once: the directory's is every other form's expected answer."""
    import sys

    import cardfit.check  # noqa: F401 (the package exports the function `check` under the module's name)
    from cardfit.fit import fit

    done = {}

    def run(form: str) -> dict:
        if form not in done:
            with _env(world), pytest.MonkeyPatch.context() as mp:
                mp.setattr(sys.modules["cardfit.check"], "DEFAULT_CEILING", 1e12)  # random weights: nothing to smoke
                done[form] = fit(world.forms[form], "2GiB", 256, formats="Q8_0,Q4_0",
                                 out=tmp_path_factory.mktemp(f"fit-{form}"), calibration=world.calib, max_tokens=64,
                                 seq_len=32, progress=False, log=None)
        return done[form]

    return run


@pytest.mark.parametrize("form", FORMS)
def test_fit_takes_every_form(fits, form):
    summary = fits(form)
    assert Path(summary["artifact"]).stat().st_size == summary["pack"]["file_bytes"]
    recipe = [(g["name"], g["format"], g["bytes"]) for g in summary["recipe"]["groups"]]
    assert recipe == [(g["name"], g["format"], g["bytes"]) for g in fits("directory")["recipe"]["groups"]]
    assert summary["budget"]["weight_budget_bytes"] == fits("directory")["budget"]["weight_budget_bytes"]


@pytest.mark.parametrize("form", FORMS)
def test_compare_takes_every_form(world, maps, tmp_path, form):
    from cardfit.compare import compare

    result = compare(world.forms[form], tmp_path / "cmp", maps[form]["path"], ["Q8_0"], text=world.calib,
                     max_tokens=64, seq_len=32, scan_tokens=64, progress=False, log=None, baselines=[], speed=False)
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"llama.cpp F16 (runtime floor)", "llama.cpp Q8_0", "uniform body + embed/head <= Q8_0",
                         "weight-error allocator <= Q8_0", "cardfit <= Q8_0"}
    assert all(r["kld_mean"] >= 0 for r in rows.values())


def test_a_gguf_is_converted_once_per_content(world, tmp_path, capsys, monkeypatch):
    """Found again by content: a copy under another name reuses the conversion, a changed file does not."""
    from cardfit.sources import open_model
    from cardfit.sources.gguf_file import converted_dir

    made = []

    class Converter:  # the conversion itself runs in `maps`; here only when it runs
        def __init__(self, path):
            self.path = path

        def materialize(self, out_dir):
            from cardfit.sources.gguf_file import _write_manifest

            made.append(self.path.name)
            shutil.copytree(world.directory, out_dir)
            _write_manifest(out_dir)  # what the real conversion writes last: the mark of a whole one
            return out_dir

    monkeypatch.setattr("cardfit.sources.gguf_file.GgufSource", Converter)
    changed = tmp_path / "changed.gguf"
    shutil.copy(world.gguf, changed)
    with open(changed, "ab") as fh:  # other bytes (past the tensor data, so still a readable GGUF)
        fh.write(b"\0" * 64)
    assert converted_dir(changed) != converted_dir(world.gguf)
    first = open_model(changed, run=True).path
    assert made == ["changed.gguf"]
    assert capsys.readouterr().err.count("converting changed.gguf") == 1
    twin = tmp_path / "twin.gguf"
    shutil.copy(changed, twin)
    assert open_model(changed, run=True).path == open_model(twin, run=True).path == first
    assert made == ["changed.gguf"] and "converting" not in capsys.readouterr().err
    with open(twin, "r+b") as fh:  # edited in place, same size: converted again
        fh.seek(-1, os.SEEK_END)
        fh.write(b"\1")
    assert open_model(twin, run=True).path != first and made == ["changed.gguf", "twin.gguf"]


# -- what transformers cannot read is one line, not a traceback ---------------------------------------------

def test_a_gguf_of_an_architecture_transformers_cannot_read_is_one_clean_error(run_cli, tmp_path):
    import numpy as np

    path = tmp_path / "exotic.gguf"
    writer = gguf.GGUFWriter(str(path), "cardfit-exotic")
    writer.add_block_count(1)
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((8, 8), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for args in (("budget", "--vram", "1GiB", "--model", path), ("sizes", path), ("scan", path, "--out", tmp_path / "m.json"),
                 ("fit", path, "--vram", "1GiB", "--out", tmp_path / "fit")):
        code, out, err = run_cli(*args)
        assert code == 2, args
        assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
        assert "exotic.gguf" in err


def test_a_gguf_transformers_cannot_convert_is_one_clean_error(run_cli, world, tmp_path, monkeypatch):
    import transformers

    def refuse(*args, **kwargs):
        raise ValueError("no such architecture here")

    copy = tmp_path / "unconvertible.gguf"
    shutil.copy(world.gguf, copy)
    with open(copy, "ab") as fh:  # other content, so nothing cached serves it
        fh.write(b"\0" * 32)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    code, _, err = run_cli("scan", copy, "--calibration", world.calib, *SCAN, "--out", tmp_path / "m.json")
    assert code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("error: transformers cannot convert unconvertible.gguf")
    assert not list((world.cache / "gguf").glob("unconvertible-*"))  # no half-made directory left behind


@pytest.mark.slow
def test_the_packaged_default_gguf_runs_as_the_default_model():
    """The default model is its packaged Q4_1 GGUF converted to f16: named directly, the .gguf is the
    same model (a map of one serves the other)."""
    from cardfit.default_model import default_gguf
    from cardfit.sources import open_model

    assert open_model(default_gguf()).fingerprint() == open_model("default").fingerprint()
