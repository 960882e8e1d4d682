"""The README's "default run, measured" table: ``specrl run`` on the embedded default, from a fresh
working directory (no cached warm-start model), timed end to end.

    python -m benchmarks.default_run [--json PATH] [overrides ...]

Runs ``python -m ops.cli run run.name=readme-default`` (what ``bash scripts/run.sh`` runs after
its set-up) in a new temporary directory, so the warm start of the built-in model is part of the
run, then reads the run's ``summary.json`` and writes its figures with the command, the command's
own wall time and the load average. Extra arguments are passed on as Hydra overrides.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import cli

ROOT = Path(__file__).resolve().parent.parent

KEYS = (
    "wall_s",
    "steps",
    "reward_first_10pct",
    "reward_last_10pct",
    "spec_acceptance_first_10pct",
    "spec_acceptance_last_10pct",
    "spec_mean_accepted_len",
    "actor_tokens_per_s",
    "verify_salvaged_frac",
    "verify_steps_with_swaps",
    "staleness_mean",
    "groups_trained",
    "groups_dropped_stale",
    "learner_busy_frac",
)


def main() -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for specrl run")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="specrl-default-run-") as cwd:
        cmd = [sys.executable, "-m", "ops.cli", "run", "run.name=readme-default"]
        cmd += opts.overrides
        env = os.environ | {"PYTHONPATH": str(ROOT)}
        print(f"in a fresh directory {cwd}: {' '.join(cmd[1:])}", flush=True)
        started = time.perf_counter()
        subprocess.run(cmd, cwd=cwd, env=env, check=True)
        seconds = time.perf_counter() - started
        summary = json.loads((Path(cwd) / "runs" / "readme-default" / "summary.json").read_text())
    figures = {k: summary[k] for k in KEYS if k in summary}
    figures |= {
        "run_command": " ".join(["specrl run run.name=readme-default", *opts.overrides]),
        "command_seconds": round(seconds, 1),
        "cpu_count": os.cpu_count(),
    }
    status = cli.finish(figures, opts.json)  # adds the load average at the end
    print(json.dumps(figures, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
