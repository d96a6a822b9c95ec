"""The streamed Fisher (scan --method fast) against the whole-model computation it replaces."""

import pytest
import torch

from cardfit.scan.signals.fisher import streamed_fisher
from cardfit.sources import open_model
from cardfit.text import token_chunks

from test_scan import small_text


def _resident_fisher(model_dir, chunks, samples=2, batch=4, seed=0) -> dict[str, torch.Tensor]:
    """The slow way: the whole transformers model in float32, one backward per batch and sample, labels
    sampled from its own softmax; squared gradients averaged per token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, use_safetensors=True)
    params = dict(model.named_parameters())
    fisher = {n: torch.zeros_like(p) for n, p in params.items()}
    generator = torch.Generator().manual_seed(seed)
    for i in range(0, len(chunks), batch):
        ids = chunks[i:i + batch]
        for _ in range(samples):
            model.zero_grad(set_to_none=True)
            logits = model(ids).logits.to(torch.float32)
            with torch.no_grad():
                probs = torch.softmax(logits, dim=-1).reshape(-1, logits.shape[-1])
                labels = torch.multinomial(probs, 1, generator=generator).reshape(logits.shape[:-1])
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                              reduction="sum").backward()
            for n, p in params.items():
                if p.grad is not None:
                    fisher[n] += p.grad ** 2
    return {n: f / (chunks.numel() * samples) for n, f in fisher.items()}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma3", "gemma3-softcap", "mixtral", "gpt-oss"])
def test_streamed_fisher_is_the_whole_model_fisher(tiny_model, tmp_path, kind):
    """Untied head, tied head (head and lookup gradients summed before squaring), scaled embedding,
    soft-capped logits, routed experts (each expert's slice of its fused stack, gpt-oss's cut from in x out
    interleaved columns): the layer-at-a-time backward gives the same Fisher as autograd over the whole
    model, in the order the groups become final."""
    from transformers import AutoTokenizer

    model_dir = tiny_model(kind)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    chunks = token_chunks(tokenizer, small_text(tmp_path).read_text(), 32, 6 * 32)
    want = _resident_fisher(model_dir, chunks)
    got, order = {}, []

    def take(fisher):
        order.append(sorted(fisher))
        assert not set(fisher) & set(got), "a tensor handed over twice"
        got.update(fisher)

    source = open_model(model_dir)
    streamed_fisher(source, chunks, take, batch=4)  # 6 chunks: a full batch and a short one
    from cardfit.checkpoint_map import placements

    place = placements(source.geometry.model_type, list(got), set(want))  # per-expert tensors: stack slices
    want = {n: place[n].view(want[place[n].param]) for n in got if place[n].param in want}
    assert set(got) == set(want)
    for name, value in want.items():
        scale = float(value.abs().max())
        assert scale > 0, name
        assert torch.allclose(got[name], value, rtol=1e-3, atol=1e-5 * scale), name
    top = open_model(model_dir).geometry.num_layers - 1
    assert any("norm" in n for n in order[0]) and ("lm_head.weight" in order[0]) == (not source.tied_embeddings)
    assert all(f"layers.{top}." in n for n in order[1])  # then the layers, top down
    assert any("embed_tokens" in n for n in order[-1])


def test_formats_priced_on_threads_give_the_sequential_cells(tiny_model, tmp_path, monkeypatch):
    """A tensor too small for ggml to spread its rows has its formats priced on a thread per core
    (ggml_lib.over_items); the cells are the same bits as one format after another."""
    from cardfit.formats import ggml_lib
    from cardfit.scan import scan

    model_dir = tiny_model("llama")
    cells = {}
    for cores in (2, 1):
        monkeypatch.setattr(ggml_lib, "_cores", lambda cores=cores: cores)
        result = scan(model_dir, small_text(tmp_path), 128, "Q8_0,Q5_1,Q4_K,Q3_K,Q2_K", out=tmp_path / f"{cores}.json",
                      seq_len=32, progress=False, device="cpu", method="fast")
        cells[cores] = {(g["name"], f): c["damage"] for g in result["groups"] for f, c in g["cells"].items()}
    assert cells[2] == cells[1] and len(cells[1]) > 10 and all(v >= 0 for v in cells[1].values())


@pytest.mark.parametrize("method", ["exact", "fast"])
def test_formats_that_round_a_tensor_alike_round_it_once(tiny_model, tmp_path, monkeypatch, method):
    """The tiny model's 64-wide rows fall back from every K-quant (Q4_K stores Q5_0, Q2_K and Q3_K store
    Q4_0): the scan and the Fisher's pricing round each such tensor once for all the formats that store
    it alike, and those formats' cells are the same values."""
    from cardfit.formats import GgmlFormat
    from cardfit.scan import scan

    calls = []
    roundtrip = GgmlFormat.roundtrip

    def counted(self, name, weight, *args, **kwargs):
        calls.append((self.name, name))
        return roundtrip(self, name, weight, *args, **kwargs)

    monkeypatch.setattr(GgmlFormat, "roundtrip", counted)
    result = scan(tiny_model("llama"), small_text(tmp_path), 128, "Q4_K,Q5_0,Q3_K,Q2_K,Q4_0,Q8_0",
                  out=tmp_path / "map.json", seq_len=32, progress=False, device="cpu", method=method)
    for g in result["groups"]:
        cells = {f: c["damage"] for f, c in g["cells"].items()}
        assert cells["Q4_K"] == cells["Q5_0"] and cells["Q3_K"] == cells["Q2_K"] == cells["Q4_0"], g["name"]
    layer_calls = [name for _, name in calls if ".layers." in name]  # the exact scan sweeps the embedding and
    # the head a format at a time (the largest copies are held one at a time), so only layers share
    assert len(layer_calls) == 3 * len(set(layer_calls)) > 0  # Q5_0, Q4_0, Q8_0 storage: 3 round trips, not 6


