"""Peak resident memory of scan and pack on the real packaged model, each in its own process.

The child imports everything, builds the empty model skeleton and reads the tokenizer, then
resets the kernel's peak-RSS counter (/proc/self/clear_refs) and runs the stage; the stage's cost
is its peak minus the RSS at the reset. Bounds are the ones issues 4 and 6 set.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

MIB = 2**20

PROBE = r"""
import json, sys
from pathlib import Path
import cardfit.pack, cardfit.plan, cardfit.scan, llama_cpp  # every stage's modules imported before the baseline
from cardfit.formats import ggml_lib
from cardfit.engine.streamed import StreamedModel
from cardfit.sources import open_model
from transformers import AutoTokenizer

def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

model, out, job = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
source = open_model(model)
StreamedModel(source)
ggml_lib.ggml()
before = rss("VmRSS")
AutoTokenizer.from_pretrained(model)
tokenizer = rss("VmRSS") - before
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak counter restarts from the current RSS
base = rss("VmRSS")
if job in ("scan", "fast"):
    from cardfit.scan import scan
    scan(model, None, 512, "Q8_0", out=out, memory_cap=64 * 2**20, seq_len=256, batch=2, progress=False,
         method="exact" if job == "scan" else "fast")
else:
    from cardfit.plan import uniform_recipe
    from cardfit.pack import pack
    pack(uniform_recipe(source, "Q8_0"), model, out, progress=False, smoke=False)
print(json.dumps({"baseline": base, "peak": rss("VmHWM"), "tokenizer": tokenizer}))
"""


def _stage_peak(model, out, job: str) -> dict:
    result = subprocess.run([sys.executable, "-c", PROBE, str(model), str(out), job],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _largest_group_f32(model) -> int:
    """The largest layer group as the stages hold it while computing: float32."""
    from cardfit.sources import open_model

    groups = open_model(model).groups()
    return max(sum(_numel(t.shape) * 4 for t in tensors) for tensors in groups.values())


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the peak RSS")
def test_scan_peak_rss_stays_within_three_groups_activations_and_a_logits_chunk(default_model_dir, tmp_path):
    from cardfit.sources import open_model

    source = open_model(default_model_dir)
    model_bytes = sum(t.nbytes for t in source.tensors())
    cap = 64 * MIB
    assert cap < model_bytes  # the cap is smaller than the model: nothing fits whole
    measured = _stage_peak(default_model_dir, tmp_path / "map.json", "scan")
    geometry = source.geometry
    activations = min(cap // 2, 512 * geometry.hidden_size * 4 * (geometry.num_layers + 1))
    logits_chunk = 256 * geometry.vocab_size * 4
    bound = 3 * _largest_group_f32(default_model_dir) + activations + logits_chunk
    used = measured["peak"] - measured["baseline"]
    print(f"scan: {used / MIB:.0f} MiB above baseline, bound {bound / MIB:.0f} MiB")
    assert used < bound
    assert json.loads((tmp_path / "map.json").read_text())["complete"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the peak RSS")
def test_fast_scan_streams_the_fisher_in_less_than_the_model(default_model_dir, tmp_path):
    """The Fisher pass and its pricing hold the largest group three times in float32 (weights, its Fisher,
    a gradient slice or the round trip) and once more at two bytes a weight (the source's pages as they
    are read, the round trip's packed bytes), the activations and two logits chunks: less than the model
    in float32, which the whole-model way held three times over."""
    from cardfit.scan.signals.fisher import LOGIT_ROWS
    from cardfit.sources import open_model

    source = open_model(default_model_dir)
    geometry = source.geometry
    model_f32 = sum(_numel(t.shape) * 4 for t in source.tensors())
    measured = _stage_peak(default_model_dir, tmp_path / "map.json", "fast")
    activations = 512 * geometry.hidden_size * 4 * (geometry.num_layers + 1)
    largest = _largest_group_f32(default_model_dir)
    bound = 3 * largest + largest // 2 + activations + 2 * LOGIT_ROWS * geometry.vocab_size * 4
    used = measured["peak"] - measured["baseline"]
    print(f"fast scan: {used / MIB:.0f} MiB above baseline, bound {bound / MIB:.0f} MiB, "
          f"model in float32 {model_f32 / MIB:.0f} MiB")
    assert bound < model_f32 and used < bound
    assert json.loads((tmp_path / "map.json").read_text())["complete"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for the peak RSS")
def test_pack_peak_rss_stays_within_two_groups_and_the_tokenizer(default_model_dir, tmp_path):
    measured = _stage_peak(default_model_dir, tmp_path / "model.gguf", "pack")
    bound = 2 * _largest_group_f32(default_model_dir) + measured["tokenizer"]
    used = measured["peak"] - measured["baseline"]
    print(f"pack: {used / MIB:.0f} MiB above baseline, bound {bound / MIB:.0f} MiB")
    assert used < bound
    assert (tmp_path / "model.gguf").stat().st_size > 100 * MIB
