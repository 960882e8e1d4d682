# shellcheck shell=bash
# Sourced (not run) by the scripts that run a module of this repository with whatever python the
# machine has (gpu-check.sh, gpu-node-check.sh): cd to the repository root and set PY to
# .venv/bin/python where one exists, else python3 (a lent GPU machine has no .venv), with
# unbuffered output so progress lines show as they come.
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit
# shellcheck disable=SC2034  # PY: for the script that sources this
if [[ -x .venv/bin/python ]]; then
    PY=.venv/bin/python
else
    PY=python3
fi
export PYTHONUNBUFFERED=1
