"""Formats: exact bytes, and GGUF tensors bit-identical to llama.cpp's own quantize."""

import numpy as np
import pytest
import torch

from cardfit.formats import FORMATS, GGML_BLOCKS, GGUF_TYPES, Calibration, get_format, ggml_lib
from cardfit.formats.gguf_formats import GgmlFormat

PURE_TYPES = ["F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_XS", "MXFP4", "IQ3_S", "IQ3_XXS",
              "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S"]  # + Q5_0, Q5_1, Q8_0, Q4_0, IQ4_NL as fallbacks
IMATRIX_TENSORS = ("blk.0.ffn_down.weight", "blk.2.attn_q.weight", "token_embd.weight")


def _imatrix_for(type_name, tensors, names, seed):
    """Random importance for `names`, or for every matrix when the type quantizes only with one (llama.cpp
    refuses any tensor of such a type without an entry)."""
    rng = np.random.default_rng(seed)
    if GgmlFormat(type_name).needs_imatrix:
        names = [n for n, t in tensors.items() if len(t.shape) == 2 and not n.endswith("norm.weight")]
    return {n: (rng.random(int(tensors[n].shape[0])) + 0.05).astype(np.float32) for n in names}


def test_block_table_matches_ggml_type_traits():
    for name, (block, size) in GGML_BLOCKS.items():
        traits = ggml_lib.traits(name)
        assert (traits.blck_size, traits.type_size) == (block, size), name
        assert ggml_lib.row_size(name, block * 3) == 3 * size


def test_tensor_bytes_match_the_real_packaged_gguf():
    import gguf

    from cardfit.default_model import default_gguf

    reader = gguf.GGUFReader(str(default_gguf()))
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        # llama.cpp's Q4_1 mix stores the tied token embedding as Q8_0; every other tensor is Q4_1 or F32.
        fmt = GgmlFormat("Q8_0" if t.name == "token_embd.weight" else "Q4_1")
        assert fmt.storage(t.name, shape) == t.tensor_type.name, t.name
        assert fmt.tensor_bytes(t.name, shape) == t.n_bytes, t.name


SLICE_LAYERS = 3


@pytest.fixture(scope="module")
def packaged(tmp_path_factory):
    """The packaged model's first SLICE_LAYERS layers, embedding and head as shipped (Q4_1, F32 norms), in
    a GGUF llama.cpp loads: real tensors, at a tenth of the whole model's quantize time per type."""
    import gguf

    from cardfit.default_model import default_gguf

    reader = gguf.GGUFReader(str(default_gguf()))
    arch = reader.fields["general.architecture"].contents()
    path = tmp_path_factory.mktemp("slice") / "smollm2-slice.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = SLICE_LAYERS if field.name == f"{arch}.block_count" else field.contents()
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= SLICE_LAYERS:
            continue
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def _source_values(tensor):
    shape = tuple(int(d) for d in reversed(tensor.shape))
    raw = np.asarray(tensor.data).reshape(-1).view(np.uint8)
    return torch.from_numpy(ggml_lib.dequantize(tensor.tensor_type.name, raw, (int(np.prod(shape[:-1])), shape[-1]))
                            ).reshape(shape)


@pytest.mark.parametrize("type_name", PURE_TYPES)
def test_bit_identical_to_llama_cpp_quantize_on_real_tensors(type_name, packaged, tmp_path):
    """llama.cpp requantizes a slice of the packaged Q4_1 model (dequantize to f32, quantize again, with an
    imatrix for three tensors); every tensor cardfit produces from the same f32 values and
    imatrix must carry the same type (fallbacks included) and the same bytes."""
    import gguf

    from cardfit.targets.shelf import llama_quantize

    path, source = packaged
    imatrix = _imatrix_for(type_name, source, IMATRIX_TENSORS, seed=0)
    out = llama_quantize(path, tmp_path / f"{type_name}.gguf", type_name, pure=True, imatrix=imatrix)
    produced = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    fmt = get_format(type_name)
    names = list(IMATRIX_TENSORS) + ["blk.0.attn_norm.weight", "blk.1.ffn_up.weight", "blk.2.attn_k.weight",
                                     "blk.2.ffn_down.weight", "output_norm.weight"]
    for name in names:
        values = _source_values(source[name])
        calibration = Calibration(imatrix=torch.from_numpy(imatrix[name])) if name in imatrix else None
        storage, raw = fmt.quantize(name, values, calibration, "imatrix" if calibration else "rtn")
        theirs = produced[name]
        assert storage == theirs.tensor_type.name, (name, storage, theirs.tensor_type.name)
        assert np.array_equal(raw, np.asarray(theirs.data).reshape(-1).view(np.uint8)), name
        assert fmt.tensor_bytes(name, tuple(values.shape)) == theirs.n_bytes


