"""``specrl-learner``: the learner process (bind, train, publish, checkpoint)."""

from __future__ import annotations

import sys

from common.entrypoint import parse
from learner.loop import run


def main(argv: list[str] | None = None) -> int:
    cfg = parse(
        sys.argv[1:] if argv is None else argv,
        "specrl-learner",
        "Runs the learner: receives trajectory groups over ZeroMQ, trains, publishes weights to Redis.",
    )
    if cfg is None:
        return 0
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
