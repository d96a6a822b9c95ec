"""Reliability: every row of docs/reliability.md — bad input, faults, security, determinism."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cardfit.errors import CardfitError
from cardfit.plan import uniform_recipe
from cardfit.sources import open_model

# -- inputs -------------------------------------------------------------------------------------------


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_truncated_safetensors(tiny_models, tmp_path, run_cli):
    model = copy_model(tiny_models["llama"], tmp_path / "m")
    shard = model / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    code, _, err = run_cli("sizes", model)
    assert code == 2 and "truncated" in err and "Traceback" not in err


def test_corrupt_safetensors_header(tiny_models, tmp_path, run_cli):
    model = copy_model(tiny_models["llama"], tmp_path / "m")
    (model / "model.safetensors").write_bytes(b"\xff" * 64)
    code, _, err = run_cli("sizes", model)
    assert code == 2 and "not a readable safetensors file" in err


def test_index_naming_a_missing_shard(tiny_sharded, tmp_path, run_cli):
    model = copy_model(tiny_sharded, tmp_path / "m")
    index = json.loads((model / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (model / first).unlink()
    code, _, err = run_cli("sizes", model)
    assert code == 2 and "missing" in err and first in err


def test_gguf_with_a_type_gguf_py_cannot_read(tmp_path, run_cli):
    code, _, err = run_cli("sizes", tmp_path / "nothing.gguf")
    assert code == 2 and "no GGUF file" in err
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF" + b"\x00" * 60)
    code, _, err = run_cli("sizes", bogus)
    assert code == 2 and "GGUF" in err and "Traceback" not in err


def test_recipe_edited_into_nonsense(tiny_models, tmp_path, run_cli):
    model = tiny_models["llama"]
    good = uniform_recipe(open_model(model), "Q8_0")
    cases = {
        "wrong-hash": lambda r: r["map"]["model"].__setitem__("fingerprint", "sha256:" + "0" * 64),
        "missing-group": lambda r: r["groups"].pop(1),
        "negative-bytes": lambda r: r["groups"][0].__setitem__("bytes", -5),
        "nan-damage": lambda r: r["groups"][0].__setitem__("damage", float("nan")) or r.__setitem__("source", None),
        "unknown-format": lambda r: r["groups"][0].__setitem__("format", "Q9_9"),
        "not-a-recipe": lambda r: r.__setitem__("cardfit_recipe", 7),
    }
    for name, edit in cases.items():
        recipe = json.loads(json.dumps(good))
        edit(recipe)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(recipe))
        code, _, err = run_cli("pack", path, "--model", model, "--out", tmp_path / f"{name}.gguf", "--no-smoke")
        assert code == 2 and len(err.strip().splitlines()) == 1, (name, err)
        assert not (tmp_path / f"{name}.gguf").exists()


def test_map_edited_into_nonsense(tiny_models, tmp_path, run_cli, calib_text):
    from cardfit.scan import scan

    scan(tiny_models["llama"], calib_text, max_tokens=128, formats="Q8_0,Q4_0", seq_len=32, out=tmp_path / "m.json",
         progress=False)
    good = json.loads((tmp_path / "m.json").read_text())
    for name, edit in {"nan": lambda m: m["groups"][1]["cells"]["Q4_0"].__setitem__("damage", float("nan")),
                       "negative-bytes": lambda m: m["groups"][1]["bytes"].__setitem__("Q8_0", -1),
                       "no-groups": lambda m: m.__setitem__("groups", [])}.items():
        data = json.loads(json.dumps(good))
        edit(data)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        code, _, err = run_cli("plan", path, "--weight-budget", "1GiB", "--out", tmp_path / "r.json")
        assert code == 2 and "do not edit maps by hand" in err, name
    code, _, err = run_cli("plan", tmp_path / "m.json", "--weight-budget", "1GiB", "--model", tiny_models["qwen2"],
                           "--out", tmp_path / "r.json")
    assert code == 2 and "another model" in err


def test_output_path_unwritable(tiny_models, tmp_path, run_cli):
    model = tiny_models["llama"]
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps(uniform_recipe(open_model(model), "Q8_0")))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = run_cli("pack", recipe, "--model", model, "--out", blocker / "sub" / "x.gguf", "--no-smoke")
    assert code == 2 and f"{blocker} is a file, and the output needs a directory there" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "r.json"]


# -- faults -------------------------------------------------------------------------------------------

PACK_SCRIPT = """
import sys
from cardfit.pack import pack
pack(sys.argv[1], sys.argv[2], sys.argv[3], progress=False, smoke=False)
"""


def test_sigkill_during_pack_leaves_no_artifact_and_a_rerun_succeeds(default_model_dir, tmp_path):
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps(uniform_recipe(open_model(default_model_dir), "Q8_0")))
    out = tmp_path / "out" / "model.gguf"
    proc = subprocess.Popen([sys.executable, "-c", PACK_SCRIPT, str(recipe), str(default_model_dir), str(out)])
    deadline = time.time() + 120
    while time.time() < deadline:  # kill it once the temporary file has data in it
        parts = list(out.parent.glob(".model.gguf.*.part")) if out.parent.exists() else []
        if parts and parts[0].stat().st_size > 20 * 2**20:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    from cardfit.pack import pack

    pack(recipe, default_model_dir, out, progress=False)
    assert out.stat().st_size > 100 * 2**20


def test_memory_cap_too_small_says_what_to_do():
    import torch

    from cardfit.formats import get_format
    from cardfit.quant import DeviceArena, gptq_quantize

    w = torch.randn(256, 1024)
    hessian = torch.eye(1024)
    with pytest.raises(CardfitError, match="--memory-cap"):
        gptq_quantize(get_format("W4A16-g128"), w, hessian, arena=DeviceArena("cpu", cap_bytes=64 * 1024))


# -- security -----------------------------------------------------------------------------------------


def test_no_pickle_loading_anywhere_in_the_package():
    """torch.load and pickle never appear in cardfit's code: .bin checkpoints are refused, not read."""
    import pathlib

    root = pathlib.Path(__file__).parent.parent / "cardfit"
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert "torch.load(" not in text and "import pickle" not in text and "pickle.load" not in text, path


