"""Runs the learner: receives trajectory groups over ZeroMQ, trains, publishes weights to Redis."""

from __future__ import annotations

import sys

from common.config import SpecRLConfig
from common.entrypoint import publish_refusal, run_main
from learner.loop import run


def checked_run(cfg: SpecRLConfig) -> object:
    """``run(cfg)``, unless the trajectory socket is published wider than the loopback with no
    CurveZMQ (:func:`common.entrypoint.publish_refusal`): then exit with the reason."""
    refusal = publish_refusal(cfg)
    if refusal is not None:
        raise SystemExit(f"specrl-learner: refusing to start: {refusal}")
    return run(cfg)


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, "specrl-learner", __doc__, checked_run, role="learner")


if __name__ == "__main__":
    sys.exit(main())