def _heavy_matrix(rows, columns, seed=0):
    """A weight with a few outlier columns and a Fisher with heavy tails, as real layers have."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=g) * 0.02
    weight[:, ::97] *= 8
    fisher = torch.rand(rows, columns, generator=g) ** 6 * torch.rand(1, columns, generator=g) ** 2
    return weight, fisher


@pytest.mark.parametrize("storage", ["IQ4_NL", "IQ4_XS", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1",
                                     "Q4_0", "Q3_K", "IQ3_S", "Q2_K"])
def test_a_block_cut_from_its_matrix_rounds_as_inside_it(storage):
    """The premise of pricing from a sample of blocks: without an importance matrix ggml rounds each of a
    type's blocks apart from its neighbours, so blocks cut out come back the same bits."""
    from cardfit.formats.gguf_formats import ggml_roundtrip
    from cardfit.formats.ggml_types import GGML_BLOCKS

    unit = GGML_BLOCKS[storage][0]
    weight, _ = _heavy_matrix(64, 1024)
    whole = ggml_roundtrip(storage, weight).reshape(-1, unit)
    picked = torch.tensor([0, 5, 6, 77, 130, 255])
    assert torch.equal(ggml_roundtrip(storage, weight.reshape(-1, unit)[picked]), whole[picked])


def test_a_sample_of_every_block_is_the_whole_price(monkeypatch):
    """Drawing every block (certain inclusion) gives the whole round trip's price; the sampled path is the
    one taken (the floor lowered so this matrix is sampled)."""
    from cardfit.scan.signals import sampling
    from cardfit.scan.signals.fisher import predicted_kl, sampled_kl
    from cardfit.formats.gguf_formats import ggml_roundtrip

    weight, fisher = _heavy_matrix(256, 1024)
    monkeypatch.setattr(sampling, "SAMPLE_SHARE", 1)
    monkeypatch.setattr(sampling, "EARLY", 1)  # no first draw: every block
    whole = predicted_kl(fisher, weight, ggml_roundtrip("IQ4_NL", weight))
    assert sampled_kl(fisher, weight, "IQ4_NL") == pytest.approx(whole, rel=1e-4)  # the whole's float32 dot