def test_every_model_load_in_the_package_refuses_pickles():
    """transformers falls back to pytorch_model.bin (a pickle) unless told not to: every model load says so."""
    import pathlib
    import re

    root = pathlib.Path(__file__).parent.parent / "cardfit"
    loads = 0
    for path in root.rglob("*.py"):
        for call in re.finditer(r"AutoModelForCausalLM\.from_pretrained\((.*?)\)\s*(?:\.to|$)", path.read_text(),
                                re.S | re.M):
            loads += 1
            assert "use_safetensors=True" in call.group(1) or "gguf_file=" in call.group(1), (path, call.group(0))
    assert loads >= 3


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                      max_size=4), max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_map_and_recipe_readers_fail_only_cleanly(data):
    from cardfit.maps import validate_map
    from cardfit.recipes import validate_recipe

    for validate in (validate_map, validate_recipe):
        try:
            validate(data)
        except CardfitError:
            pass


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["cardfit_recipe", "runtime", "map", "groups", "budget", "source"]),
                       json_values, max_size=6))
def test_recipe_shaped_garbage_fails_cleanly(data):
    from cardfit.recipes import validate_recipe

    data.setdefault("cardfit_recipe", 1)
    try:
        validate_recipe(data)
    except CardfitError:
        pass


# -- determinism --------------------------------------------------------------------------------------


