"""What the torch engine's tests share: a weight source that publishes once mid-call, and a
clock that keeps the adaptive draft-length controller changing its mind."""

from __future__ import annotations

import random
from collections.abc import Callable

from common.model import Transformer


def swap_after(steps: int, version: int, new: Transformer):
    """A weight source that delivers ``new`` as ``version`` once, at its ``steps``-th poll (the
    engine polls once per decoding step)."""
    calls = {"n": 0}

    def source():
        calls["n"] += 1
        return (version, new.state_dict()) if calls["n"] == steps else None

    return source


def jittery_clock(seed: int) -> Callable[[], float]:
    """A clock whose every reading is 0.1 to 2 units later than the last: step times the
    controller cannot make sense of, so it keeps changing k."""
    rng, now = random.Random(seed), [0.0]

    def clock() -> float:
        now[0] += rng.uniform(0.1, 2.0)
        return now[0]

    return clock
