"""The reward sandbox against a hostile reward, and what it costs per call.

    python -m benchmarks.sandbox [--json PATH] [--calls 40]

Runs every escape attempt of ``actors/rewards/escapes.py`` (the list the hostile-reward suite,
``tests/security/``, runs too) against a sandboxed reward pool (``task.reward_sandbox=true``) and
counts those that got through. Then times ``--calls`` calls of a trivial file reward (``return
1.0``), one at a time, through a pool of one worker with and without the sandbox: the sandboxed
pool starts a fresh confined process for every call, the unsandboxed one keeps its worker.

Figures: ``sandbox_escapes_tried``, ``sandbox_escapes_succeeded`` (and the names of both lists,
``sandbox_escapes``: each attempt with its outcome), ``sandbox_call_ms_median`` and
``unsandboxed_call_ms_median`` (per call), ``sandbox_call_overhead_ms`` (their difference),
``sandbox_backend`` (the bubblewrap version) and ``sandbox_uid_mode`` (``root, setpriv to 65534``
or ``user namespace``).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from actors.rewards import sandbox
from actors.rewards.escapes import ATTEMPTS, run_attempt, staged
from actors.rewards.pool import RewardCall, RewardPool
from benchmarks.cli import finish, parser


def escapes() -> dict[str, str]:
    """Each attempt's name: ``held`` or ``ESCAPED``, with its call's outcome."""
    results = {}
    for attempt in ATTEMPTS:
        with staged() as stage:
            escaped, outcome = run_attempt(attempt, stage)
        results[attempt.name] = f"{'ESCAPED' if escaped else 'held'} ({outcome})"
        print(f"{attempt.name:30s} {results[attempt.name]}", file=sys.stderr)
    return results


def call_ms(sandboxed: bool, calls: int) -> float:
    """The median milliseconds of one call through a one-worker pool, calls one at a time."""
    with tempfile.TemporaryDirectory() as tmp:
        reward = Path(tmp) / "trivial_reward.py"
        reward.write_text("def score(prompt, completion, row):\n    return 1.0\n")
        with RewardPool(f"{reward}:score", workers=1, sandbox=sandboxed) as pool:
            times = []
            for _ in range(calls):
                started = time.perf_counter()
                (outcome,) = pool.score([RewardCall("p", "c", {})])
                times.append((time.perf_counter() - started) * 1000)
                assert outcome.reward == 1.0, outcome
    return statistics.median(times)


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--calls", type=int, default=40)
    args = p.parse_args()
    started = time.perf_counter()
    sandbox.check()
    results = escapes()
    sandboxed, plain = call_ms(True, args.calls), call_ms(False, args.calls)
    figures = {
        "sandbox_escapes_tried": len(results),
        "sandbox_escapes_succeeded": sum(v.startswith("ESCAPED") for v in results.values()),
        "sandbox_escapes": results,
        "sandbox_call_ms_median": round(sandboxed, 1),
        "unsandboxed_call_ms_median": round(plain, 2),
        "sandbox_call_overhead_ms": round(sandboxed - plain, 1),
        "sandbox_calls_timed": args.calls,
        "sandbox_backend": sandbox.backend(),
        "sandbox_uid_mode": "root, setpriv to 65534" if os.geteuid() == 0 else "user namespace",
    }
    for key in ("sandbox_escapes_tried", "sandbox_escapes_succeeded", "sandbox_call_overhead_ms"):
        print(f"{key}: {figures[key]}")
    return finish(figures, args.json, started)


if __name__ == "__main__":
    sys.exit(main())