def test_same_inputs_give_byte_identical_map_recipe_and_artifact(tiny_models, tmp_path, calib_text):
    from cardfit.pack import pack
    from cardfit.plan import plan
    from cardfit.scan import scan

    text = calib_text
    outputs = []
    for run in ("a", "b"):
        d = tmp_path / run
        d.mkdir()
        scan(tiny_models["llama"], text, max_tokens=128, formats="Q8_0,Q4_0", seq_len=32, out=d / "map.json",
             progress=False)
        from cardfit.atomic import write_json

        write_json(d / "recipe.json", plan(d / "map.json", 16 * 2**20))
        pack(d / "recipe.json", tiny_models["llama"], d / "model.gguf", progress=False, smoke=False,
             method="imatrix", calibration=text, max_tokens=128, seq_len=32)
        outputs.append([(d / n).read_bytes() for n in ("map.json", "recipe.json", "model.gguf")])
    assert outputs[0] == outputs[1]
    assert not math.isnan(json.loads(outputs[0][1])["predicted_damage"])
    assert os.path.getsize(tmp_path / "a" / "model.gguf") > 0


def test_a_single_chunk_scan_records_no_stderr_and_plans(tiny_model, calib_text, tmp_path):
    """One chunk has no spread: its standard error is null (not NaN, which no JSON reader accepts), and the map
    is a valid map that plans."""
    from cardfit.plan import plan
    from cardfit.scan import scan

    sensitivity = scan(tiny_model("llama"), calib_text, max_tokens=64, formats="Q8_0,Q4_K", seq_len=64,
                       out=tmp_path / "map.json", progress=False)
    assert sensitivity["calibration"]["chunks"] == 1
    cells = [c for g in sensitivity["groups"] for c in g["cells"].values()]
    assert all(c["stderr"] is None for c in cells if c["damage"] > 0)  # measured over one chunk: no spread
    assert any(c["stderr"] is None for c in cells)
    assert "NaN" not in (tmp_path / "map.json").read_text()
    assert plan(tmp_path / "map.json", 10**9)["groups"]


def test_a_cache_entry_another_process_finished_first_is_kept(tmp_path):
    """Two processes converting one GGUF at once (two scans, or test workers): the one finishing second
    keeps the first one's directory, which the first may be reading, and leaves no .part behind; a broken
    entry (no config) and an ordinary output are still replaced."""
    from cardfit.atomic import atomic_directory

    whole = lambda entry: (entry / "who").exists()  # noqa: E731
    for keep, theirs_whole, survivor in ((whole, True, "theirs"), (whole, False, "ours"), (None, True, "ours")):
        target = tmp_path / f"entry-{keep is None}-{theirs_whole}"
        with atomic_directory(target, keep_whole=keep) as tmp:
            (tmp / "who").write_text("ours")
            target.mkdir()  # the other process renames its copy into place meanwhile (or left a broken one)
            (target / ("who" if theirs_whole else "half")).write_text("theirs")
        assert (target / "who").read_text() == survivor and not (target / "half").exists()
    assert not list(tmp_path.glob(".*.part"))


def test_a_cache_entry_renamed_in_between_check_and_rename_is_kept(tmp_path, monkeypatch):
    import errno

    from cardfit import atomic

    target = tmp_path / "entry"

    def other_process_first(src, dst):
        Path(dst).mkdir()
        (Path(dst) / "who").write_text("theirs")
        raise OSError(errno.ENOTEMPTY, "Directory not empty")

    monkeypatch.setattr(atomic.os, "replace", other_process_first)
    with atomic.atomic_directory(target, keep_whole=lambda entry: (entry / "who").exists()) as tmp:
        (tmp / "who").write_text("ours")
    assert (target / "who").read_text() == "theirs" and not list(tmp_path.glob(".*.part"))
    with pytest.raises(OSError), atomic.atomic_directory(tmp_path / "output") as tmp:
        (tmp / "who").write_text("ours")


# -- output paths, fuzzed ------------------------------------------------------------------------------

_PLACES = ("fresh", "fresh-slash", "existing-dir", "existing-dir-slash", "loop", "link-to-dir", "link-to-file",
           "the-map", "inside-map-dir", "dangling-link")


@pytest.fixture(scope="module")
def planned_map(tiny_models, tmp_path_factory):
    from test_scan import run_scan, small_text

    root = tmp_path_factory.mktemp("fuzz-plan")
    out = root / "inputs" / "map.json"
    out.parent.mkdir()
    data = run_scan(tiny_models["llama"], small_text(root), out)
    sizes = [sum(g["bytes"][f] for g in data["groups"]) for f in data["formats"]]
    return out, (min(sizes) + max(sizes)) // 2


