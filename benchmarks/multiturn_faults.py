"""The faulty ``lookup`` environment of ``benchmarks/multiturn_chaos.py``, in a module of its
own: worker processes import it (``env.workers > 0``), and it imports only the built-in
environment (no torch), so a replaced worker starts in a tenth of a second."""

from __future__ import annotations

import os
import time

from actors.episodes.builtin import LookupEnv
from common.lookup import BAD

FAULTS = {"crash": 20, "hang": 10, "huge": 10, "huge_mib": 5, "malformed": 50}
"""Injected episodes per fault (the design's counts)."""
HUGE_CHARS = 40_000
HUGE_MIB = 2 << 20


class ChaosLookup(LookupEnv):
    """``lookup`` with a fault at the first step of the first sibling of some problems:
    those ``plan`` names (seed, as text -> fault), or with ``every`` > 0 (seeds drawn at random,
    as an actor draws them) every problem whose seed is a multiple of ``every``, its fault
    cycling through :data:`FAULTS` with the seed."""

    def __init__(
        self,
        plan: dict[str, str] | None = None,
        in_process: bool = False,
        hang_s: float = 3600,
        every: int = 0,
    ) -> None:
        super().__init__()
        self.plan, self.in_process, self.hang_s = dict(plan or {}), in_process, hang_s
        self.every = every
        self.fault: str | None = None
        self.steps = 0

    def reset(self, *, seed: int, options: dict | None = None) -> tuple[str, dict]:
        sibling = (options or {}).get("sibling", 0)
        self.fault = self.plan.get(str(seed)) if sibling == 0 else None
        if sibling == 0 and self.every and seed % self.every == 0:
            kinds = list(FAULTS)
            self.fault = kinds[(seed // self.every) % len(kinds)]
        self.steps = 0
        return super().reset(seed=seed, options=options)

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.steps += 1
        fault = self.fault if self.steps == 1 else None
        if fault == "crash":
            if self.in_process:
                raise RuntimeError("chaos: crash (in-process environments raise instead)")
            os._exit(3)
        if fault == "hang":
            time.sleep(self.hang_s)
        if fault in ("huge", "huge_mib"):
            self.turns += 1
            size = HUGE_CHARS if fault == "huge" else HUGE_MIB
            return "=" + "7" * size + ">", 0.0, False, False, {}
        if fault == "malformed":
            self.turns += 1
            return BAD, 0.0, False, self.turns >= self.max_turns, {"malformed": True}
        return super().step(action)
