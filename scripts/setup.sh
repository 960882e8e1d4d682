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
stamp=.venv/.specrl-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev]'
  touch "$stamp"
fi
