"""KL through the reference's own linear head from a summary of the reference (head_kl.py)."""

import pytest
import torch

from cardfit.engine import head_kl
from cardfit.engine.head_kl import slice_kl, summarize
from cardfit.engine.metrics import kl_from_logprobs, token_kl


def _head(hidden=96, vocab=4000, positions=48, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=g) * 0.05
    b = torch.randn(vocab, generator=g) if bias else torch.zeros(vocab)
    normed = torch.randn(1, positions, hidden, generator=g) * 12
    return weight, b, normed, g


def _truth(weight, bias, n_ref, n_q) -> torch.Tensor:
    lp = torch.log_softmax(n_ref.double() @ weight.double().t() + bias.double(), -1)
    lq = torch.log_softmax(n_q.double() @ weight.double().t() + bias.double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.mark.parametrize("scale", [0.02, 0.002])  # a coarse format's perturbation, and a Q8_0-like one
@pytest.mark.parametrize("bias", [False, True])
def test_the_summary_s_kl_is_as_close_to_float64_as_the_log_softmax_form(scale, bias):
    weight, b, n_ref, g = _head(bias=bias)
    n_q = n_ref + scale * torch.randn(n_ref.shape, generator=g) * n_ref.std()
    logits = lambda n: n @ weight.t() + b  # noqa: E731  (float32, as the scan's head)
    truth = _truth(weight, b, n_ref, n_q)
    ref, tail = summarize(logits(n_ref), n_ref, weight)
    kl, top = slice_kl(logits(n_q), n_q, ref, tail)
    old = kl_from_logprobs(torch.log_softmax(logits(n_ref), -1), logits(n_q)).double()
    assert truth.mean() > 1e-6
    error, old_error = (kl - truth).abs(), (old - truth).abs()
    assert error.mean() <= 1.25 * old_error.mean() and error.max() <= 2 * old_error.max(), (error, old_error)
    assert abs(float((kl - truth).mean())) < 3e-3 * float(truth.mean())
    assert torch.equal(top, logits(n_q).argmax(-1))
    assert torch.equal(ref.argmax, logits(n_ref).argmax(-1))


@pytest.mark.parametrize("scale", [0.02, 0.002])
@pytest.mark.parametrize("bias", [False, True])
def test_a_cell_with_its_head_in_difference_form_reads_as_float64_does(scale, bias):
    """difference.head_change: the reference's float32 logits plus the head's product with the change of its
    input from bfloat16 inputs; against the summary with the rounded head's tail rows (difference_slice_kl)
    the KL stays within 0.3 % of float64's, where the same bfloat16 product of the whole input misses by far
    more (the rounding is then relative to each logit, not to its change)."""
    from cardfit.engine.difference import head_change
    from cardfit.engine.head_kl import difference_slice_kl

    weight, b, n_ref, g = _head(bias=bias)
    n_q = n_ref + scale * torch.randn(n_ref.shape, generator=g) * n_ref.std()
    truth = _truth(weight, b, n_ref, n_q)
    reference_logits = n_ref @ weight.t() + b
    ref, tails = summarize(reference_logits.clone(), n_ref, weight, rounded=True)
    assert tails.shape[-1] == 2 * weight.shape[1]
    probs = torch.softmax(reference_logits.double(), -1).scatter(-1, ref.top_ids, 0.0)
    rounded = probs @ weight.to(torch.bfloat16).double()
    assert torch.allclose(tails[..., weight.shape[1]:].double(), rounded, rtol=1e-4, atol=1e-6)
    change = (n_q - n_ref).to(torch.bfloat16).float()
    logits = head_change(reference_logits, change, weight, torch.empty_like(reference_logits))
    top_expected = logits.argmax(-1)
    kl, top = difference_slice_kl(logits, n_ref, change, ref, tails)
    assert truth.mean() > 1e-6
    assert abs(float((kl - truth).mean())) < 3e-3 * float(truth.mean()), (kl.mean(), truth.mean())
    assert torch.equal(top, top_expected)
    whole = n_q.to(torch.bfloat16).float() @ weight.to(torch.bfloat16).float().t() + b  # the whole input's bf16
    # product, rounded here rather than through oneDNN's hint (which a CPU without AMX ignores)
    plain, _ = slice_kl(whole, n_q, *summarize(n_ref @ weight.t() + b, n_ref, weight))
    assert abs(float((plain - truth).mean())) > 10 * abs(float((kl - truth).mean()))


@pytest.mark.parametrize("rows", [1, 48])
def test_the_head_s_product_rounds_its_inputs_whether_or_not_onednn_takes_the_hint(monkeypatch, rows):
    """oneDNN's bf16 fp32-precision flag is a hint it drops where it has no bfloat16 kernel for the shape (a
    CPU without AMX; one row of a 256-wide input even with it): head_change checks the first product of each
    shape and otherwise multiplies by the rounded head itself, so the logits always agree with the rounded
    tail rows of the summary."""
    import contextlib

    from cardfit.engine import difference

    weight, _, normed, g = _head(hidden=256, positions=rows)
    change = (1e-3 * torch.randn(normed.shape, generator=g)).to(torch.bfloat16).float()
    rounded = change.double() @ weight.to(torch.bfloat16).double().t()
    plain = change.double() @ weight.double().t()
    reference = torch.zeros(1, rows, weight.shape[0])
    results = []
    for hint in (difference.bfloat16_matmul_inputs, contextlib.nullcontext):  # as it is here; then dropped
        monkeypatch.setattr(difference, "bfloat16_matmul_inputs", hint)
        monkeypatch.setattr(difference, "_ROUNDS_INPUTS", {})
        results.append(difference.head_change(reference, change, weight, torch.empty_like(reference)).double())
    scale = float(rounded.abs().max())
    for got in results:
        assert float((got - rounded).abs().max()) < 1e-5 * scale
    assert float((plain - rounded).abs().max()) > 1e-3 * scale  # the two forms are told apart


def test_without_the_top_tokens_read_back_the_matmul_s_rounding_shows(monkeypatch):
    """Why TOP_TOKENS exists: the linear form alone sets an exact dot product against float32 logits."""
    weight, b, n_ref, g = _head(hidden=512, vocab=30000)
    n_q = n_ref + 0.002 * torch.randn(n_ref.shape, generator=g) * n_ref.std()
    truth = _truth(weight, b, n_ref, n_q)
    errors = {}
    for k in (0, head_kl.TOP_TOKENS):
        monkeypatch.setattr(head_kl, "TOP_TOKENS", k)
        kl, _ = slice_kl(n_q @ weight.t(), n_q, *summarize(n_ref @ weight.t(), n_ref, weight))
        errors[k] = float((kl - truth).abs().mean())
    assert errors[head_kl.TOP_TOKENS] * 3 < errors[0], errors


def test_a_logit_shift_common_to_every_token_cancels():
    """A head's rows share a mean direction, so a change of the hidden state along it moves every logit
    alike, which no distribution sees; the float32 probabilities do not sum to exactly 1, so the summary
    carries their sum (`mass`), or such a shift shows up as damage: -83 % here without it, +3 % with it
    (the log-softmax form +1 %: a shift of 5 on float32 logits, against a true KL of 3e-6)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(30000, 128, generator=g) * 0.05
    weight[:, 0] = 1.0  # hidden dimension 0 moves every logit alike
    n_ref = torch.randn(1, 64, 128, generator=g) * 12
    n_q = n_ref + 5e-4 * torch.randn(n_ref.shape, generator=g) * n_ref.std()
    n_q[..., 0] += 5.0
    truth = _truth(weight, torch.zeros(30000), n_ref, n_q)
    kl, _ = slice_kl(n_q @ weight.t(), n_q, *summarize(n_ref @ weight.t(), n_ref, weight))
    assert abs(float(kl.mean() / truth.mean()) - 1) < 0.05


def test_the_reference_against_its_own_summary_is_exactly_zero():
    weight, b, n_ref, _ = _head()
    ref, tail = summarize(n_ref @ weight.t(), n_ref, weight)
    kl, top = slice_kl(n_ref @ weight.t(), n_ref, ref, tail)
    assert torch.equal(kl, torch.zeros_like(kl)) and torch.equal(top, ref.argmax)


@pytest.mark.parametrize("kind", ["qwen2", "gemma3-softcap"])
def test_scan_cells_equal_the_whole_model_kl(tiny_model, tmp_path, calib_text, kind):
    """A linear head's cells (against the summary) and a soft-capped head's (log-probabilities
    recomputed per cell), and a head cell (its own quantized head), against quantizing the whole model
    with one group changed and taking the KL of full forwards."""
    from transformers import AutoTokenizer

    from cardfit.engine import Engine
    from cardfit.formats import get_format
    from cardfit.scan import scan
    from cardfit.sources import open_model
    from cardfit.text import token_chunks

    model = tiny_model(kind)
    result = scan(model, calib_text, 256, "Q8_0,Q2_K", out=tmp_path / "map.json", seq_len=64, progress=False,
                  device="cpu")
    source = open_model(model)
    engine = Engine(source, "cpu")
    chunks = token_chunks(AutoTokenizer.from_pretrained(source.path), calib_text.read_text(), 64, 256)
    assert engine.stream.linear_head == (kind == "qwen2")
    ref = engine.forward(chunks)
    for group_name in ("embed", "layers.1"):
        for fmt_name in ("Q8_0", "Q2_K"):
            fmt = get_format(fmt_name)
            overrides = {t.name: fmt.roundtrip(t.name, source.read(t.name))
                         for t in source.groups()[group_name] if len(t.shape) == 2}
            whole = float(token_kl(ref, engine.forward(chunks, overrides)).double().mean())
            cell = next(g for g in result["groups"] if g["name"] == group_name)["cells"][fmt_name]["damage"]
            assert cell == pytest.approx(whole, rel=1e-3, abs=1e-6), (group_name, fmt_name)  # float32 forwards: ~1e-7
    engine.close()


def test_the_summary_is_the_same_bits_on_any_number_of_threads():
    """A threaded matmul reducing over the vocabulary rounds differently on 1 and 2 threads; a Ray
    reference task and a single process must still give the same map (test_ray)."""
    weight, b, n_ref, _ = _head(vocab=32000)
    threads = torch.get_num_threads()
    made = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            ref, tail = summarize(n_ref @ weight.t(), n_ref, weight)
            made.append((*ref.tensors(), tail))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(x, y) for x, y in zip(*made))
    assert torch.get_num_threads() == threads


def test_a_one_position_slice_is_the_same_bits_on_any_number_of_threads(tiny_models, calib_text, tmp_path,
                                                                       monkeypatch):
    """Sequences of 33 in slices of 16 leave a slice of one position, whose vocabulary-wide sums torch
    would split across threads; the maps made on 1 and 2 threads are the same bytes."""
    from cardfit.scan import measure
    from cardfit import scan as scan_module

    monkeypatch.setattr(measure, "LOGIT_POSITIONS", 16)
    threads = torch.get_num_threads()
    maps = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            out = tmp_path / f"{count}.json"
            scan_module.scan(tiny_models["llama"], calib_text, 66, "Q8_0,Q2_K", out=out, seq_len=33,
                             progress=False, device="cpu")
            maps.append(out.read_bytes())
    finally:
        torch.set_num_threads(threads)
    assert maps[0] == maps[1]
