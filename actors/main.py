"""``specrl-actor``: one rollout actor (fetch weights from Redis, generate, send to the learner)."""

from __future__ import annotations

import sys

from actors.loop import run
from common.entrypoint import parse


def main(argv: list[str] | None = None) -> int:
    cfg = parse(
        sys.argv[1:] if argv is None else argv,
        "specrl-actor",
        "Runs one actor: follows weights versions in Redis, generates rollouts, streams them to the learner.",
    )
    if cfg is None:
        return 0
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