@pytest.mark.parametrize("storage", ["IQ4_NL", "IQ4_XS", "Q4_K", "Q8_0", "Q2_K"])
def test_a_sixteenth_of_the_blocks_prices_the_matrix_within_a_few_percent(storage, monkeypatch):
    """On a matrix with outlier columns and a heavy-tailed Fisher, one block in sixteen, drawn where its
    error is expected and weighted by the inverse of its chance, prices the whole within 5 % under several
    draws (an unweighted sum would be a sixteenth of it)."""
    from cardfit.scan.signals import sampling
    from cardfit.scan.signals.fisher import predicted_kl, sampled_kl
    from cardfit.formats.gguf_formats import ggml_roundtrip

    weight, fisher = _heavy_matrix(1024, 2048)
    monkeypatch.setattr(sampling, "MAX_RELATIVE_ERROR", float("inf"))  # never the whole: the sample alone
    monkeypatch.setattr(sampling, "SAMPLE_FLOOR", 1 << 14)  # so 1/16 of this matrix is what is drawn
    monkeypatch.setattr(sampling, "EARLY", 1)  # and that sample, not a quarter of it
    whole = predicted_kl(fisher, weight, ggml_roundtrip(storage, weight))
    estimates = [sampled_kl(fisher, weight, storage, seed=seed) for seed in range(4)]
    assert all(abs(e / whole - 1) < 0.05 for e in estimates), (whole, estimates)
    assert len(set(estimates)) == 4  # the seeds draw differently; one seed is one map


def test_the_cheap_signal_samples_only_large_block_quantized_matrices():
    from cardfit.scan.signals.fisher import sampled
    from cardfit.scan.signals.sampling import SAMPLE_FLOOR

    assert sampled("IQ4_XS", 2 * SAMPLE_FLOOR) and sampled("Q4_K", 10 * SAMPLE_FLOOR)
    assert not sampled("IQ4_NL", 2 * SAMPLE_FLOOR - 1) and not sampled("F16", 100 * SAMPLE_FLOOR)
    assert not sampled("BF16", 100 * SAMPLE_FLOOR) and not sampled("W4A16-g128", 100 * SAMPLE_FLOOR)


def test_the_fast_scan_prices_large_matrices_from_a_sample(tiny_model, tmp_path, monkeypatch):
    """With the floor lowered below the tiny model's matrices, the fast scan's cells come from sampled_kl
    (each matrix once per distinct rounding) and stay within a few percent of the whole round trips' cells."""
    from cardfit.scan.signals import fisher as fisher_module
    from cardfit.scan.signals import sampling
    from cardfit.scan import scan

    model_dir, text = tiny_model("llama"), small_text(tmp_path)
    common = dict(max_tokens=128, formats="Q8_0,IQ4_NL,Q4_0", seq_len=32, progress=False, device="cpu", method="fast")
    whole = scan(model_dir, text, out=tmp_path / "whole.json", **common)
    calls = []
    sampled_kl = fisher_module.sampled_kl
    monkeypatch.setattr(sampling, "SAMPLE_FLOOR", 1 << 11)  # the 64x64 ones: half their blocks
    monkeypatch.setattr(fisher_module, "sampled_kl", lambda *a, **k: calls.append(a[2]) or sampled_kl(*a, **k))
    drawn = scan(model_dir, text, out=tmp_path / "drawn.json", **common)
    assert calls and set(calls) == {"IQ4_NL", "Q8_0", "Q4_0"}
    for w, d in zip(whole["groups"], drawn["groups"]):
        for f in ("Q8_0", "IQ4_NL", "Q4_0"):
            assert d["cells"][f]["damage"] == pytest.approx(w["cells"][f]["damage"], rel=0.1), (w["name"], f)


def test_a_sample_of_every_row_is_the_whole_price_under_an_imatrix(monkeypatch):
    """A rounding with statistics treats each row apart, so its price comes from a sample of rows: drawing
    every row gives the whole round trip's price; the default draw (a quarter of these 1,024 rows, the
    floor's 2^18 values) stays within 5 % under several seeds."""
    from cardfit.scan.signals import sampling
    from cardfit.scan.signals.fisher import predicted_kl, sampled_rows_kl
    from cardfit.formats import parse_formats
    from cardfit.formats.base import Calibration

    weight, fisher = _heavy_matrix(1024, 1024)
    calibration = Calibration(imatrix=torch.rand(1024, generator=torch.Generator().manual_seed(1)) ** 4 + 1e-3)
    fmt = parse_formats("IQ3_XXS")[0]

    def roundtrip(rows):
        return fmt.roundtrip("blk.0.ffn_down.weight", rows, calibration, "imatrix")

    whole = predicted_kl(fisher, weight, roundtrip(weight))
    monkeypatch.setattr(sampling, "SAMPLE_SHARE", 1)
    monkeypatch.setattr(sampling, "EARLY", 1)
    assert sampled_rows_kl(fisher, weight, roundtrip) == pytest.approx(whole, rel=1e-4)
    monkeypatch.setattr(sampling, "SAMPLE_SHARE", 16)
    monkeypatch.setattr(sampling, "MAX_RELATIVE_ERROR", float("inf"))  # never the whole: the sample alone
    estimates = [sampled_rows_kl(fisher, weight, roundtrip, seed=seed) for seed in range(3)]
    assert all(abs(e / whole - 1) < 0.05 for e in estimates), (whole, estimates)


