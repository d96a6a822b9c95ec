"""The weight signal (scan --method weight): imatrix-weighted squared weight error, one layer walk."""

import json
import re

import pytest
import torch

from cardfit.errors import CardfitError
from cardfit.formats import get_format
from cardfit.scan import scan
from cardfit.scan.signals.weight import token_frequencies, weighted_error

from test_scan import FORMATS, run_scan, small_text


def test_weighted_error_is_the_mean_squared_output_error_for_one_hot_inputs():
    """With inputs along the axes, E||dW x||^2 has no cross terms: the diagonal formula is exact."""
    torch.manual_seed(0)
    w, q = torch.randn(6, 5), torch.randn(6, 5)
    columns = torch.randint(0, 5, (400,))
    scale = torch.rand(400) * 3
    x = torch.zeros(400, 5)
    x[torch.arange(400), columns] = scale
    direct = float((((q - w) @ x.T) ** 2).sum(0).mean())
    imatrix = (x * x).mean(0)
    assert weighted_error(w, q, imatrix) == pytest.approx(direct, rel=1e-5)
    rows = torch.rand(6)
    assert weighted_error(w, q, row_weight=rows) == pytest.approx(float((rows[:, None] * (q - w) ** 2).sum()),
                                                                  rel=1e-6)


def test_token_frequencies_are_the_embedding_lookups_second_moment():
    chunks = torch.tensor([[1, 2, 2], [2, 0, 7]])
    f = token_frequencies(chunks, 8)
    assert f.tolist() == [1 / 6, 1 / 6, 3 / 6, 0, 0, 0, 0, 1 / 6]


def _layer_inputs(model_dir, chunks, layer):
    """Each linear's mean x^2 per input column, by transformers' own forward (hooks), not cardfit's walk."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    sums, counts, hooks = {}, {}, []
    for name, module in model.model.layers[layer].named_modules():
        if isinstance(module, torch.nn.Linear):
            full = f"model.layers.{layer}.{name}.weight"

            def hook(mod, args, out, full=full):
                x = args[0].reshape(-1, args[0].shape[-1]).double()
                sums[full] = sums.get(full, 0) + (x * x).sum(0)
                counts[full] = counts.get(full, 0) + x.shape[0]
            hooks.append(module.register_forward_hook(hook))
    with torch.no_grad():
        model(chunks)
    return {n: (sums[n] / counts[n]).float() for n in sums}


def test_weight_cells_equal_the_slow_way(tiny_models, tmp_path):
    """A layer's cell = sum over its matrices of imatrix-weighted squared error, the imatrix taken from
    transformers' own forward of the calibration tokens; the tied embedding adds token frequency and the
    final norm's weighting; the map records how every cell was priced."""
    from transformers import AutoTokenizer

    from cardfit.sources import open_model
    from cardfit.text import token_chunks

    text = small_text(tmp_path)
    model = tiny_models["qwen2"]
    result = run_scan(model, text, tmp_path / "w.json", method="weight")
    assert result["complete"] and result["damage"]["method"].startswith("weight")
    assert "E||dW x||^2" in result["damage"]["metric"]
    assert all(c["method"] == "weight" and c["stderr"] is None for g in result["groups"] for c in g["cells"].values())
    source = open_model(model)
    chunks = token_chunks(AutoTokenizer.from_pretrained(str(model)), text.read_text(), 32, 256)
    inputs = _layer_inputs(model, chunks, 1)
    cells = next(g for g in result["groups"] if g["name"] == "layers.1")["cells"]
    for fmt_name in FORMATS.split(","):
        fmt = get_format(fmt_name)
        slow = sum(weighted_error(source.read(n), fmt.roundtrip(n, source.read(n)), imatrix)
                   for n, imatrix in inputs.items())
        assert cells[fmt_name]["damage"] == pytest.approx(slow, rel=1e-4), fmt_name
    embed = next(g for g in result["groups"] if g["name"] == "embed")["cells"]
    name = "model.embed_tokens.weight"
    weight = source.read(name)
    frequency_part = weighted_error(weight, get_format("Q2_K").roundtrip(name, weight),
                                    row_weight=token_frequencies(chunks, weight.shape[0]))
    assert embed["Q2_K"]["damage"] > frequency_part > 0  # the head's part adds to the lookup's


