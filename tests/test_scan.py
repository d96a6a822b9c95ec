"""The sensitivity map: exact cells, resumable after SIGKILL, refuses bad input."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cardfit.scan import scan

FORMATS = "Q8_0,Q4_0,Q2_K"


def small_text(tmp_path, n_words=3000):
    from cardfit.text import load_text

    text = load_text(None)[0]
    path = tmp_path / "calib.txt"
    path.write_text(text[: n_words * 6], encoding="utf-8")
    return path


def run_scan(model, text, out, **kw):
    args = dict(max_tokens=256, formats=FORMATS, seq_len=32, batch=4, progress=False)
    args.update(kw)
    return scan(model, text, out=out, **args)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3"])
def test_map_covers_every_group_and_format(tiny_models, tmp_path, kind):
    text = small_text(tmp_path)
    result = run_scan(tiny_models[kind], text, tmp_path / "map.json")
    names = [g["name"] for g in result["groups"]]
    assert names[0] == "embed" and names[-1] in ("norm", "lm_head")
    assert ("lm_head" in names) == (kind == "llama")  # tied heads are priced with the embedding
    for g in result["groups"]:
        assert set(g["cells"]) == set(FORMATS.split(","))
        assert all(c["damage"] >= 0 for c in g["cells"].values())
    on_disk = json.loads((tmp_path / "map.json").read_text())
    assert on_disk == json.loads(json.dumps(result)) and on_disk["complete"]


def test_cells_equal_the_slow_way(tiny_models, tmp_path):
    """Quantize the whole model with only group g changed and compute KL directly."""
    from transformers import AutoTokenizer

    from cardfit.formats import get_format
    from cardfit.engine.metrics import token_kl
    from cardfit.engine import Engine
    from cardfit.sources import open_model
    from cardfit.text import token_chunks

    text = small_text(tmp_path)
    result = run_scan(tiny_models["llama"], text, tmp_path / "map.json")
    source = open_model(tiny_models["llama"])
    stream = Engine(source, "cpu")
    tok = AutoTokenizer.from_pretrained(source.path)
    chunks = token_chunks(tok, text.read_text(), 32, 256)
    ref = stream.forward(chunks)
    for group_name, fmt_name in (("embed", "Q2_K"), ("layers.1", "Q4_0"), ("lm_head", "Q2_K")):
        fmt = get_format(fmt_name)
        tensors = source.groups()[group_name]
        overrides = {t.name: fmt.roundtrip(t.name, source.read(t.name)) for t in tensors if len(t.shape) == 2}
        slow = float(token_kl(ref, stream.forward(chunks, overrides)).mean())
        cell = next(g for g in result["groups"] if g["name"] == group_name)["cells"][fmt_name]["damage"]
        assert abs(slow - cell) <= 1e-6 + 1e-4 * slow, (group_name, slow, cell)


def test_damage_grows_with_fewer_bits(tiny_models, tmp_path):
    result = run_scan(tiny_models["llama"], small_text(tmp_path), tmp_path / "m.json")
    grows = [g["cells"]["Q8_0"]["damage"] <= g["cells"]["Q2_K"]["damage"] for g in result["groups"]
             if g["name"] != "norm"]
    assert all(grows)


def test_sigkill_then_resume_gives_the_identical_map(tiny_models, tmp_path):
    text = small_text(tmp_path)
    args = [sys.executable, "-m", "cardfit.cli", "scan", str(tiny_models["gemma3"]), "--calibration", str(text),
            "--max-tokens", "256", "--formats", FORMATS, "--seq-len", "32"]
    whole = tmp_path / "whole.json"
    subprocess.run(args + ["--out", str(whole)], check=True, capture_output=True)
    part = tmp_path / "part.json"
    proc = subprocess.Popen(args + ["--out", str(part)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        if part.exists() and sum(len(g["cells"]) for g in json.loads(part.read_text())["groups"]) >= 4:
            break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    partial = json.loads(part.read_text())  # the checkpoint on disk is always a whole JSON document
    assert not partial["complete"]
    resumed = subprocess.run(args + ["--out", str(part), "--resume"], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert part.read_bytes() == whole.read_bytes()


def test_activations_spill_to_disk_under_a_memory_cap(tiny_models, tmp_path, monkeypatch):
    from cardfit.engine.activations import ActivationCache

    spilled, put = [], ActivationCache.put

    def counting_put(self, point, batch, hidden):
        put(self, point, batch, hidden)
        if (point, batch) not in self.memory:
            spilled.append((point, batch))

    monkeypatch.setattr(ActivationCache, "put", counting_put)
    text = small_text(tmp_path)
    run_scan(tiny_models["qwen2"], text, tmp_path / "a.json")
    assert not spilled
    run_scan(tiny_models["qwen2"], text, tmp_path / "b.json", memory_cap=64 * 1024)
    assert spilled  # the cap sent hidden states to disk, and the map is the same bytes
    assert any(point == "tail" for point, _ in spilled)  # the reference's tail rows too (head_kl.py)
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert not any(p.name.startswith("cardfit-acts-") for p in tmp_path.iterdir())  # spill dir cleaned


def test_rounding_ahead_on_a_thread_gives_the_same_map(tiny_models, tmp_path, monkeypatch):
    """On CUDA the next sweep's copies are rounded on a host thread during this sweep; forced on here,
    the map is the same bytes, and every measured sweep took its copies from that thread."""
    from cardfit import scan as scan_module

    text = small_text(tmp_path)
    run_scan(tiny_models["qwen2"], text, tmp_path / "inline.json")
    taken = []
    original_take = scan_module.RoundedAhead.take

    def take(self, group, formats):
        variants = original_take(self, group, formats)
        taken.append(variants is not None)
        return variants

    monkeypatch.setattr(scan_module.RoundedAhead, "applies", staticmethod(lambda *a: True))
    monkeypatch.setattr(scan_module.RoundedAhead, "take", take)
    run_scan(tiny_models["qwen2"], text, tmp_path / "ahead.json")
    assert (tmp_path / "inline.json").read_bytes() == (tmp_path / "ahead.json").read_bytes()
    assert taken and all(taken)


@pytest.mark.parametrize("problem,args,needle", [
    ("missing", ["--calibration", "/nonexistent.txt"], "no text file"),
    ("format", ["--formats", "Q8_0,Q9_Z"], "unknown format 'Q9_Z'"),
    ("mixed", ["--formats", "Q8_0,W4A16"], "mix runtimes"),
    ("short", ["--seq-len", "100000"], "fewer than one chunk"),
    ("few-tokens", ["--max-tokens", "16"], "less than one chunk of 32"),
])
def test_bad_scan_input(tiny_models, tmp_path, run_cli, problem, args, needle):
    base = ["scan", tiny_models["llama"], "--out", tmp_path / "x.json", "--max-tokens", "256", "--seq-len", "32"]
    if problem != "missing":
        base += ["--calibration", small_text(tmp_path)]
    code, _, err = run_cli(*(base + args))
    assert code == 2 and needle in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("content", [b"", b"\x00\x01\x02binary", "caf\xe9".encode("latin-1") * 50])
def test_bad_calibration_files(tiny_models, tmp_path, run_cli, content):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(content)
    code, _, err = run_cli("scan", tiny_models["llama"], "--calibration", bad, "--out", tmp_path / "x.json")
    assert code == 2 and err.startswith("error: ")


def test_map_for_another_model_is_refused(tiny_models, tmp_path, run_cli):
    text = small_text(tmp_path)
    out = tmp_path / "m.json"
    run_scan(tiny_models["llama"], text, out)
    code, _, err = run_cli("scan", tiny_models["qwen2"], "--calibration", text, "--out", out, "--resume",
                           "--max-tokens", "256", "--formats", FORMATS, "--seq-len", "32")
    assert code == 2 and "another model" in err


def test_fast_estimator_agrees_with_exact_cells(tiny_models, tmp_path):
    """½ δwᵀ F δw is the second-order expansion of the very KL the exact scan measures."""
    from scipy.stats import spearmanr

    text = small_text(tmp_path)
    exact = run_scan(tiny_models["llama"], text, tmp_path / "exact.json")
    fast = run_scan(tiny_models["llama"], text, tmp_path / "fast.json", method="fast")
    assert fast["damage"]["method"].startswith("fast") and exact["damage"]["method"] == "exact"
    pairs = [(ge["cells"][f]["damage"], gf["cells"][f]["damage"])
             for ge, gf in zip(exact["groups"], fast["groups"]) for f in ge["cells"]]
    assert spearmanr(*zip(*pairs)).statistic > 0.9
    for e, f in pairs:
        if e > 1e-6:
            assert 0.5 < f / e < 2, (e, f)
