#!/usr/bin/env bash
# The CUDA checks, in one call under 10 minutes, for when a GPU is lent (device tool: run this script).
# Prints what docs/benchmarks.md records: the cuda-marked tests, then the scan's throughput and peak
# device memory on the embedded model and on the Qwen2.5-1.5B shape (the real weights when fetched,
# else random weights of its geometry: 1.1 GB does not travel to the GPU machine).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device",
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
PY
python3 -m pytest -q -m cuda tests/test_engine.py -p no:cacheprovider 2>&1 | tail -5
timeout 120 python3 bench/gpu_scan.py --tokens 2048
model="${CARDFIT_CACHE:-$HOME/.cache/cardfit}/models/qwen2.5-coder-1.5b.gguf"
[ -f "$model" ] || model="shape:qwen2.5-1.5b"
timeout 300 python3 bench/gpu_scan.py "$model" --tokens 1024
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
