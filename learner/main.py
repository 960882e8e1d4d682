"""Runs the learner: receives trajectory groups over ZeroMQ, trains, publishes weights to Redis."""

from __future__ import annotations

import sys

from common.entrypoint import run_main
from learner.loop import run


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, "specrl-learner", __doc__, run)


if __name__ == "__main__":
    sys.exit(main())