def _place(root: Path, kind: str, the_map: Path, name: str) -> str:
    """An output path of the given kind under `root` (made fresh for each example)."""
    path = root / name
    if kind in ("existing-dir", "existing-dir-slash"):
        path.mkdir()
    elif kind == "loop":
        os.symlink(root / f"{name}-b", path)
        os.symlink(path, root / f"{name}-b")
    elif kind == "link-to-dir":
        (root / f"{name}-target").mkdir()
        os.symlink(root / f"{name}-target", path)
    elif kind == "link-to-file":
        (root / f"{name}-target").write_text("keep")
        os.symlink(root / f"{name}-target", path)
    elif kind == "dangling-link":
        os.symlink(root / f"{name}-nowhere" / "x", path)
    elif kind == "the-map":
        return str(the_map)
    elif kind == "inside-map-dir":
        return str(the_map.parent / name)
    return str(path) + ("/" if kind.endswith("slash") else "")


def _snapshot(root: Path) -> dict:
    return {str(p): (p.is_symlink(), p.read_bytes() if p.is_file() and not p.is_symlink() else None)
            for p in sorted(root.rglob("*"))}


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(out=st.sampled_from(_PLACES), frontier=st.sampled_from(_PLACES + ("none", "same-as-out")))
def test_plan_outputs_fuzzed_keep_the_promise(planned_map, tmp_path_factory, run_cli, out, frontier):
    """plan's --out and --frontier as every kind of place (links, loops, slashes, each other, the map): either
    exit 0 with both files whole where asked, or one line and exit 2 with nothing created and the map as it was."""
    the_map, budget = planned_map
    root = tmp_path_factory.mktemp("outs")
    out_path = _place(root, out, the_map, "recipe.json")
    args = ["plan", the_map, "--weight-budget", str(budget), "--out", out_path]
    if frontier != "none":
        args += ["--frontier", out_path if frontier == "same-as-out" else _place(root, frontier, the_map, "front.json")]
    before, map_before = _snapshot(root), the_map.read_bytes()
    inputs_before = _snapshot(the_map.parent)
    code, _, err = run_cli(*args)
    assert the_map.read_bytes() == map_before
    assert "Traceback" not in err
    if code == 0:
        written = Path(out_path)
        assert written.is_file() and json.loads(written.read_text())["cardfit_recipe"] == 1, (out, frontier)
        if frontier not in ("none",):
            front = Path(args[args.index("--frontier") + 1])
            assert front.is_file() and "points" in json.loads(front.read_text()), (out, frontier)
            assert front.resolve() != written.resolve()
    else:
        assert code == 2 and len(err.strip().splitlines()) == 1, (out, frontier, err)
        assert _snapshot(root) == before and _snapshot(the_map.parent) == inputs_before, (out, frontier)


