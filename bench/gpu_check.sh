#!/usr/bin/env bash
# The checks that need a GPU, as one table (bench/gpu_check.py says what each row measures):
#   bash bench/gpu_check.sh          # one CUDA GPU, Qwen2.5-0.5B's shape with random weights: under 8 minutes
#   bash bench/gpu_check.sh --cpu    # CPU, the bundled tiny model, small batches: under a minute
# Offline: the checkpoint is built on the spot and transformers never reaches the network.
# PYTHON picks the interpreter (default: the project's .venv, else python3); GPU_CHECK_TRACEBACK=1 prints
# the traceback of a failed row.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$PYTHON" bench/gpu_check.py "$@"
