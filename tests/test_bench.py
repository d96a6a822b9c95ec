"""bench: speeds are measured, and the context that fits is the exact edge of the budget model."""

from cardfit.bench import bench, max_context_tokens
from cardfit.budget import compute_budget
from cardfit.errors import CardfitError
from cardfit.pack import pack
from cardfit.plan import uniform_recipe
from cardfit.sources import GgufSource, open_model


def test_bench_measures_and_the_context_is_the_edge(tiny_model, tmp_path, run_cli):
    model_dir = tiny_model("llama")
    artifact = tmp_path / "q8.gguf"
    pack(uniform_recipe(open_model(model_dir), "Q8_0"), model_dir, artifact, progress=False, smoke=False)
    result = bench(artifact, vram="700MiB", prompt_tokens=64, gen_tokens=8)
    assert result["prompt_tokens_per_s"] > 0 and result["gen_tokens_per_s"] > 0 and result["load_seconds"] > 0
    tokens = result["max_context_tokens"]
    geometry = GgufSource(artifact).geometry
    size = artifact.stat().st_size
    assert compute_budget(geometry, "700MiB", tokens, runtime="llama.cpp").weight_budget_bytes >= size
    try:
        over = compute_budget(geometry, "700MiB", tokens + 1, runtime="llama.cpp").weight_budget_bytes < size
    except CardfitError:
        over = True
    assert over
    assert max_context_tokens(geometry, 10 * 2**20, size, "llama.cpp") == 0  # a card too small for anything
    code, out, _ = run_cli("bench", artifact, "--prompt-tokens", 64, "--gen-tokens", 4)
    assert code == 0 and "tokens/s" in out
    code, _, err = run_cli("bench", tmp_path)
    assert code == 2 and "not a .gguf" in err


def test_a_bad_vram_is_refused_before_the_artifact_is_loaded(tiny_model, tmp_path, monkeypatch, run_cli):
    """--vram is read before the load and the timed runs (it was read after them: a typo cost the whole bench)."""
    import cardfit.targets.runtimes

    model_dir = tiny_model("llama")
    artifact = tmp_path / "q8.gguf"
    pack(uniform_recipe(open_model(model_dir), "Q8_0"), model_dir, artifact, progress=False, smoke=False)
    loads = []
    monkeypatch.setattr(cardfit.targets.runtimes, "load_llama", lambda *a, **k: loads.append(a) or 1 / 0)
    code, _, err = run_cli("bench", artifact, "--vram", "twelve gigs")
    assert code == 2 and "--vram" in err and loads == []