@pytest.mark.parametrize("command", ["scan", "fit", "plan"])
def test_a_second_run_on_one_output_is_refused_naming_the_first(tiny_models, planned_map, tmp_path, command):
    """Two real processes on one output: while one holds it, the other says who does and exits 2 before any
    work, leaving nothing; the lock lives in the cache, not beside the user's files."""
    from cardfit.locks import holding

    out = tmp_path / ("run" if command == "fit" else "out.json")
    args = {"scan": ["scan", tiny_models["llama"], "--max-tokens", "64", "--seq-len", "32", "--out", out],
            "fit": ["fit", tiny_models["llama"], "--vram", "1GiB", "--out", out],
            "plan": ["plan", planned_map[0], "--weight-budget", str(planned_map[1]), "--out", out]}[command]
    with holding({"--out": out}, "scan"):
        done = subprocess.run([sys.executable, "-m", "cardfit.cli", *map(str, args)], capture_output=True,
                              text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (f"error: --out {out.resolve()} is being written by pid {os.getpid()} (cardfit "
                                   "scan) (or a run writing inside it) — wait for that run to finish, or give --out "
                                   "another path")
    assert sorted(tmp_path.iterdir()) == []


def test_conflicting_or_empty_requests_are_refused_in_one_line(tiny_models, tmp_path, run_cli, planned_map):
    """Two formats for one group, a pin with no format, an empty preset list, names beside --all: refused
    before any work, naming the conflict, nothing written."""
    the_map, budget = planned_map
    out = tmp_path / "r.json"
    for args, said in ((["plan", the_map, "--weight-budget", budget, "--pin", "lm_head=Q8_0", "--pin", "lm_head=Q4_0"],
                        "two formats (Q8_0 and Q4_0)"),
                       (["plan", the_map, "--weight-budget", budget, "--floor", "embed="], "no group or no format"),
                       (["compare", tiny_models["llama"], "--presets", ",", "--out", tmp_path / "c"], "names no"),
                       (["models", "get", "--all", "nosuch"], "--all and names")):
        code, _, err = run_cli(*args, *(["--out", out] if args[0] == "plan" else []))
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, (args, err)
    assert sorted(tmp_path.iterdir()) == []


def test_compare_refuses_a_map_of_another_runtime_before_any_work(tiny_models, tmp_path, run_cli):
    from test_scan import run_scan, small_text

    vllm_map = tmp_path / "inputs" / "map.json"
    vllm_map.parent.mkdir()
    run_scan(tiny_models["llama"], small_text(tmp_path / "inputs"), vllm_map, formats="W8A16,W4A16-g32")
    before = sorted(tmp_path.rglob("*"))
    code, _, err = run_cli("compare", tiny_models["llama"], "--map", vllm_map, "--out", tmp_path / "c")
    assert code == 2 and "scanned for vllm" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(tmp_path.rglob("*")) == before


def test_a_size_bomb_in_bench_is_refused_before_llama_cpp_allocates(run_cli):
    """`bench --gen-tokens 100000000000` grew to 22.9 GB and was killed by the kernel; the KV cache it would
    need is checked against the free memory before anything is allocated."""
    from cardfit.default_model import default_gguf

    code, _, err = run_cli("bench", default_gguf(), "--gen-tokens", "100000000000")
    assert code == 2 and "KV cache" in err and "lower --gen-tokens" in err and len(err.strip().splitlines()) == 1, err


def test_a_non_finite_number_is_never_written_into_an_artifact(tmp_path):
    """One rule where every map, recipe, state and report is written: NaN or infinity refused naming where it
    is, nothing written (a scan of a GGUF missing a tensor exited 0 with a 'complete' map of NaN damages)."""
    from cardfit.atomic import write_json

    for bad, at in ((float("nan"), "/groups/1/cells/Q4_K/damage"), (float("inf"), "/groups/1/cells/Q4_K/damage")):
        with pytest.raises(CardfitError, match=f"not finite, at {at}"):
            write_json(tmp_path / "map.json", {"groups": [{}, {"cells": {"Q4_K": {"damage": bad}}}]})
        assert not (tmp_path / "map.json").exists() and list(tmp_path.iterdir()) == []
    write_json(tmp_path / "map.json", {"damage": 1e308, "stderr": None})
    assert json.loads((tmp_path / "map.json").read_text()) == {"damage": 1e308, "stderr": None}


@pytest.mark.parametrize("command", ["plan", "sizes"])
def test_a_deeply_nested_json_is_one_line_not_a_recursion_error(tiny_models, tmp_path, run_cli, command):
    bomb = "[" * 200_000 + "]" * 200_000
    if command == "plan":
        (tmp_path / "map.json").write_text(bomb)
        code, _, err = run_cli("plan", tmp_path / "map.json", "--weight-budget", "1MiB", "--out", tmp_path / "r.json")
    else:
        model = copy_model(tiny_models["llama"], tmp_path / "m")
        (model / "config.json").write_text(bomb)
        code, _, err = run_cli("sizes", model)
    assert code == 2 and "not valid JSON" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("delta", [1, -1])
def test_a_gguf_whose_header_miscounts_its_tensors_is_refused(tmp_path, run_cli, delta):
    """A header claiming one tensor fewer than the file holds read every tensor from the wrong place, and a
    scan exited 0 with NaN damages; one more was an IndexError: both are one line before any work."""
    import struct

    from cardfit.default_model import default_gguf

    bad = tmp_path / "bad.gguf"
    shutil.copy(default_gguf(), bad)
    with open(bad, "r+b") as f:
        f.seek(8)
        count = struct.unpack("<Q", f.read(8))[0]
        f.seek(8)
        f.write(struct.pack("<Q", count + delta))
    before = bad.read_bytes()
    code, _, err = run_cli("sizes", bad)
    assert code == 2 and "re-download the file" in err and len(err.strip().splitlines()) == 1, err
    assert bad.read_bytes() == before


def test_a_tokenizer_with_more_tokens_than_embedding_rows_is_refused(tmp_path, run_cli, capsys):
    """Weights of a 1,000-token model beside a 49,152-token tokenizer: scan and check ended in 'IndexError: index
    out of range in self'; now one line naming the mismatch, before any work."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from cardfit.default_model import default_model_dir

    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = tmp_path / "m"
    AutoModelForCausalLM.from_config(config).to(dtype=__import__("torch").float16).save_pretrained(model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir() / name, model / name)
    capsys.readouterr()  # the save's own progress
    code, _, err = run_cli("scan", model, "--max-tokens", "64", "--seq-len", "32", "--out", tmp_path / "map.json")
    assert code == 2 and "embedding has 1000 rows" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "map.json").exists()


def test_plan_messages_name_the_real_cause_and_a_fix_that_exists(planned_map, tmp_path, run_cli):
    the_map, budget = planned_map
    out = ["--out", tmp_path / "r.json"]
    code, _, err = run_cli("plan", the_map, "--weight-budget", budget, "--floor", "*=F16", *out)
    assert code == 2 and "--floor *=F16 is above every format the map has" in err, err  # was "not served by"
    code, _, err = run_cli("plan", the_map, "--weight-budget", "1000", *out)
    assert code == 2 and "raise --weight-budget" in err and "--vram" not in err, err
    assert not (tmp_path / "r.json").exists()


@pytest.mark.parametrize("command", ["scan", "fit", "plan", "budget"])
def test_help_reads_well_at_80_columns(command):
    """At 80 columns a description runs the width of the terminal (click's plain layout), not a column of two
    or three words a line (rich's panels squeezed beside long option names): issue 43, item 8."""
    done = subprocess.run([sys.executable, "-m", "cardfit.cli", command, "--help"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "80"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines and max(len(line) for line in lines) <= 80
    continued = [line for line in lines if line.startswith(" ") and line.strip() and not line.lstrip().startswith("-")]
    assert continued and all(len(line) - len(line.lstrip()) <= 40 for line in continued), done.stdout
    assert not any("│" in line for line in lines)  # no panels: their borders cost the columns a description needs


def test_a_run_writing_inside_a_directory_another_run_writes_is_refused(tiny_models, tmp_path):
    """fit holds its whole directory: a scan writing a file inside it is refused naming fit, and fit is refused
    while a run writes inside its directory; nothing is left either way."""
    from cardfit.locks import holding

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "cardfit.cli", *map(str, args)], capture_output=True, text=True,
                              timeout=300)

    folder = tmp_path / "fit"
    with holding({"--out": folder}, "fit"):
        done = cli("scan", tiny_models["llama"], "--max-tokens", "64", "--seq-len", "32", "--out", folder / "s.json")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"lies inside {folder.resolve()}, which pid {os.getpid()} (cardfit fit) is writing" in done.stderr
    with holding({"--out": folder / "s.json"}, "scan"):
        done = cli("fit", tiny_models["llama"], "--vram", "1GiB", "--out", folder)
    assert done.returncode == 2 and "is being written by" in done.stderr, done.stderr
    assert sorted(tmp_path.iterdir()) == []


def test_outputs_that_cannot_be_made_or_are_one_place_are_refused_before_work(tiny_models, tmp_path, run_cli):
    """A file where an output's directory must be; scan's map and imatrix on one path (however spelled); check's
    chunk longer than its token budget (llama.cpp would allocate a context that long first)."""
    from cardfit.default_model import default_gguf

    from test_scan import small_text

    text = small_text(tmp_path)
    (tmp_path / "afile").write_text("x")
    scan = ["scan", tiny_models["llama"], "--calibration", text, "--max-tokens", "64", "--seq-len", "32"]
    for args, said in (([*scan, "--out", tmp_path / "afile" / "m.json"], "is a file, and the output needs a directory"),
                       ([*scan, "--out", tmp_path / "m.json", "--imatrix-out", tmp_path / "afile" / "im.gguf"],
                        "is a file, and the output needs a directory"),
                       ([*scan, "--out", tmp_path / "x.gguf", "--imatrix-out", tmp_path / "." / "x.gguf"],
                        "are the same file"),
                       ([*scan, "--out", tmp_path / "nope" / ".." / "m.json"], "climbs out of"),
                       (["check", default_gguf(), "--smoke", "--max-tokens", "256", "--seq-len", "200000"],
                        "less than one chunk of 200000")):
        code, _, err = run_cli(*args)
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "calib.txt"]


def test_compare_never_writes_over_an_input_inside_its_directory(tiny_models, tmp_path, run_cli):
    """A --map named like a file compare writes, inside its --out: refused before work, the map untouched."""
    from test_scan import run_scan, small_text

    out = tmp_path / "cmp"
    out.mkdir()
    the_map = out / "weight-map.json"
    run_scan(tiny_models["llama"], small_text(tmp_path), the_map, formats="Q8_0,Q4_0")
    before = the_map.read_bytes()
    code, _, err = run_cli("compare", tiny_models["llama"], "--map", the_map, "--out", out, "--presets", "Q8_0",
                           "--baselines", "none", "--no-speed")
    assert code == 2 and "would overwrite the map" in err and len(err.strip().splitlines()) == 1, err
    assert the_map.read_bytes() == before and sorted(p.name for p in out.iterdir()) == ["weight-map.json"]


def test_a_map_of_other_weights_of_the_same_architecture_is_refused(tiny_models, tmp_path, run_cli):
    """A fine-tune has the same config and tensor index, so the fingerprint alone took its base model's map for its
    own; the weights sample tells them apart (plan, pack and refine through maps.check_map_model, scan --resume
    through schemas.same_model), a byte-identical copy is still the same model, and a map made before the sample
    was recorded is judged by its fingerprint alone."""
    from safetensors.torch import load_file, save_file

    from cardfit.maps import check_map_model
    from cardfit.schemas import model_header, same_model

    model = tiny_models["llama"]
    tuned, copy = tmp_path / "tuned", tmp_path / "copy"
    shutil.copytree(model, tuned)
    shutil.copytree(model, copy)
    shard = next(tuned.glob("*.safetensors"))
    tensors = load_file(shard)
    tensors = {name: t * 1.01 if t.ndim == 2 else t for name, t in tensors.items()}  # every matrix moved a little
    save_file(tensors, shard, metadata={"format": "pt"})
    base, fine_tuned = model_header(open_model(model)), model_header(open_model(tuned))
    assert base["fingerprint"] == fine_tuned["fingerprint"] and base["weights"] != fine_tuned["weights"]
    assert not same_model(dict(base, name="tuned"), fine_tuned)  # the directory's name is part of a header
    assert same_model(dict(base, name="tuned", weights=None), fine_tuned)
    recipe = uniform_recipe(open_model(model), "Q8_0")
    (tmp_path / "recipe.json").write_text(json.dumps(recipe))
    code, _, err = run_cli("pack", tmp_path / "recipe.json", "--model", tuned, "--out", tmp_path / "t.gguf", "--no-smoke")
    assert code == 2 and "other weights of this architecture" in err.strip().splitlines()[-1], err
    assert not (tmp_path / "t.gguf").exists()
    check_map_model(recipe["map"], open_model(copy))
    del recipe["map"]["model"]["weights"]
    check_map_model(recipe["map"], open_model(tuned))
