#!/usr/bin/env bash
# Set-up (first time) + the embedded default run: private Redis, learner, 2 actors, tiny model.
# Extra arguments are Hydra overrides, e.g. `bash scripts/run.sh actor.num_actors=3 task=addition`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/specrl run "$@"
