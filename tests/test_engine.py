"""The execution engine: tracks share one read per layer, compute what separate walks compute, and the
device and dtype policy says what it chose. CUDA tests run only where torch sees a GPU
(scripts/gpu-check.sh runs them when one is lent)."""

import json

import pytest
import torch

from cardfit.engine import Engine, Track, resolve_device, resolve_dtype
from cardfit.errors import CardfitError
from cardfit.sources import open_model



def cuda(test):
    """Runs where torch sees a GPU (scripts/gpu-check.sh selects these with -m cuda)."""
    return pytest.mark.cuda(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


def _chunks(n=2, length=24, seed=0):
    return torch.randint(0, 49152, (n, length), generator=torch.Generator().manual_seed(seed))


def test_tracks_equal_separate_walks_and_read_each_layer_once(tiny_models):
    source = open_model(tiny_models["llama"])
    engine = Engine(source, "cpu")
    ids = _chunks()
    name = "model.layers.1.mlp.down_proj.weight"
    variants = [{}, {name: torch.zeros_like(source.read(name))}, {name: source.read(name) * 0.5}]
    alone = []
    for overrides in variants:
        track = Track(engine.embed([ids]), 0, overrides)
        alone.append(engine.walk([track])[0].hidden[0])
    engine.loads.clear()
    together = engine.walk([Track(engine.embed([ids]), 0, o) for o in variants])
    for track, expected in zip(together, alone):
        assert torch.equal(track.hidden[0], expected)
    assert not torch.equal(alone[0], alone[1])
    assert engine.layer_loads() == engine.layers  # three tracks, one read per layer
    assert all(p.device.type == "meta" for p in engine.stream.model.parameters())  # nothing stays on the CPU


def test_tracks_start_where_their_group_is(tiny_models):
    source = open_model(tiny_models["llama"])
    engine = Engine(source, "cpu")
    ids = _chunks()
    full = Track(engine.embed([ids]))
    inputs = {}
    engine.walk([full], before_layer=lambda i, active: inputs.setdefault(i, active[0].hidden))
    late = Track(list(inputs[1]), 1)
    engine.loads.clear()
    engine.walk([late])
    assert torch.equal(late.hidden[0], full.hidden[0])
    assert engine.layer_loads() == engine.layers - 1


def test_scan_reads_each_later_layer_once_per_group_sweep(tiny_models, tmp_path, calib_text):
    from cardfit.scan import scan

    lines = []
    scan(tiny_models["llama"], calib_text, 256, "Q8_0,Q4_K,Q2_K", out=tmp_path / "m.json", seq_len=64,
         progress=False, device="cpu", log=lines.append)
    layers = open_model(tiny_models["llama"]).geometry.num_layers
    assert json.loads((tmp_path / "m.json").read_text())["complete"]
    # reference L; layer i's sweep L - i for all three formats at once; the embedding (the largest group,
    # whose copies are held one at a time as before) L per format: L + 3L + L(L+1)/2
    expected = 4 * layers + layers * (layers + 1) // 2
    reads = next(line for line in lines if line.startswith("read decoder layers"))
    assert f"read decoder layers {expected} times" in reads, (reads, expected)
    assert any(line.startswith("estimate: ") for line in lines)


def test_device_auto_says_which_and_why():
    device, reason = resolve_device("auto")
    if torch.cuda.is_available():
        assert device.type == "cuda" and "cuda" in reason
    else:
        assert device.type == "cpu" and torch.__version__ in reason and "CPU" in reason
    assert resolve_dtype("auto") == torch.float32
    with pytest.raises(CardfitError, match="--dtype"):
        resolve_dtype("fp8")
    with pytest.raises(CardfitError, match="--device"):
        resolve_device("tpu")


def test_bfloat16_layers_keep_the_head_in_float32(tiny_models):
    source = open_model(tiny_models["qwen2"])
    engine = Engine(source, "cpu", "bfloat16")
    ids = _chunks()
    logits = engine.forward(ids)
    reference = Engine(source, "cpu", "float32").forward(ids)
    assert logits.dtype == torch.float32
    # bf16 layers move the logits a little, never the argmax of most positions
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agree > 0.9 and not torch.equal(logits, reference)


def test_estimate_writes_nothing(tiny_models, tmp_path, calib_text):
    from cardfit.scan import scan

    out = tmp_path / "m.json"
    result = scan(tiny_models["llama"], calib_text, 256, "Q8_0,Q2_K", out=out, seq_len=64, progress=False,
                  device="cpu", estimate=True)
    guess = result["estimate"]
    source = open_model(tiny_models["llama"])
    layers = source.geometry.num_layers
    assert guess["layer_reads"] == 3 * layers + layers * (layers + 1) // 2  # as above, two formats
    matrices = layers + 1 + (0 if source.tied_embeddings else 1)  # the layers, the embedding, an untied head
    assert guess["quantizations"] == 2 * matrices and guess["seconds"] > 0 and guess["flops"] > 0
    assert not out.exists()


def test_estimate_reads_resident_layers_once_and_overlaps_rounding(tiny_models, tmp_path, calib_text,
                                                                   monkeypatch):
    """Priced with fixed unit times: layers the engine keeps resident (as on a GPU with room) are read by
    the reference pass alone; with the next sweep rounded ahead, a group costs the longer of its rounding
    and its sweeps, not their sum."""
    from cardfit import engine as engine_module
    from cardfit.scan import estimate as estimate_module
    from cardfit import scan as scan_module

    units = {"layer_read": 1.0, "layer_forward": 0.25, "head_forward": 0.5,
             "quantize_per_param": {"Q8_0": 1e-5, "Q2_K": 2e-5}, "_measured_in": 0.0}
    monkeypatch.setattr(estimate_module, "_unit_seconds", lambda scanner, formats, differs=False: dict(units))

    def guess():
        return scan_module.scan(tiny_models["llama"], calib_text, 256, "Q8_0,Q2_K", out=tmp_path / "m.json",
                                seq_len=64, progress=False, device="cpu", estimate=True)["estimate"]

    layers = open_model(tiny_models["llama"]).geometry.num_layers
    streamed = guess()
    monkeypatch.setattr(engine_module, "default_keep_bytes", lambda *a: 1 << 40)
    resident = guess()
    assert streamed["layer_reads"] > layers and resident["layer_reads"] == layers
    monkeypatch.setattr(scan_module.RoundedAhead, "applies", staticmethod(lambda *a: True))
    ahead = guess()
    assert ahead["reference_seconds"] == resident["reference_seconds"]
    for overlapped, summed in zip(ahead["group_seconds"], resident["group_seconds"], strict=True):
        assert summed / 2 <= overlapped < summed  # max(a, b) of a sum a + b with both parts > 0
    assert ahead["seconds"] == pytest.approx(ahead["reference_seconds"] + sum(ahead["group_seconds"]))


@cuda
def test_cuda_forward_matches_the_cpu(tiny_models):
    source = open_model(tiny_models["qwen2"])
    ids = _chunks()
    on_cpu = Engine(source, "cpu", "float32").forward(ids)
    on_gpu = Engine(source, "cuda", "float32").forward(ids).cpu()
    assert torch.allclose(on_cpu, on_gpu, atol=1e-3, rtol=1e-3)


@cuda
def test_cuda_layers_stay_resident_under_the_budget(tiny_models):
    source = open_model(tiny_models["llama"])
    engine = Engine(source, "cuda", gpu_memory=1 << 30)
    ids = _chunks()
    engine.forward(ids)
    engine.forward(ids)
    assert engine.layer_loads() == engine.layers  # the second walk read nothing


@cuda
def test_cuda_scan_map_matches_the_cpu_map_within_stderr(tiny_models, tmp_path, calib_text):
    from cardfit.scan import scan

    maps = {d: scan(tiny_models["llama"], calib_text, 512, "Q8_0,Q2_K", out=tmp_path / f"{d}.json", seq_len=64,
                    progress=False, device=d) for d in ("cpu", "cuda")}
    for a, b in zip(maps["cpu"]["groups"], maps["cuda"]["groups"]):
        for f, cell in a["cells"].items():
            other = b["cells"][f]
            tolerance = 3 * ((cell["stderr"] or 0) ** 2 + (other["stderr"] or 0) ** 2) ** 0.5 + 1e-4
            assert abs(cell["damage"] - other["damage"]) <= tolerance, (a["name"], f, cell, other)


@cuda
def test_cuda_head_in_difference_form_rounds_only_the_change():
    """difference.head_change on CUDA (bfloat16 inputs, float32 out): each logit's error is a small fraction
    of its change, not of the logit."""
    from cardfit.engine.difference import head_change

    g = torch.Generator().manual_seed(0)
    weight, n = torch.randn(50000, 256, generator=g) * 0.05, torch.randn(1, 64, 256, generator=g)
    change = 1e-3 * torch.randn(n.shape, generator=g)
    reference = n @ weight.t()
    exact = ((n + change).double() @ weight.double().t())
    on_gpu = head_change(reference.cuda(), change.cuda(), weight.cuda(), torch.empty_like(reference).cuda()).cpu()
    moved = (exact - reference.double()).abs().max()
    assert float((on_gpu.double() - exact).abs().max()) < 0.01 * float(moved)


def test_bfloat16_layers_keep_coarse_cells_and_float32_stays_the_default(tmp_path):
    """The embedded model's exact map with bf16 decoder layers against the float32 one (same tokens, formats,
    rounding). Measured: bf16 adds a floor of 2e-4..1e-3 nats to every cell, which swamps Q8_0 cells
    (~3e-5) but leaves Q2_K cells within 8 % (an EPYC's AVX512-BF16) or 17 % (a Sapphire Rapids with AMX,
    one thread); that is why `--dtype auto` is float32 everywhere."""
    from cardfit.engine import resolve_dtype
    from cardfit.scan import scan

    common = dict(max_tokens=128, formats="Q8_0,Q2_K", seq_len=128, progress=False, device="cpu")
    f32 = scan(None, None, out=tmp_path / "f32.json", dtype="float32", **common)
    bf16 = scan(None, None, out=tmp_path / "bf16.json", dtype="bfloat16", **common)
    for a, b in zip(f32["groups"], bf16["groups"]):
        cell, other = a["cells"]["Q2_K"], b["cells"]["Q2_K"]
        assert abs(cell["damage"] - other["damage"]) <= 0.25 * cell["damage"] + 1e-6, (a["name"], cell, other)
    floor = min(b["cells"]["Q8_0"]["damage"] for b in bf16["groups"] if b["cells"]["Q8_0"]["damage"] > 0)
    typical = sorted(a["cells"]["Q8_0"]["damage"] for a in f32["groups"])[len(f32["groups"]) // 2]
    assert floor > 3 * typical  # the floor the docs report: bf16 cannot price near-lossless formats
    assert resolve_dtype("auto") == torch.float32
    # bfloat16 products of the changes only (difference.py): every cell the float32 one's, Q8_0 included
    # (measured: within 0.31 %); 128 tokens in one chunk have no standard error, so 1 % it is
    differences = scan(None, None, out=tmp_path / "differences.json", dtype="bfloat16-differences", **common)
    for a, b in zip(f32["groups"], differences["groups"]):
        for name, cell in a["cells"].items():
            assert abs(b["cells"][name]["damage"] - cell["damage"]) <= 0.01 * cell["damage"] + 1e-9, (a["name"], name)


def test_a_stage_arena_bounds_what_gptq_holds():
    """quantizers_on is how a stage on a GPU caps GPTQ (--gpu-memory): the quantizer's device tensors
    are counted against the stage's cap, on whatever device the stage names."""
    from cardfit.formats import Calibration, get_format
    from cardfit.quant import quantize_int
    from cardfit.quant.device import quantizers_on

    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 256, generator=g), torch.randn(512, 256, generator=g)
    calibration = Calibration(hessian=x.T @ x / 512)
    fmt = get_format("W4A16-g64")
    with quantizers_on("cpu", 1024), pytest.raises(CardfitError, match="MiB"):
        quantize_int(fmt, weight, calibration, "gptq")
    with quantizers_on("cpu", 1 << 20) as arena:
        capped = quantize_int(fmt, weight, calibration, "gptq")
    assert 0 < arena.peak <= 1 << 20
    assert torch.equal(capped[0], quantize_int(fmt, weight, calibration, "gptq")[0])  # same rounding, less held


@pytest.mark.parametrize("kind,group_by,rounding", [("llama", "layer", "rtn"), ("qwen2", "tensor", "imatrix")])
def test_a_round_of_groups_walks_once_and_gives_each_group_s_own_bits(tiny_models, kind, group_by, rounding):
    """measure_round (an adaptive round) against measure_group per group: the same cells, bit for bit,
    with each layer read once per walk (plus the own sweeps of the embedding and an untied head); a walk
    too small for two groups splits by group, never inside one, and still gives the same bits. Per-tensor
    groups share their layer's walk; imatrix rounding computes each group's statistics at its layer."""
    from cardfit.engine.activations import ActivationCache
    from cardfit.formats import parse_formats
    from cardfit.groups import EMBED, LM_HEAD
    from cardfit.groups import scan_groups
    from cardfit.scan.measure import Scanner, measure_group, measure_round

    source = open_model(tiny_models[kind], run=True)
    engine = Engine(source, "cpu")
    scanner = Scanner(source, engine, _chunks(3, 32), 2, ActivationCache(None), rounding)
    scanner.reference()
    q8, q4, q2 = parse_formats("Q8_0,Q4_K,Q2_K")
    groups = scan_groups(source, group_by)
    in_layer = {i: [g for g in groups if g.start == i and g.quantizable] for i in (0, 1)}
    todo = [(in_layer[1][0], [q4, q8]), (in_layer[0][0], [q2, q4]), *[(g, [q8]) for g in in_layer[0][1:][-1:]],
            *[(g, [q4]) for g in groups if g.name in (EMBED, LM_HEAD)]]
    layer_todo = [g for g, _ in todo if 0 <= g.start < engine.layers]
    assert len(layer_todo) == (3 if group_by == "tensor" else 2)
    alone = [measure_group(scanner, group, formats, 10**12) for group, formats in todo]
    layers = engine.layers
    own_sweeps = layers * sum(g.name == EMBED for g, _ in todo)  # the embedding's walks all L; the head's none
    for track_bytes, walks in ((10**12, 1), (1, len(layer_todo))):
        engine.loads.clear()
        together = measure_round(scanner, todo, track_bytes)
        for mine, theirs in zip(together, alone):
            assert mine == theirs
        # the layer groups' walks from their first layer (one walk, or one per group), then the embedding's
        walked = layers if walks == 1 else sum(layers - g.start for g in layer_todo)
        statistics = 0 if rounding == "rtn" else len(layer_todo)  # each group's, read at its layer
        assert engine.layer_loads() == walked + own_sweeps + statistics, (track_bytes, engine.loads)
    assert alone[0]["Q4_K"]["damage"] != alone[1]["Q4_K"]["damage"]
    engine.close()


def test_the_logits_slice_does_not_change_a_cell(tiny_models, tmp_path, calib_text, monkeypatch):
    """The head's logits are computed `positions` at a time (256, for the matmul's speed; 64 under a memory
    cap): every cell's damage and top-1 are the same bits whatever the slice, only the reference's summed
    NLL may differ in its last place (it is summed slice by slice)."""
    from cardfit.scan import measure
    from cardfit import scan as scan_module

    maps = {}
    for positions in (64, 16):
        monkeypatch.setattr(measure, "LOGIT_POSITIONS", positions)
        maps[positions] = scan_module.scan(tiny_models["qwen2"], calib_text, 256, "Q8_0,Q2_K",
                                           out=tmp_path / f"{positions}.json", seq_len=64, progress=False, device="cpu")
    assert [g["cells"] for g in maps[64]["groups"]] == [g["cells"] for g in maps[16]["groups"]]
    assert maps[64]["reference"]["perplexity"] == pytest.approx(maps[16]["reference"]["perplexity"], rel=1e-6)
