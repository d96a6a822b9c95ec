"""check: the runtime's logits against the reference; a destroyed artifact is refused, by check and by pack."""

import shutil

import gguf
import numpy as np
import pytest

from cardfit.check import check
from cardfit.errors import CardfitError
from cardfit.pack import pack
from cardfit.plan import uniform_recipe
from cardfit.sources import open_model


@pytest.fixture(scope="module")
def q8_artifact(default_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("q8") / "smol-q8_0.gguf"
    pack(uniform_recipe(open_model(default_model_dir), "Q8_0"), default_model_dir, out, progress=False)
    return out


def zero_scales(src, dst, tensor="token_embd.weight"):
    """Copy a Q8_0 GGUF and zero the float16 scale of every block of one tensor."""
    shutil.copy(src, dst)
    info = next(t for t in gguf.GGUFReader(str(src)).tensors if t.name == tensor)
    assert info.tensor_type.name == "Q8_0"
    with open(dst, "r+b") as fh:
        fh.seek(info.data_offset)
        blocks = np.frombuffer(fh.read(info.n_bytes), dtype=np.uint8).reshape(-1, 34).copy()
        blocks[:, :2] = 0
        fh.seek(info.data_offset)
        fh.write(blocks.tobytes())


def test_a_good_artifact_is_close_to_the_reference(q8_artifact, default_model_dir):
    report = check(q8_artifact, default_model_dir, max_tokens=1024, seq_len=256)
    assert report["verdict"] == "pass"
    assert 0 < report["kld_mean"] < 0.01 and report["top1"] > 0.9
    assert abs(report["perplexity"] - report["reference_perplexity"]) / report["reference_perplexity"] < 0.02
    assert report["kld_p99"] >= report["kld_mean"]


def test_zeroed_scales_are_a_corpse(q8_artifact, default_model_dir, tmp_path, run_cli):
    broken = tmp_path / "broken.gguf"
    zero_scales(q8_artifact, broken)
    smoke = check(broken, smoke=True, max_tokens=512, seq_len=256)
    assert smoke["verdict"] == "fail" and "ceiling" in smoke["reasons"][0]
    full = check(broken, default_model_dir, max_tokens=512, seq_len=256)
    assert full["verdict"] == "fail" and full["top1"] < 0.05
    code, out, err = run_cli("check", broken, "--max-tokens", 512, "--seq-len", 256)
    assert code == 2 and "FAIL" in out and "failed its check" in err


def test_pack_refuses_to_land_a_corpse(default_model_dir, tmp_path, monkeypatch):
    """The smoke check runs on the temporary file: a destroyed artifact never appears at --out."""
    from cardfit.formats import GgmlFormat

    original = GgmlFormat.quantize

    def destroy_embedding(self, name, weight, calibration=None, method="rtn"):
        storage, raw = original(self, name, weight, calibration, method)
        if name.endswith("embed_tokens.weight"):
            raw = np.zeros_like(raw)
        return storage, raw

    monkeypatch.setattr(GgmlFormat, "quantize", destroy_embedding)
    with pytest.raises(CardfitError, match="smoke check"):
        pack(uniform_recipe(open_model(default_model_dir), "Q8_0"), default_model_dir, tmp_path / "x.gguf",
             progress=False)
    assert list(tmp_path.iterdir()) == []


def test_full_check_needs_a_reference(q8_artifact):
    with pytest.raises(CardfitError, match="reference"):
        check(q8_artifact, None)
