#!/usr/bin/env bash
# The CUDA-only checks in one short run (under 8 minutes on one GPU):
#   1. python -m bench.gpu_checks: Triton kernels vs the torch references on the
#      device, a greedy fp32 conversation on CUDA vs the CPU engine, host-tier
#      swaps (pinned memory, swap stream) with unchanged greedy tokens, and a
#      restart served from the disk tier through pinned staging (the warm-up's
#      disk load, the preload into pinned memory, the turn's loads from it);
#   2. python -m bench.kernels: the paged-attention bandwidth table (record it
#      in docs/kernels.md).
# Without a CUDA device it says so and exits 0. Exit status: failed checks.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA device: nothing to check"
  exit 0
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

status=0
timeout 330 "$PY" -m bench.gpu_checks --device cuda || status=$?
echo
timeout 120 "$PY" -m bench.kernels --repeats 10 || status=$((status + 1))
exit "$status"
