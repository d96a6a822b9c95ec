"""Integer group formats agree with compressed-tensors, byte for byte and value for value."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from cardfit.formats import get_format
from cardfit.formats.reference_formats import NF4_CODE

NAME = "model.layers.0.mlp.down_proj.weight"


def scheme_for(fmt):
    args = QuantizationArgs(num_bits=fmt.num_bits, type="int", symmetric=fmt.symmetric,
                            strategy="channel" if fmt.group_size == -1 else "group",
                            group_size=None if fmt.group_size == -1 else fmt.group_size)
    return QuantizationScheme(targets=["Linear"], weights=args)


@pytest.mark.parametrize("name", ["W8A16", "W8A16-g128", "W4A16-g128", "W4A16-g128-asym", "W4A16-g64", "W3A16-g128"])
@pytest.mark.parametrize("shape", [(96, 256), (64, 576)])
def test_bytes_and_values_match_compressed_tensors(name, shape):
    torch.manual_seed(0)
    fmt = get_format(name).resolve(shape)
    w = (torch.randn(shape, dtype=torch.float32) * 0.05).half().float()  # the model dtype both sides see
    q, scale, zero = fmt.quantize_rtn(w)
    state = {"weight": w.half(), "weight_scale": scale.half(), "weight_zero_point": zero.to(torch.int8)}
    compressed = PackedQuantizationCompressor.compress(state, scheme_for(fmt))
    stored = sum(t.numel() * t.element_size() for k, t in compressed.items())
    assert fmt.tensor_bytes(NAME, shape) == stored
    # Their quantizer divides in float16, ours in float32: the integers agree except at rare ties.
    theirs = PackedQuantizationCompressor.decompress(compressed, scheme_for(fmt))["weight"].float()
    ours = fmt.dequantize(q, scale.half().float(), zero)
    assert (torch.isclose(theirs, ours, rtol=2e-3, atol=1e-6).float().mean()) > 0.98
    # What cardfit stores (its own integers, packed by compressed-tensors) decompresses to its values.
    packed = {"weight_packed": pack_to_int32(q, fmt.num_bits), "weight_scale": scale.half(),
              "weight_shape": torch.tensor(shape)}
    if not fmt.symmetric:
        packed["weight_zero_point"] = pack_to_int32(zero.to(torch.int8), fmt.num_bits, packed_dim=0)
    assert sum(t.numel() * t.element_size() for t in packed.values()) == stored
    restored = PackedQuantizationCompressor.decompress(packed, scheme_for(fmt))["weight"].float()
    assert torch.allclose(restored, ours, rtol=2e-3, atol=1e-6)
    # every value is on the integer grid and inside the format's range
    assert int(q.min()) >= fmt.qmin and int(q.max()) <= fmt.qmax


def test_qparams_match_compressed_tensors_calculate_qparams():
    from compressed_tensors.quantization.utils import calculate_qparams

    torch.manual_seed(1)
    w = torch.randn(16, 128)
    for name in ("W4A16-g128", "W4A16-g128-asym"):
        fmt = get_format(name)
        args = scheme_for(fmt).weights
        scale, zero = calculate_qparams(w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True), args)
        ours_s, ours_z = fmt.qparams(w)
        assert torch.allclose(scale.half().float(), ours_s, rtol=1e-3)
        assert torch.equal(zero.float().round(), ours_z)


def test_only_decoder_linears_are_quantized_for_vllm():
    fmt = get_format("W4A16-g128")
    assert fmt.storage("model.embed_tokens.weight", (512, 64)) == "BF16"
    assert fmt.storage("lm_head.weight", (512, 64)) == "BF16"
    assert fmt.storage("model.layers.3.input_layernorm.weight", (64,)) == "BF16"
    assert fmt.tensor_bytes("model.embed_tokens.weight", (512, 64)) == 512 * 64 * 2
    w = torch.randn(512, 64)
    assert torch.equal(fmt.roundtrip("model.embed_tokens.weight", w), w.bfloat16().float())


def test_nf4_roundtrip_lands_on_the_codebook():
    torch.manual_seed(2)
    fmt = get_format("NF4")
    w = torch.randn(64, 128)
    out = fmt.roundtrip(NAME, w)
    blocks_in, blocks_out = w.reshape(-1, 64), out.reshape(-1, 64)
    absmax = blocks_in.abs().amax(dim=1, keepdim=True)
    normalized = blocks_out / absmax
    assert torch.all(torch.isclose(normalized.unsqueeze(-1), NF4_CODE).any(-1))
    assert fmt.tensor_bytes(NAME, (64, 128)) == 64 * 128 // 2 + (64 * 128 // 64) * 4
    assert float(((out - w) ** 2).mean()) < float(((get_format("W3A16-g128").roundtrip(NAME, w) - w) ** 2).mean())


def test_group_size_falls_back_when_it_does_not_divide_the_row():
    fmt = get_format("W4A16-g128")
    assert fmt.storage(NAME, (64, 576)) == "W4A16-g64"
    assert fmt.storage(NAME, (64, 1536)) == "W4A16-g128"
    assert fmt.storage(NAME, (64, 80)) == "W4A16"  # 80 = 16 x 5: only per-channel divides it
    assert fmt.tensor_bytes(NAME, (64, 576)) == get_format("W4A16-g64").tensor_bytes(NAME, (64, 576))