def test_imatrix_changes_rounding_and_lowers_weighted_error():
    torch.manual_seed(0)
    w = torch.randn(64, 512)
    importance = torch.rand(512) ** 4 * 100
    fmt = get_format("Q3_K")
    plain = fmt.roundtrip("blk.0.ffn_up.weight", w)
    weighted = fmt.roundtrip("blk.0.ffn_up.weight", w, Calibration(imatrix=importance), "imatrix")
    err = lambda q: float((((q - w) ** 2) * importance).sum())
    assert not torch.equal(plain, weighted)
    assert err(weighted) < err(plain)


@pytest.mark.parametrize("shape,expected", [
    ((64, 512), "Q4_K"), ((64, 576), "Q5_0"), ((64, 100), "F16"), ((576,), "F32"), ((8, 576), "Q5_0")])
def test_edge_shapes_fall_back_like_llama_cpp(shape, expected):
    fmt = get_format("Q4_K")
    assert fmt.storage("blk.0.ffn_up.weight", shape) == expected
    w = torch.randn(shape)
    out = fmt.roundtrip("blk.0.ffn_up.weight", w)
    assert out.shape == w.shape
    if expected == "F32":
        assert torch.equal(out, w)


@pytest.fixture(scope="module")
def odd_rows_gguf(tmp_path_factory):
    """A one-layer llama in F16 whose matrices have rows of 256 (q, k, v, gate, up, embedding, output),
    96 (ffn_down: a 32-block type's rows, not a k-quant's) and 40 (attn_output: not even 32's)."""
    import gguf

    n_embd, n_ff, n_head, head_dim, vocab = 256, 96, 2, 20, 64
    path = tmp_path_factory.mktemp("odd") / "odd-rows-f16.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(1)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    rng = np.random.default_rng(5)
    matrix = lambda rows, cols: (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16)
    writer.add_tensor("token_embd.weight", matrix(vocab, n_embd))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
    for t in ("q", "k", "v"):
        writer.add_tensor(f"blk.0.attn_{t}.weight", matrix(n_head * head_dim, n_embd))
    writer.add_tensor("blk.0.attn_output.weight", matrix(n_embd, n_head * head_dim))
    writer.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate.weight", matrix(n_ff, n_embd))
    writer.add_tensor("blk.0.ffn_up.weight", matrix(n_ff, n_embd))
    writer.add_tensor("blk.0.ffn_down.weight", matrix(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", matrix(vocab, n_embd))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_fallback_rule_is_the_bundled_llama_cpp_s(type_name, odd_rows_gguf, tmp_path):
    """The one fallback rule (gguf_formats.storage_type) against the bundled llama.cpp: for every menu
    type, each tensor of a model with rows of 256, 96 and 40 gets llama.cpp's stored type and bytes."""
    import gguf

    from cardfit.targets.shelf import llama_quantize

    source = {t.name: t for t in gguf.GGUFReader(str(odd_rows_gguf)).tensors}
    imatrix = _imatrix_for(type_name, source, [], seed=3)
    out = llama_quantize(odd_rows_gguf, tmp_path / "q.gguf", type_name, pure=True, threads=1, imatrix=imatrix)
    fmt = get_format(type_name)
    stored = set()
    for theirs in gguf.GGUFReader(str(out)).tensors:
        shape = tuple(int(d) for d in reversed(theirs.shape))
        assert fmt.storage(theirs.name, shape) == theirs.tensor_type.name, theirs.name
        assert fmt.tensor_bytes(theirs.name, shape) == theirs.n_bytes, theirs.name
        values = torch.from_numpy(np.asarray(source[theirs.name].data).astype(np.float32)).reshape(shape)
        calibration = Calibration(imatrix=torch.from_numpy(imatrix[theirs.name])) if theirs.name in imatrix else None
        _, raw = fmt.quantize(theirs.name, values, calibration, fmt.method_for("rtn"))
        assert np.array_equal(raw, np.asarray(theirs.data).reshape(-1).view(np.uint8)), theirs.name
        stored.add(theirs.tensor_type.name)
    if GGML_BLOCKS[type_name][0] > 1:
        assert "F16" in stored  # the 40-wide rows took the last resort
    if GGML_BLOCKS[type_name][0] == 256:
        assert len(stored - {"F32", "F16", type_name}) == 1  # the 96-wide rows took a 32-block type


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q2_K", "IQ2_XXS", "IQ4_NL"])
def test_row_spans_on_threads_give_the_bytes_of_one_call(type_name, monkeypatch):
    """Quantization spread over threads in row spans (37 rows over 3 workers: spans of 13, 13 and 11)
    writes exactly what one ggml call writes."""
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((37, 512)).astype(np.float32)
    imatrix = rng.random(512).astype(np.float32) + 0.1
    monkeypatch.setattr(ggml_lib, "_cores", lambda: 1)
    assert ggml_lib._row_spans(37, 512) == [(0, 37)]
    whole = ggml_lib.quantize(type_name, rows, imatrix)
    monkeypatch.setattr(ggml_lib, "_cores", lambda: 3)
    monkeypatch.setattr(ggml_lib, "PARALLEL_MIN_VALUES", 0)
    assert ggml_lib._row_spans(37, 512) == [(0, 13), (13, 13), (26, 11)]
    spread = ggml_lib.quantize(type_name, rows, imatrix)
    assert spread.tobytes() == whole.tobytes()


def test_roundtrip_error_shrinks_with_bits():
    torch.manual_seed(1)
    w = torch.randn(32, 1024)
    errors = [float(((get_format(t).roundtrip("blk.0.ffn_up.weight", w) - w) ** 2).mean())
              for t in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0")]
    assert errors == sorted(errors, reverse=True)


def test_registry_names_resolve():
    assert get_format("W4A16").name == "W4A16-g128"
    assert get_format("q8_0").name == "Q8_0"
    from cardfit.errors import CardfitError

    with pytest.raises(CardfitError):
        get_format("Q7_X")
    assert {f.runtime for f in FORMATS.values()} == {"llama.cpp", "vllm", "reference"}


@pytest.fixture(scope="module")
def random_gguf(packaged, tmp_path_factory):
    """The packaged model's metadata with every matrix replaced by random F16 values, so llama.cpp
    itself can quantize random tensors for comparison."""
    import gguf

    path, _ = packaged
    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    out = tmp_path_factory.mktemp("random") / "random-f16.gguf"
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    rng = np.random.default_rng(7)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        if len(shape) == 1:
            writer.add_tensor(t.name, np.ones(shape, dtype=np.float32))
        else:
            values = rng.standard_t(df=4, size=shape).astype(np.float32) * 0.02  # heavy tails, like LLM weights
            writer.add_tensor(t.name, values.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q2_K", "IQ4_XS", "MXFP4", "IQ3_S", "IQ3_XXS", "IQ2_S",
                                       "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S"])
def test_bit_identical_to_llama_cpp_quantize_on_random_tensors(type_name, random_gguf, tmp_path):
    import gguf

    from cardfit.targets.shelf import llama_quantize

    source = {t.name: t for t in gguf.GGUFReader(str(random_gguf)).tensors}
    name_im = "blk.1.ffn_down.weight"
    imatrix = _imatrix_for(type_name, source, [name_im], seed=1)
    out = llama_quantize(random_gguf, tmp_path / "q.gguf", type_name, pure=True, imatrix=imatrix)
    produced = {t.name: t for t in gguf.GGUFReader(str(out)).tensors}
    fmt = get_format(type_name)
    for name in (name_im, "blk.0.attn_v.weight", "blk.2.ffn_gate.weight", "token_embd.weight"):
        values = torch.from_numpy(np.asarray(source[name].data, dtype=np.float16).astype(np.float32))
        calibration = Calibration(imatrix=torch.from_numpy(imatrix[name])) if name in imatrix else None
        storage, raw = fmt.quantize(name, values, calibration, "imatrix" if calibration else "rtn")
        theirs = produced[name]
        assert storage == theirs.tensor_type.name
        assert np.array_equal(raw, np.asarray(theirs.data).reshape(-1).view(np.uint8)), name


def test_the_imatrix_types_are_the_ones_llama_cpp_refuses_without_one(odd_rows_gguf, tmp_path):
    """IMATRIX_TYPES against the bundled llama.cpp: ggml's own list is inside it, llama.cpp's quantize
    refuses each without an imatrix and takes every other menu type; cardfit refuses in one line where
    ggml would abort the process."""
    from cardfit.errors import CardfitError
    from cardfit.formats.ggml_types import IMATRIX_TYPES
    from cardfit.targets.shelf import llama_quantize

    assert {t for t in GGUF_TYPES if ggml_lib.requires_imatrix(t)} <= set(IMATRIX_TYPES)
    for type_name in ("IQ4_XS", "MXFP4", "IQ3_S", "Q2_K"):
        llama_quantize(odd_rows_gguf, tmp_path / f"{type_name}.gguf", type_name, pure=True, threads=1)
    for type_name in IMATRIX_TYPES:
        with pytest.raises(CardfitError):
            llama_quantize(odd_rows_gguf, tmp_path / f"{type_name}.gguf", type_name, pure=True, threads=1)
        with pytest.raises(CardfitError, match="importance matrix"):
            get_format(type_name).roundtrip("blk.0.ffn_up.weight", torch.randn(4, 256))
    with pytest.raises(CardfitError, match="importance matrix"):
        ggml_lib.quantize("IQ2_XXS", np.ones((1, 256), dtype=np.float32))


def test_the_embedding_of_an_imatrix_type_weighs_its_columns_equally():
    """A lookup table has no activations to weigh: without statistics its columns count alike (ones), so an
    i-quant embedding packs; with statistics (a tied output matrix) they are used."""
    w = torch.randn(8, 256)
    fmt = get_format("IQ2_XXS")
    ones = fmt.quantize("token_embd.weight", w, None, "imatrix")[1]
    explicit = fmt.quantize("token_embd.weight", w, Calibration(imatrix=torch.ones(256)), "imatrix")[1]
    weighted = fmt.quantize("token_embd.weight", w, Calibration(imatrix=torch.rand(256) ** 4 + 0.01), "imatrix")[1]
    assert np.array_equal(ones, explicit) and not np.array_equal(ones, weighted)


def test_gptq_statistics_round_a_ggml_type_with_the_hessian_diagonal():
    """GPTQ asked of a ggml type rounds with its imatrix, which is the Hessian's diagonal (mean x²)."""
    x = torch.randn(512, 256) * (torch.rand(256) * 3)
    hessian = x.T @ x / x.shape[0]
    w = torch.randn(8, 256)
    fmt = get_format("Q3_K")
    assert fmt.method_for("gptq") == "imatrix" and fmt.method_for("awq") == "awq"
    assert get_format("IQ2_XS").method_for("rtn") == "imatrix"
    from_hessian = fmt.quantize("blk.0.ffn_up.weight", w, Calibration(hessian=hessian), "imatrix")[1]
    from_imatrix = fmt.quantize("blk.0.ffn_up.weight", w, Calibration(imatrix=(x * x).mean(0)), "imatrix")[1]
    assert np.array_equal(from_hessian, from_imatrix)
