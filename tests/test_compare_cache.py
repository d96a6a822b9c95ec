"""compare's cache: a file in --out is reused only when it was made from this model and these settings."""

import json
import shutil

import pytest
import torch


def _stamp(path):
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


def _reweighted(model_dir, dest):
    """The same architecture and config (so the same fingerprint and map header) with other weights."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, dest)
    weights = dest / "model.safetensors"
    generator = torch.Generator().manual_seed(1)
    tensors = {name: (t.float() + 0.02 * torch.randn(t.shape, generator=generator)).to(t.dtype)
               for name, t in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    return dest


def test_compare_remakes_what_another_model_or_setting_made(tiny_model, tmp_path, calib_text):
    from cardfit.compare import STATE, compare
    from cardfit.maps import read_map
    from cardfit.sources import open_model

    model_a = tiny_model("llama")
    model_b = _reweighted(model_a, tmp_path / "b" / model_a.name)  # even the same directory name
    assert open_model(model_a).fingerprint() == open_model(model_b).fingerprint()  # config alone cannot tell them apart
    out = tmp_path / "cmp"

    def run(model, scan_tokens=64):
        return compare(model, out, None, ["Q8_0"], text=calib_text, max_tokens=64, seq_len=32,
                       scan_tokens=scan_tokens, progress=False, log=None, baselines=[], speed=False)

    cached = [out / n for n in ("f16.gguf", "sensitivity.json", "weight-map.json", "shelf-Q8_0.gguf",
                                 "uniform-body-Q8_0.gguf", "weight-allocator-Q8_0.gguf", "cardfit-Q8_0.gguf")]
    first = run(model_a)
    state = json.loads((out / STATE).read_text())
    assert set(state["artifacts"]) == {p.name for p in cached}
    stamps = {p.name: _stamp(p) for p in cached}

    # (c) the same model and settings: every file reused, untouched; the rows measured again, equal.
    again = run(model_a)
    assert {p.name: _stamp(p) for p in cached} == stamps
    assert json.loads((out / STATE).read_text()) == state
    assert [r["kld_mean"] for r in again["rows"]] == [r["kld_mean"] for r in first["rows"]]

    # (b) another setting: more calibration tokens re-make the map (scan used to refuse it); what
    # does not depend on them (F16 and the preset) stays.
    run(model_a, scan_tokens=96)
    assert read_map(out / "sensitivity.json")["calibration"]["tokens"] == 96
    assert _stamp(out / "sensitivity.json") != stamps["sensitivity.json"]
    assert read_map(out / "weight-map.json")["calibration"]["tokens"] == 96
    assert _stamp(out / "f16.gguf") == stamps["f16.gguf"]
    assert _stamp(out / "shelf-Q8_0.gguf") == stamps["shelf-Q8_0.gguf"]

    # (a) another model, same config and file names: everything re-made from it.
    f16_a = (out / "f16.gguf").read_bytes()
    stamps = {p.name: _stamp(p) for p in cached}
    other = run(model_b, scan_tokens=96)
    for path in cached:
        assert _stamp(path) != stamps[path.name], path.name
    assert (out / "f16.gguf").read_bytes() != f16_a
    rows = {r["name"]: r for r in other["rows"]}
    before = {r["name"]: r for r in first["rows"]}
    assert rows["llama.cpp F16 (runtime floor)"]["reference_perplexity"] != \
        before["llama.cpp F16 (runtime floor)"]["reference_perplexity"]
    # The floor is model B's own F16: a stale one (model A's) measured against B's reference would not be near 0.
    assert rows["llama.cpp F16 (runtime floor)"]["kld_mean"] < 1e-3
    assert rows["llama.cpp Q8_0"]["kld_mean"] < 0.05


def test_artifact_cache_reuses_only_on_an_equal_key(tmp_path):
    from cardfit.compare import STATE, ArtifactCache, artifact_key

    made = []
    target = tmp_path / "thing.bin"

    def make(content):
        def go():
            made.append(content)
            target.write_text(content)
        return go

    key = artifact_key("thing", model={"fingerprint": "sha256:a"}, tokens=64)
    assert key == artifact_key("thing", tokens=64, model={"fingerprint": "sha256:a"})  # order-free
    assert key != artifact_key("thing", model={"fingerprint": "sha256:a"}, tokens=65)
    assert key != artifact_key("other", model={"fingerprint": "sha256:a"}, tokens=64)

    assert ArtifactCache(tmp_path).ensure(target, key, make("one"))
    assert not ArtifactCache(tmp_path).ensure(target, key, make("two"))  # a new run reads the record
    assert ArtifactCache(tmp_path).ensure(target, artifact_key("thing", tokens=1), make("three"))
    assert made == ["one", "three"] and target.read_text() == "three"

    # A file without a record (made before the record existed, or by hand) is not trusted.
    loose = tmp_path / "loose.bin"
    loose.write_text("stale")
    assert ArtifactCache(tmp_path).ensure(loose, key, lambda: loose.write_text("fresh"))
    assert loose.read_text() == "fresh"

    # An interrupted re-make leaves no key behind: the old file is not taken as made with either key.
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ArtifactCache(tmp_path).ensure(target, key, interrupted)
    assert target.name not in json.loads((tmp_path / STATE).read_text())["artifacts"]
    assert ArtifactCache(tmp_path).ensure(target, artifact_key("thing", tokens=1), make("four"))

    # An unreadable record: everything is re-made, and the record is rewritten whole.
    (tmp_path / STATE).write_text("{not json")
    assert ArtifactCache(tmp_path).ensure(target, artifact_key("thing", tokens=1), make("five"))
    assert made[-1] == "five"
    assert json.loads((tmp_path / STATE).read_text())["cardfit_compare_state"] == 1


def test_reference_logits_run_the_reference_once_per_chunk(tiny_model, monkeypatch):
    """compare's rows share one reference forward per chunk; another chunk computes its own."""
    import torch

    from cardfit.check import ReferenceLogits
    from cardfit.engine import Engine
    from cardfit.sources import open_model

    model_dir = tiny_model("llama-wide")
    calls = []
    forward = Engine.forward
    monkeypatch.setattr(Engine, "forward", lambda self, ids: calls.append(ids.shape) or forward(self, ids))
    shared = ReferenceLogits(model_dir)
    ids = torch.randint(0, 100, (2, 16))
    first, again = shared(ids), shared(ids.clone())
    assert len(calls) == 1 and torch.equal(first, again)
    assert torch.equal(first, forward(Engine(open_model(model_dir, run=True), "cpu"), ids))
    shared(ids[:, :8])
    assert len(calls) == 2
    # Past its byte budget it computes again instead of holding more (the same values).
    bounded = ReferenceLogits(model_dir, max_bytes=0)
    assert torch.equal(bounded(ids), first) and torch.equal(bounded(ids), first)
    assert len(calls) == 4 and not bounded._logits
