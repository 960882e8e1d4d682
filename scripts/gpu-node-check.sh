#!/usr/bin/env bash
# The node check for a machine of at least 2 GPUs with the vLLM image (benchmarks/gpu_check/node.py's
# docstring says what it measures): an FSDP2 step on 2 ranks and the streamed full-state gather
# against one process, the weight plane's GB/s between two GPUs and its kill test (the receiver
# killed mid-transfer, the sender back within its deadline), version tags under swaps and
# prompt-log-prob scoring on vLLM with the V1 runner and the V2 runner with async scheduling.
# Runs in the repository root with .venv/bin/python where one exists, else python3.
#   bash scripts/gpu-node-check.sh              # JSON: $OUT/gpu_node.json, else benchmarks/results/
#   bash scripts/gpu-node-check.sh --json PATH  # JSON: PATH
#   bash scripts/gpu-node-check.sh --cpu        # 2 CPU processes (gloo), tiny sizes (CI)
# Exit status: 0 when every stage that ran passed, 1 when one failed, 2 on a refusal (fewer than
# 2 GPUs without --cpu, bad arguments).
set -euo pipefail
# shellcheck source=scripts/repo-python.sh disable=SC1091  # cd to the repository root; sets PY
source "$(dirname "$0")/repo-python.sh"
exec "$PY" -m benchmarks.gpu_check.node "$@"