def test_the_fast_scan_prices_imatrix_rounding_with_the_walk_s_statistics(tiny_model, tmp_path):
    """--method fast --rounding imatrix: each cell is ½ Σ F δw² of the matrix rounded with the importance
    matrix a walk of the same tokens gives (the same one `--imatrix-out` writes, which equals `cardfit
    imatrix`'s), not RTN's; an i-quant that cannot round without one is priced in an RTN scan too."""
    import gguf

    from cardfit.engine.calibrate import rounding_statistics
    from cardfit.scan.signals.fisher import predicted_kl, streamed_fisher
    from cardfit.formats import parse_formats
    from cardfit.imatrix import collect_imatrix
    from cardfit.scan import scan
    from cardfit.sources import runnable
    from cardfit.text import load_tokenizer

    model_dir, text = tiny_model("llama"), small_text(tmp_path)
    common = dict(max_tokens=128, formats="Q4_0,Q2_K,IQ2_XXS", seq_len=32, progress=False, device="cpu",
                  method="fast")
    rtn = scan(model_dir, text, out=tmp_path / "rtn.json", **common)
    made = scan(model_dir, text, out=tmp_path / "imatrix.json", rounding="imatrix",
                imatrix_out=tmp_path / "scan.gguf", **common)
    source = runnable(open_model(model_dir))
    chunks = token_chunks(load_tokenizer(str(source.path)), text.read_text(), 32, 128)
    statistics = rounding_statistics(source, chunks, {"imatrix"}, "cpu")
    fisher = {}
    streamed_fisher(source, chunks, fisher.update)
    name = "model.layers.1.mlp.down_proj.weight"
    layer = next(g for g in made["groups"] if name in g["tensors"])
    for f in ("Q4_0", "Q2_K"):
        fmt = parse_formats(f)[0]
        want = sum(predicted_kl(fisher[t], source.read(t), fmt.roundtrip(t, source.read(t), statistics[t], "imatrix"))
                   for t in layer["tensors"] if t in statistics)
        assert layer["cells"][f]["damage"] == pytest.approx(want, rel=1e-5)
        rtn_cell = next(g for g in rtn["groups"] if g["name"] == layer["name"])["cells"][f]
        assert layer["cells"][f]["damage"] != rtn_cell["damage"]
    assert all(c["damage"] > 0 for g in rtn["groups"] if g["name"] != "norm"
               for c in g["cells"].values())  # IQ2_XXS priced in RTN too
    collect_imatrix(model_dir, text, 128, 32, tmp_path / "own.gguf", device="cpu", progress=False)
    ours, theirs = (gguf.GGUFReader(str(tmp_path / p)) for p in ("scan.gguf", "own.gguf"))
    assert {t.name: t.data.tobytes() for t in ours.tensors} == {t.name: t.data.tobytes() for t in theirs.tensors}


def test_rows_without_fisher_are_never_rounded():
    """An embedding's rows of tokens the calibration never holds have zero Fisher: they cost nothing, so only
    the other rows are rounded, and the price is the whole matrix's."""
    from cardfit.scan.signals.fisher import predicted_kl, sampled_rows_kl
    from cardfit.formats import parse_formats

    weight, fisher = _heavy_matrix(4096, 256)
    fisher[torch.arange(4096) % 50 != 0] = 0  # one row in fifty was seen
    fmt = parse_formats("Q4_0")[0]
    rounded = []

    def roundtrip(rows):
        rounded.append(len(rows))
        return fmt.roundtrip("token_embd.weight", rows, None, "rtn")

    whole = predicted_kl(fisher, weight, fmt.roundtrip("token_embd.weight", weight, None, "rtn"))
    assert sampled_rows_kl(fisher, weight, roundtrip) == pytest.approx(whole, rel=1e-5)
    assert rounded and max(rounded) <= 4096 // 50 + 1
    assert sampled_rows_kl(torch.zeros_like(fisher), weight, roundtrip) == 0.0
