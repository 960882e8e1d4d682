"""Staleness filter between the receiver and the optimizer.

``staleness = learner_version - group.version``. A group beyond ``max_staleness`` is dropped and
counted, never silently: the count is a metric, and a run whose actors cannot keep up shows it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from common.metrics import MetricsWriter
from common.protocol import TrajectoryGroup

log = logging.getLogger(__name__)


class StalenessBuffer:
    def __init__(self, max_staleness: int, ledger: MetricsWriter | None = None) -> None:
        self.max_staleness = max_staleness
        self.ledger = ledger
        """When given, one line per group consumed: ``(actor_id, seq)`` and its outcome."""
        self.dropped_stale = 0
        self.accepted = 0

    def record(self, group: TrajectoryGroup, outcome: str, learner_version: int) -> None:
        if self.ledger is not None:
            self.ledger.write(
                {
                    "actor_id": group.actor_id,
                    "seq": group.seq,
                    "version": group.version,
                    "learner_version": learner_version,
                    "outcome": outcome,
                }
            )

    def admit(self, group: TrajectoryGroup, learner_version: int) -> bool:
        staleness = learner_version - group.version
        if staleness > self.max_staleness:
            self.dropped_stale += 1
            self.record(group, "stale", learner_version)
            log.debug(
                "dropped group %s/%d: staleness %d > max_staleness %d",
                group.actor_id,
                group.seq,
                staleness,
                self.max_staleness,
            )
            return False
        self.accepted += 1
        self.record(group, "trained", learner_version)
        return True

    def collect(
        self,
        get: Callable[[float], TrajectoryGroup | None],
        n: int,
        learner_version: int,
        timeout_s: float,
        on_wait: Callable[[], None] | None = None,
    ) -> list[TrajectoryGroup]:
        """Pull groups from ``get`` until ``n`` fresh ones are in hand.

        Raises TimeoutError when no group at all arrives for ``timeout_s``.
        """
        batch: list[TrajectoryGroup] = []
        last_arrival = time.monotonic()
        while len(batch) < n:
            group = get(0.5)
            if group is None:
                if on_wait is not None:
                    on_wait()
                if time.monotonic() - last_arrival > timeout_s:
                    raise TimeoutError(
                        f"no trajectory group for {timeout_s:.0f}s (have {len(batch)}/{n}); "
                        "are actors running and pointed at learner.address?"
                    )
                continue
            last_arrival = time.monotonic()
            if self.admit(group, learner_version):
                batch.append(group)
        return batch