def test_weight_signal_orders_formats_and_plans(tiny_models, tmp_path):
    """Fewer bits, more error, in every group; a weight map plans, and the recipe says what it summed."""
    from cardfit.plan import plan

    text = small_text(tmp_path)
    result = run_scan(tiny_models["llama"], text, tmp_path / "w.json", method="weight")
    for g in result["groups"]:
        if g["name"] != "norm":
            d = [g["cells"][f]["damage"] for f in FORMATS.split(",")]
            assert d[0] < d[1] <= d[2], g["name"]  # Q2_K falls back to Q4_0 on 64-wide rows
    sizes = [sum(g["bytes"][f] for g in result["groups"]) for f in FORMATS.split(",")]
    recipe = plan(tmp_path / "w.json", (sizes[0] + sizes[2]) // 2)
    assert recipe["map"]["damage"]["metric"] == result["damage"]["metric"]
    assert len({g["format"] for g in recipe["groups"] if g["name"] != "norm"}) > 1


def test_weight_scan_resumes_to_the_same_bytes_and_is_its_own_job(tiny_models, tmp_path):
    text = small_text(tmp_path)
    whole = tmp_path / "whole.json"
    run_scan(tiny_models["llama"], text, whole, method="weight")
    partial = json.loads(whole.read_text())
    for g in partial["groups"][2:]:
        g["cells"] = {}
    partial["complete"] = False
    partial.pop("separable_fraction")
    resumed = tmp_path / "resumed.json"
    resumed.write_text(json.dumps(partial, indent=2))
    run_scan(tiny_models["llama"], text, resumed, method="weight", resume=True)
    assert json.loads(resumed.read_text()) == json.loads(whole.read_text())
    with pytest.raises(CardfitError, match="another model, text or settings"):
        scan(tiny_models["llama"], text, out=whole, max_tokens=256, formats=FORMATS, seq_len=32, progress=False,
             resume=True)  # an exact scan never finishes a weight map


@pytest.mark.parametrize("kind,signal", [("llama", "fast"), ("qwen2", "fast"), ("llama", "weight")])
def test_adaptive_recipe_equals_the_exact_recipe_at_the_budgets_asked(tiny_models, tmp_path, kind, signal):
    """Exact where the plan is decided, estimated elsewhere (by either signal): the same recipes as the
    full exact map, for fewer exact cells; every estimated cell says so."""
    from cardfit.pack import reserve_bytes
    from cardfit.plan import plan
    from cardfit.sources import open_model

    text = small_text(tmp_path)
    reserve = reserve_bytes(open_model(tiny_models[kind]), "llama.cpp")
    exact = run_scan(tiny_models[kind], text, tmp_path / "exact.json", formats="Q8_0,Q6_K,Q5_K,Q4_K,Q3_K,Q2_K")
    fmts = exact["formats"]
    sizes = [sum(g["bytes"][f] for g in exact["groups"]) for f in fmts]
    budgets = [reserve + int(sizes[-1] + (sizes[0] - sizes[-1]) * share) for share in (0.3, 0.7)]
    said = []
    adaptive = run_scan(tiny_models[kind], text, tmp_path / "adaptive.json", formats=",".join(fmts),
                        method="adaptive", weight_budgets=budgets, signal=signal, log=said.append)
    assert adaptive["adaptive"]["signal"] == signal
    rounds = [k for k, line in enumerate(said) if line.startswith("adaptive round ")]
    assert rounds and all(re.fullmatch(r"  about \d+ (seconds|minutes) on this device"
                                       + (", the reference pass included" if n == 0 else ""), said[k + 1])
                          for n, k in enumerate(rounds))  # each round's time said before it is measured
    with pytest.raises(CardfitError, match=f"priced by the {signal} signal"):  # never a map of two signals
        run_scan(tiny_models[kind], text, tmp_path / "adaptive.json", formats=",".join(fmts), method="adaptive",
                 weight_budgets=budgets, signal={"fast": "weight", "weight": "fast"}[signal], resume=True)
    cells = [c for g in adaptive["groups"] for c in g["cells"].values()]
    estimated = [c for c in cells if c.get("method") == "estimate"]
    assert estimated and all(c["stderr"] is None and c["signal"] >= 0 for c in estimated)
    assert any(c["signal"] > 0 for c in estimated)
    assert adaptive["adaptive"]["exact_cells"] == len(cells) - len(estimated)
    for g, e in zip(adaptive["groups"], exact["groups"]):  # measured cells are the exact scan's bits
        for f, c in g["cells"].items():
            if c.get("method") is None:
                assert c["damage"] == e["cells"][f]["damage"]
    for budget in budgets:
        want = [g["format"] for g in plan(tmp_path / "exact.json", budget, reserve_bytes=reserve)["groups"]]
        got = [g["format"] for g in plan(tmp_path / "adaptive.json", budget, reserve_bytes=reserve)["groups"]]
        assert got == want, budget


def test_adaptive_needs_budgets(tiny_models, tmp_path, run_cli):
    code, out, err = run_cli("scan", str(tiny_models["llama"]), "--method", "adaptive", "--out", str(tmp_path / "m.json"))
    assert code == 2 and "--weight-budget" in err and not (tmp_path / "m.json").exists()
    code, out, err = run_cli("scan", str(tiny_models["llama"]), "--weight-budget", "1MiB", "--out",
                             str(tmp_path / "m.json"))
    assert code == 2 and "--method adaptive" in err
    code, out, err = run_cli("scan", str(tiny_models["llama"]), "--method", "adaptive", "--weight-budget", "1KiB",
                             "--out", str(tmp_path / "m.json"))
    assert code == 2 and "minimum achievable" in err and not (tmp_path / "m.json").exists()


def test_the_signal_is_an_adaptive_scan_s_and_the_fisher_prices_rtn_and_imatrix_only(tiny_models, tmp_path, run_cli):
    model, out = str(tiny_models["llama"]), tmp_path / "m.json"
    code, _, err = run_cli("scan", model, "--signal", "fast", "--out", str(out))
    assert code == 2 and "--method adaptive" in err
    adaptive = ["scan", model, "--method", "adaptive", "--weight-budget", "1MiB", "--out", str(out)]
    code, _, err = run_cli(*adaptive, "--rounding", "awq", "--signal", "fast")
    assert code == 2 and "--signal weight" in err and "not awq" in err
    code, _, err = run_cli("scan", model, "--method", "fast", "--rounding", "awq", "--out", str(out))
    assert code == 2 and "--method weight or exact" in err
    code, _, err = run_cli(*adaptive, "--signal", "exact")
    assert code == 2 and "unknown --signal 'exact'" in err and "fast or weight" in err
    assert not out.exists()


def test_adaptive_recipe_equals_the_exact_recipe_on_the_embedded_model(default_model_dir, tmp_path):
    """The acceptance on a real model: over a six-format menu, the recipes at two budgets are the exact
    map's, though most cells were only estimated (the Fisher's; the saving grows with the menu's length,
    see docs/benchmarks.md)."""
    from cardfit.pack import reserve_bytes
    from cardfit.plan import plan
    from cardfit.sources import open_model

    reserve = reserve_bytes(open_model(default_model_dir), "llama.cpp")
    menu = "Q8_0,Q6_K,Q5_K,Q4_K,Q3_K,Q2_K"
    exact = scan(default_model_dir, None, max_tokens=128, formats=menu, seq_len=128, out=tmp_path / "exact.json",
                 progress=False)
    fmts = exact["formats"]
    sizes = [sum(g["bytes"][f] for g in exact["groups"]) for f in fmts]
    budgets = [reserve + int(sizes[-1] + (sizes[0] - sizes[-1]) * share) for share in (0.25, 0.6)]
    adaptive = scan(default_model_dir, None, max_tokens=128, formats=menu, seq_len=128, progress=False,
                    out=tmp_path / "adaptive.json", method="adaptive", weight_budgets=budgets)
    cells = len(exact["groups"]) * len(fmts)
    for budget in budgets:
        want = [g["format"] for g in plan(tmp_path / "exact.json", budget, reserve_bytes=reserve)["groups"]]
        got = [g["format"] for g in plan(tmp_path / "adaptive.json", budget, reserve_bytes=reserve)["groups"]]
        assert got == want, budget
    assert adaptive["adaptive"]["exact_cells"] <= 0.6 * cells  # 102 of 192; choices ± a byte-step took 153


def _imatrix_matrix(rows, columns, seed=0):
    """A weight with outlier columns and an imatrix with a heavy tail, as real layers have."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=g) * 0.02
    weight[:, ::97] *= 8
    weight[::13] *= 3
    imatrix = torch.rand(columns, generator=g) ** 4 + 1e-3
    return weight, imatrix


@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "Q4_0", "IQ4_XS", "IQ4_NL", "Q3_K",
                                       "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_S", "IQ2_XXS", "IQ1_S"])
def test_rows_cut_from_a_matrix_round_as_inside_it_with_an_imatrix(type_name):
    """The premise of pricing from a sample of rows: ggml rounds every row apart from the others, its
    importance matrix per column, so rows cut out come back the same bits, for every type."""
    from cardfit.formats.base import Calibration

    fmt = get_format(type_name)
    assert fmt.rows_apart("imatrix") and not fmt.rows_apart("awq")
    weight, imatrix = _imatrix_matrix(24, 512)
    calibration = Calibration(imatrix=imatrix)
    whole = fmt.roundtrip("blk.w", weight, calibration, "imatrix")
    picked = torch.tensor([0, 3, 4, 13, 23])
    assert torch.equal(fmt.roundtrip("blk.w", weight[picked], calibration, "imatrix"), whole[picked])


class _Columns:
    def __init__(self, imatrix, rows=None):
        self.imatrix, self.rows = imatrix, rows

    def rounding(self, tensor):
        from cardfit.formats.base import Calibration

        return Calibration(imatrix=self.imatrix)

    def weightings(self, tensor):
        return [(self.imatrix, None)] + ([(None, self.rows)] if self.rows is not None else [])


class _Tensor:
    name, group = "model.layers.0.mlp.down_proj.weight", "layers.0"


def test_a_sample_of_every_row_is_the_whole_price(monkeypatch):
    from cardfit.scan.signals import sampling
    from cardfit.scan.signals.weight import tensor_error

    weight, imatrix = _imatrix_matrix(256, 1024)
    rows = torch.rand(256, dtype=torch.float64)
    stats = _Columns(imatrix, rows)
    fmt = get_format("IQ3_XXS")
    whole = tensor_error(_Tensor, weight, fmt, "imatrix", stats, sample=False)
    quantized = fmt.roundtrip(_Tensor.name, weight, stats.rounding(_Tensor), "imatrix")
    assert whole == pytest.approx(weighted_error(weight, quantized, imatrix)
                                  + weighted_error(weight, quantized, row_weight=rows), rel=1e-9)
    monkeypatch.setattr(sampling, "SAMPLE_SHARE", 1)
    monkeypatch.setattr(sampling, "SAMPLE_FLOOR", 1 << 10)
    monkeypatch.setattr(sampling, "EARLY", 1)  # no first draw: every row
    assert tensor_error(_Tensor, weight, fmt, "imatrix", stats) == pytest.approx(whole, rel=1e-9)


@pytest.mark.parametrize("type_name", ["IQ3_XXS", "IQ2_XXS", "Q4_K", "Q8_0", "Q2_K"])
def test_a_sixteenth_of_the_rows_prices_the_matrix_within_a_few_percent(type_name, monkeypatch):
    """One row in sixteen, drawn where its imatrix-weighted error is expected and weighted by the inverse of
    its chance, prices the whole within 5 % under several draws; the draws differ by seed."""
    from cardfit.scan.signals import sampling
    from cardfit.scan.signals.weight import tensor_error

    weight, imatrix = _imatrix_matrix(2048, 1024)
    monkeypatch.setattr(sampling, "SAMPLE_FLOOR", 1 << 14)  # so 1/16 of this matrix is what is drawn
    monkeypatch.setattr(sampling, "MAX_RELATIVE_ERROR", float("inf"))  # never the whole: the sample alone
    monkeypatch.setattr(sampling, "EARLY", 1)  # and that sample, not a quarter of it
    fmt, stats = get_format(type_name), _Columns(imatrix)
    whole = tensor_error(_Tensor, weight, fmt, "imatrix", stats, sample=False)
    estimates = [tensor_error(_Tensor, weight, fmt, "imatrix", stats, seed=seed) for seed in range(4)]
    assert all(abs(e / whole - 1) < 0.05 for e in estimates), (whole, estimates)
    assert len(set(estimates)) == 4
    monkeypatch.setattr(sampling, "MAX_RELATIVE_ERROR", 0.02)
    drawn = []
    monkeypatch.setattr(sampling, "sampled_total", lambda *a, t=sampling.sampled_total, **k: drawn.append(t(*a, **k))
                        or drawn[-1])
    priced = tensor_error(_Tensor, weight, fmt, "imatrix", stats)
    (estimate, error), = drawn  # the draw's stated error decides: its estimate, or the whole matrix's price
    assert estimate == estimates[0] and priced == (estimate if error <= 0.02 * estimate else whole)


def test_a_matrix_the_sample_cannot_decide_is_priced_whole(monkeypatch):
    """A tensor stored on a grid and re-rounded onto it costs ~0 but in a few rows; a sample catches or misses
    them, its stated error says so, and the whole matrix is priced instead (exactly)."""
    from cardfit.scan.signals import sampling
    from cardfit.scan.signals.weight import tensor_error

    weight, imatrix = _imatrix_matrix(2048, 1024)
    fmt, stats = get_format("Q4_0"), _Columns(imatrix)
    weight = fmt.roundtrip(_Tensor.name, weight)  # already on Q4_0's grid ...
    weight[[7, 900, 1500]] += 0.05 * torch.randn(3, 1024)  # ... but for three rows
    monkeypatch.setattr(sampling, "SAMPLE_FLOOR", 1 << 14)
    whole = tensor_error(_Tensor, weight, fmt, "rtn", stats, sample=False)
    assert tensor_error(_Tensor, weight, fmt, "rtn", stats) == whole
    guide = sampling.scale_guide(weight, imatrix)
    estimate, error = sampling.sampled_total(guide, lambda taken: 3 * guide[taken], 128)
    assert estimate == pytest.approx(3 * float(guide.sum())) and error < 1e-9 * estimate  # what the guide predicts


def test_the_weight_scan_prices_large_matrices_from_a_sample_of_rows(tiny_models, tmp_path, monkeypatch):
    """With the floor lowered below the tiny model's matrices, every weight cell comes from a sample of rows
    and stays within a few percent of the whole round trips'."""
    from cardfit.scan.signals import sampling
    from cardfit.scan.signals import weight as weight_signal

    model, text = tiny_models["qwen2"], small_text(tmp_path)
    whole = run_scan(model, text, tmp_path / "whole.json", method="weight", rounding="imatrix")
    calls = []
    sampled_total = sampling.sampled_total
    monkeypatch.setattr(sampling, "SAMPLE_FLOOR", 1 << 11)
    monkeypatch.setattr(sampling, "sampled_total",
                        lambda guide, *a, **k: calls.append(len(guide)) or sampled_total(guide, *a, **k))
    drawn = run_scan(model, text, tmp_path / "drawn.json", method="weight", rounding="imatrix")
    assert calls
    for w, d in zip(whole["groups"], drawn["groups"]):
        for f, cell in w["cells"].items():
            assert d["cells"][f]["damage"] == pytest.approx(cell["damage"], rel=0.1, abs=1e-12), (w["name"], f)


def test_a_first_quarter_draw_prices_alone_where_it_decides_and_the_full_draw_follows_where_not(monkeypatch):
    """sampled_or_whole draws a quarter of the sample first (the same seeded uniforms, so its units are among the
    full draw's): stated within MAX_RELATIVE_ERROR it is the price, no more is rounded; otherwise the full sample,
    then the whole."""
    from cardfit.scan.signals import sampling

    guide = torch.rand(4096, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) + 0.5
    asked = []

    def price(taken, noise=0.0):
        asked.append(len(taken))
        return guide[taken] * (1 + noise * torch.randn(len(taken), dtype=torch.float64))

    assert sampling.sampled_or_whole(guide, price, 256, lambda: -1.0) == pytest.approx(float(guide.sum()))
    assert len(asked) == 1 and 40 < asked[0] < 90  # about 64 units: the quarter alone
    asked.clear()
    noisy = sampling.sampled_or_whole(guide, lambda t: price(t, 0.5), 256, lambda: -1.0)
    assert len(asked) == 2 and asked[1] > 3 * asked[0]  # the quarter stated too much: the full draw
    assert noisy == -1.0 or abs(noisy / float(guide.sum()) - 1) < 0.1
    asked.clear()
    assert sampling.sampled_or_whole(guide, lambda t: price(t, 5.0), 256, lambda: -1.0) == -1.0  # neither decides
    assert len(asked) == 2


def test_a_draw_of_nothing_or_an_unscaled_row_is_never_a_price(monkeypatch):
    """A row no ggml scale divides (stored F16) gets a per-value guide rather than a crash; a draw that takes no
    unit states an unbounded error, so the caller prices the whole."""
    from cardfit.scan.signals import sampling

    weight = torch.randn(600, 1000)
    assert sampling.scale_guide(weight, torch.rand(1000)).shape == (600,)
    guide = sampling.scale_guide(weight, None)
    assert sampling.sampled_total(guide, lambda taken: guide[taken], 0) == (0.0, float("inf"))
    assert sampling.sampled_or_whole(guide, lambda taken: guide[taken], 0, lambda: 42.0) == 42.0


def _belongs(path, scanned: dict) -> bool:
    from cardfit.imatrix import job_key, made_from

    return made_from(path, job_key(scanned["model"], scanned["calibration"]))


def _imatrix_tensors(path):
    import gguf
    import numpy as np

    return {t.name: np.asarray(t.data).copy() for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # an untied output matrix, and a tied one
def test_the_pricing_walk_leaves_the_imatrix_cardfit_imatrix_makes(tiny_models, tmp_path, kind, monkeypatch):
    """One forward for both: the weight signal's walk records llama.cpp's imatrix of the map's own tokens, the
    same entries `cardfit imatrix` collects over those tokens; the separate walk does not run."""
    import numpy as np

    from cardfit import imatrix as imatrix_module
    from cardfit.imatrix import collect_imatrix

    text = small_text(tmp_path)
    model = tiny_models[kind]
    alone = tmp_path / "alone.gguf"
    collect_imatrix(model, text, max_tokens=256, seq_len=32, out=alone, progress=False)
    walks = []
    monkeypatch.setattr(imatrix_module, "collect_imatrix", lambda *a, **k: walks.append(a))
    recorded = tmp_path / "scan.gguf"
    result = run_scan(model, text, tmp_path / "map.json", method="weight", rounding="imatrix", imatrix_out=recorded)
    assert walks == [] and _belongs(recorded, result)
    want, got = _imatrix_tensors(alone), _imatrix_tensors(recorded)
    assert sorted(got) == sorted(want) and any(n.startswith("blk.1.") for n in got)
    assert ("output.weight.in_sum2" in got) == (kind == "llama")  # a tied head is the embedding: a lookup, no entry
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)


def test_a_scan_with_nothing_to_price_still_leaves_its_imatrix(tiny_models, tmp_path):
    """A finished map resumed (or an exact scan) walks for the imatrix alone; one of the same tokens already
    there is kept, one of other tokens is made again."""
    text = small_text(tmp_path)
    model, out, imatrix = tiny_models["llama"], tmp_path / "map.json", tmp_path / "im.gguf"
    result = run_scan(model, text, out, method="weight", rounding="imatrix", imatrix_out=imatrix)
    first = imatrix.read_bytes()
    imatrix.unlink()
    run_scan(model, text, out, method="weight", rounding="imatrix", imatrix_out=imatrix, resume=True)
    assert imatrix.read_bytes() == first
    stamp = imatrix.stat().st_mtime_ns
    run_scan(model, text, out, method="weight", rounding="imatrix", imatrix_out=imatrix, resume=True)
    assert imatrix.stat().st_mtime_ns == stamp  # kept
    with pytest.raises(CardfitError, match="another scan"):  # another job's scan never takes this map's imatrix
        run_scan(model, text, tmp_path / "short.json", method="weight", rounding="imatrix", imatrix_out=imatrix,
                 max_tokens=128)
    assert imatrix.read_bytes() == first and not (tmp_path / "short.json").exists()
    exact = run_scan(model, text, tmp_path / "exact.json", imatrix_out=tmp_path / "exact.gguf")
    assert _belongs(tmp_path / "exact.gguf", exact)


def test_imatrix_out_is_refused_before_work_where_it_cannot_be_written(tiny_models, tmp_path, run_cli):
    model, text = tiny_models["llama"], small_text(tmp_path)
    out = tmp_path / "map.json"
    for extra, message in [(["--imatrix-out", str(out)], "map"), (["--imatrix-out", str(tmp_path / "im.dat")], ".gguf"),
                           (["--imatrix-out", str(tmp_path / "im.gguf"), "--estimate"], "--estimate")]:
        code, _, err = run_cli("scan", model, "--calibration", text, "--max-tokens", "256", "--seq-len", "32",
                               "--out", out, *extra)
        assert code == 2 and message in err.strip().splitlines()[-1], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt"]


def test_an_imatrix_belongs_to_its_model_and_a_file_not_a_scan_s_is_never_replaced(tiny_models, tmp_path, run_cli):
    """Same text, tokens and chunks but another model: that scan is refused the first one's imatrix (its maps'
    packs round with it) and makes its own elsewhere; a file at --imatrix-out that no cardfit scan wrote (a
    user's own imatrix, anything else) is refused before work too, and each is left as it was."""
    text = small_text(tmp_path)
    imatrix = tmp_path / "im.gguf"
    first = run_scan(tiny_models["llama"], text, tmp_path / "a.json", method="weight", rounding="imatrix",
                     imatrix_out=imatrix)
    kept = imatrix.read_bytes()
    code, _, err = run_cli("scan", tiny_models["qwen2"], "--calibration", text, "--max-tokens", "256", "--seq-len",
                           "32", "--method", "weight", "--rounding", "imatrix", "--out", tmp_path / "b.json",
                           "--imatrix-out", imatrix)
    assert code == 2 and "another scan" in err.strip().splitlines()[-1], err
    assert imatrix.read_bytes() == kept and not (tmp_path / "b.json").exists()
    second = run_scan(tiny_models["qwen2"], text, tmp_path / "b.json", method="weight", rounding="imatrix",
                      imatrix_out=tmp_path / "other.gguf")
    assert first["calibration"] == second["calibration"]
    assert _belongs(tmp_path / "other.gguf", second) and _belongs(imatrix, first) and not _belongs(imatrix, second)
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(b"GGUF" + bytes(60))
    code, _, err = run_cli("scan", tiny_models["llama"], "--calibration", text, "--max-tokens", "256", "--seq-len", "32",
                           "--out", tmp_path / "c.json", "--imatrix-out", mine)
    assert code == 2 and "not the imatrix of a cardfit scan" in err.strip().splitlines()[-1]
    assert mine.read_bytes() == b"GGUF" + bytes(60) and not (tmp_path / "c.json").exists()
