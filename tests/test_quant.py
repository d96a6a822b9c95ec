"""GPTQ, AWQ and RTN: each does what its paper says, on any device, under a memory cap."""

import pytest
import torch

from cardfit.errors import CardfitError
from cardfit.formats import Calibration, get_format
from cardfit.quant import DeviceArena, gptq_quantize

NAME = "model.layers.0.mlp.up_proj.weight"


def hessian_from_inputs(inputs):
    """X^T X / n, the (scaled) GPTQ Hessian of a layer's inputs."""
    x = inputs.detach().reshape(-1, inputs.shape[-1]).to(torch.float32)
    return x.T @ x / x.shape[0]


def imatrix_from_inputs(inputs):
    """llama.cpp's importance matrix: the mean of x^2 per input column."""
    x = inputs.detach().reshape(-1, inputs.shape[-1]).to(torch.float32)
    return (x * x).mean(dim=0)


def layer_errors(name, weight, inputs, formats, methods=("rtn", "gptq", "awq", "imatrix")):
    """{format: {method: ||X W^T - X Wq^T||^2 / ||X W^T||^2}} for the methods each format takes."""
    x = inputs.reshape(-1, inputs.shape[-1]).to(torch.float32)
    w = weight.to(torch.float32)
    calibration = Calibration(imatrix=imatrix_from_inputs(x), hessian=hessian_from_inputs(x), inputs=x[:4096])
    out = {}
    for fmt_name in formats:
        fmt = get_format(fmt_name)
        out[fmt.name] = {method: output_error(x, w, fmt.roundtrip(name, w, calibration, method))
                         for method in methods if method in fmt.methods()}
    return out


def correlated_inputs(tokens, width, seed=0):
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(width // 4, width, generator=g)
    x = torch.randn(tokens, width // 4, generator=g) @ basis + 0.1 * torch.randn(tokens, width, generator=g)
    return x * torch.linspace(0.2, 2.0, width)


def output_error(x, w, wq):
    ref = x @ w.T
    return float(((x @ wq.T - ref) ** 2).sum() / (ref ** 2).sum())


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    x = correlated_inputs(4096, 256)
    w = torch.randn(128, 256) * 0.05
    return x, w, Calibration(hessian=hessian_from_inputs(x), inputs=x[:1024])


@pytest.mark.parametrize("fmt_name", ["W4A16-g128", "W4A16-g128-asym", "W3A16-g128", "W8A16"])
def test_gptq_beats_rtn_on_correlated_inputs(layer, fmt_name):
    x, w, cal = layer
    fmt = get_format(fmt_name)
    rtn = output_error(x, w, fmt.roundtrip(NAME, w))
    gptq = output_error(x, w, fmt.roundtrip(NAME, w, cal, "gptq"))
    assert gptq < 0.8 * rtn, (gptq, rtn)


def test_gptq_with_identity_hessian_is_rtn():
    torch.manual_seed(1)
    w = torch.randn(32, 256)
    fmt = get_format("W4A16-g128")
    q_gptq, s_gptq, z_gptq = gptq_quantize(fmt, w, torch.eye(256), damp=0.0)
    q_rtn, s_rtn, z_rtn = fmt.quantize_rtn(w)
    assert torch.equal(q_gptq, q_rtn) and torch.equal(s_gptq, s_rtn)


def test_act_order_keeps_layout_and_helps(layer):
    x, w, cal = layer
    fmt = get_format("W4A16-g128")
    q, s, z = gptq_quantize(fmt, w, cal.hessian, act_order=True)
    assert q.shape == w.shape and s.shape == (128, 2)
    assert output_error(x, w, fmt.dequantize(q, s, z)) < output_error(x, w, fmt.roundtrip(NAME, w))


def test_row_chunking_does_not_change_the_result(layer):
    _, w, cal = layer
    fmt = get_format("W4A16-g128")
    whole = gptq_quantize(fmt, w, cal.hessian)
    chunked = gptq_quantize(fmt, w, cal.hessian, row_chunk=7)
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)


def test_awq_never_worse_than_rtn_and_helps_with_salient_channels():
    torch.manual_seed(3)
    x = torch.randn(2048, 256)
    x[:, :4] *= 30  # a few salient input channels, as in LLM activations
    w = torch.randn(64, 256) * 0.05
    cal = Calibration(inputs=x)
    for name in ("W4A16-g128", "Q4_0"):
        fmt = get_format(name)
        rtn = output_error(x, w, fmt.roundtrip(NAME, w))
        awq = output_error(x, w, fmt.roundtrip(NAME, w, cal, "awq"))
        assert awq < 0.9 * rtn, (name, awq, rtn)


def test_methods_without_calibration_fail_clearly():
    w = torch.randn(8, 128)
    with pytest.raises(CardfitError, match="GPTQ needs calibration"):
        get_format("W4A16-g128").roundtrip(NAME, w, None, "gptq")
    with pytest.raises(CardfitError, match="AWQ needs calibration"):
        get_format("W4A16-g128").roundtrip(NAME, w, None, "awq")


def test_gptq_18944_wide_layer_under_a_512_mib_device_cap():
    """Qwen2.5-7B's down_proj input width: the Hessian alone is 1.34 GiB in fp32. The arena
    counts every tensor the algorithm places on the device; its peak must stay under the cap
    while the result equals an uncapped run."""
    width, rows = 18944, 48
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, width, generator=g)
    hessian = x.T @ x / x.shape[0]
    assert hessian.numel() * 4 > 1.3 * 2**30
    w = torch.randn(rows, width, generator=g) * 0.02
    fmt = get_format("W4A16-g128")
    cap = 512 * 2**20
    arena = DeviceArena("cpu", cap_bytes=cap)
    q, s, z = gptq_quantize(fmt, w, hessian, arena=arena, row_chunk=None)
    assert 0 < arena.peak <= cap
    assert arena.peak >= 128 * width * 4  # it really held a block of U's rows at a time
    assert arena.current == 0  # and gave everything back
    tiny = DeviceArena("cpu", cap_bytes=4 * 2**20)
    with pytest.raises(CardfitError, match="memory-cap"):
        gptq_quantize(fmt, w, hessian, arena=tiny)
    # the capped result is a real GPTQ result: better than RTN on the calibration inputs
    assert output_error(x, w, fmt.dequantize(q, s, z)) < output_error(x, w, fmt.roundtrip(NAME, w))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_gptq_runs_on_cuda(layer):
    x, w, cal = layer
    fmt = get_format("W4A16-g128")
    cpu = gptq_quantize(fmt, w, cal.hessian)
    cuda = gptq_quantize(fmt, w.cuda(), cal.hessian.cuda(), arena=DeviceArena("cuda"))
    assert (cpu[0] == cuda[0].cpu()).float().mean() > 0.99


def test_layer_errors_table_on_real_inputs(layer):
    x, w, _ = layer
    table = layer_errors(NAME, w, x, ["W4A16-g128", "Q4_K", "Q8_0"])
    assert set(table["W4A16-g128"]) == {"rtn", "gptq", "awq"}
    assert set(table["Q4_K"]) == {"rtn", "imatrix", "awq"}
    assert table["W4A16-g128"]["gptq"] < table["W4A16-g128"]["rtn"]
    assert table["Q8_0"]["rtn"] < table["Q4_K"]["rtn"]
