"""Runs one actor: follows weights versions in Redis, generates rollouts, streams them to the learner."""

from __future__ import annotations

import sys

from actors.loop import run
from common.entrypoint import run_main


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, "specrl-actor", __doc__, run)


if __name__ == "__main__":
    sys.exit(main())
