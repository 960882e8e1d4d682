#!/usr/bin/env bash
# The prepared check for a lent GPU machine (benchmarks/gpu_check/__init__.py's docstring says what it
# measures): the torch engine's speculative methods against plain decoding at batch 1 to 128, one
# learner step of a 0.5B model, a weight publish and fetch. Runs in the repository root with the
# machine's own python3 (no .venv there), or .venv/bin/python where one exists; needs torch,
# numpy, msgpack and safetensors only. Batch sizes above 8 are skipped once 420 s are spent, so
# the run ends within 8 minutes.
#   bash scripts/gpu-check.sh              # JSON: $OUT/gpu.json, else benchmarks/results/gpu.json
#   bash scripts/gpu-check.sh --json PATH  # JSON: PATH
#   bash scripts/gpu-check.sh --cpu        # the same code on tiny shapes on the CPU (CI)
set -euo pipefail
# shellcheck source=scripts/repo-python.sh disable=SC1091  # cd to the repository root; sets PY
source "$(dirname "$0")/repo-python.sh"
exec "$PY" -m benchmarks.gpu_check "$@"
