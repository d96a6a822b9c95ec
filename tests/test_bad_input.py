"""Bad input: one line naming the problem and the fix, exit 2, no traceback."""

import json

import pytest


def assert_clean_error(code, err, *needles):
    assert code == 2
    lines = [l for l in err.strip().splitlines() if l]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and "Traceback" not in err
    for needle in needles:
        assert needle in lines[0]


def test_missing_config(run_cli, tmp_path):
    code, _, err = run_cli("budget", "--vram", "8GiB", "--config", tmp_path)
    assert_clean_error(code, err, "no config.json")


def test_garbled_config(run_cli, tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    code, _, err = run_cli("budget", "--vram", "8GiB", "--config", tmp_path / "config.json")
    assert_clean_error(code, err, "not valid JSON")


def test_config_missing_keys(run_cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    code, _, err = run_cli("budget", "--vram", "8GiB", "--config", tmp_path / "config.json")
    assert_clean_error(code, err, "lacks num_hidden_layers")


def test_unknown_architecture(run_cli, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "frobnicator"}))
    code, _, err = run_cli("budget", "--vram", "8GiB", "--config", tmp_path / "config.json")
    assert_clean_error(code, err, "unknown architecture 'frobnicator'", "supported:")


@pytest.mark.parametrize("vram", ["12xB", "lots", "-4GiB"])
def test_nonsense_units(run_cli, vram):
    code, _, err = run_cli("budget", "--vram", vram, "--config", "tests/configs/llama-3.2-3b.json")
    assert_clean_error(code, err, "--vram")


def test_negative_context(run_cli):
    code, _, err = run_cli("budget", "--vram", "8GiB", "--context", "-5", "--config",
                           "tests/configs/llama-3.2-3b.json")
    assert_clean_error(code, err, "context -5 is not positive")


def test_budget_below_zero_names_the_numbers(run_cli):
    code, _, err = run_cli("budget", "--vram", "1GiB", "--context", "131072", "--config",
                           "tests/configs/llama-3.2-3b.json")
    assert_clean_error(code, err, "leaves no room for weights", "KV cache 14.00 GiB")


def test_pickle_only_directory_refused(run_cli, tmp_path):
    from pathlib import Path

    cfg = json.loads(Path("tests/configs/llama-3.2-3b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not-loaded")
    code, _, err = run_cli("sizes", tmp_path)
    assert_clean_error(code, err, "pickle", "safetensors")


def test_debug_shows_traceback(tmp_path):
    from cardfit.cli import main
    from cardfit.errors import CardfitError

    with pytest.raises(CardfitError):
        main(["--debug", "budget", "--vram", "8GiB", "--config", str(tmp_path)])


def test_no_fit_is_an_error_with_the_minimum(run_cli, default_model_dir):
    code, out, err = run_cli("budget", "--vram", "570MiB", "--context", "2048", "--config", default_model_dir)
    assert_clean_error(code, err, "no recipe fits the", "minimum achievable is", "over)")
    assert "= weight budget" in out


def test_compare_unknown_baseline(run_cli, tmp_path):
    code, _, err = run_cli("compare", "--out", tmp_path / "cmp", "--baselines", "rtn,int3")
    assert_clean_error(code, err, "unknown baseline 'int3'", "nf4")
    assert not (tmp_path / "cmp").exists()


def test_check_bitsandbytes_needs_a_model_directory(run_cli, tmp_path):
    artifact = tmp_path / "model.gguf"
    artifact.write_bytes(b"GGUF")
    code, _, err = run_cli("check", artifact, "--runtime", "bitsandbytes")
    assert_clean_error(code, err, "full-precision model directory")
