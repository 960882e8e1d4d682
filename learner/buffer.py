"""Admission between the receiver and the optimizer: staleness filter and group-shape check.

``staleness = learner_version - group.version``. A group beyond ``max_staleness`` is dropped and
counted, never silently: the count is a metric, and a run whose actors cannot keep up shows it.
A group whose size differs from the run's group size would break GRPO's per-prompt
normalisation; it is rejected and counted too (a misconfigured or hostile actor must not stop
the learner). With ``signal`` (dynamic sampling, ``learner.dynamic_sampling``) an admitted group
without signal (all rewards equal) is skipped and counted, and the step fills from the next
groups; rank 0 alone collects, so every rank trains on the same groups.

Design: docs/design.md §4.2.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable

from common.link.protocol import TrajectoryGroup
from common.link.receive.admission import Admission
from common.metrics import MetricsWriter

log = logging.getLogger(__name__)


LAG_WINDOW = 8
"""Steps over which :class:`DeliveryLag` keeps its highest reading."""


class DeliveryLag:
    """The weight-delivery lag, in versions: how far the slowest live actor's weights are behind
    the learner's newest version, read once per step from the versions actors report holding
    (heartbeats, at the end of each of their batches). The most over the last
    :data:`LAG_WINDOW` readings is the lag: one reading lands anywhere in a publish/load cycle.

    With a cap (``learner.max_staleness_from_lag``) :meth:`bound` is that lag + 1 (a group is
    generated over at least one more version), never below ``floor`` nor above the cap."""

    def __init__(self, floor: int, cap: int = 0, window: int = LAG_WINDOW) -> None:
        self.floor = floor
        self.cap = cap
        self.readings: deque[int] = deque(maxlen=window)

    @property
    def lag(self) -> int:
        return max(self.readings, default=0)

    def observe(self, learner_version: int, actor_versions: Iterable[int]) -> int:
        """One reading (an actor that has not reported a version yet, -1, is left out); the
        bound in force after it."""
        held = [v for v in actor_versions if v >= 0]
        if held and learner_version >= 0:
            self.readings.append(max(learner_version - min(held), 0))
        return self.bound()

    def bound(self) -> int:
        if self.cap <= 0:
            return self.floor
        return min(max(self.floor, self.lag + 1), self.cap)


class StalenessBuffer:
    def __init__(
        self,
        max_staleness: int,
        admission: Admission,
        ledger: MetricsWriter | None = None,
        signal: Callable[[TrajectoryGroup], bool] | None = None,
    ) -> None:
        self.max_staleness = max_staleness
        self.admission = admission
        """Its group-size rule, applied again to what reaches the buffer without the receiver
        (groups carried over a restart)."""
        self.ledger = ledger
        """When given, one line per group with its outcome (stale, rejected, trained, pending)."""
        self.dropped_stale = 0
        self.rejected = 0
        self.signal = signal
        """Dynamic sampling: whether a group has signal (None: every group is trained on)."""
        self.skipped_no_signal = 0
        self.step = 0
        """The optimizer step being assembled (set by the learner loop; goes into the ledger)."""
        self._carried: deque[TrajectoryGroup] = deque()

    def record(self, group: TrajectoryGroup, outcome: str, learner_version: int) -> None:
        if self.ledger is not None:
            self.ledger.write(
                {
                    "actor_id": group.actor_id,
                    "seq": group.seq,
                    "version": group.version,
                    "learner_version": learner_version,
                    "step": self.step,
                    "outcome": outcome,
                }
            )

    def carry(self, groups: Iterable[TrajectoryGroup]) -> None:
        """Groups acked before a restart but never trained on: consumed first, re-admitted."""
        self._carried.extend(groups)

    def admit(self, group: TrajectoryGroup, learner_version: int) -> bool:
        if (wrong := self.admission.wrong_size(group)) is not None:
            self.rejected += 1
            self._turn_away(
                group,
                "rejected",
                learner_version,
                logging.WARNING,
                "rejected group %s/%d: %s",
                wrong.detail,
            )
            return False
        staleness = learner_version - group.version
        if staleness > self.max_staleness:
            self.dropped_stale += 1
            self._turn_away(
                group,
                "stale",
                learner_version,
                logging.DEBUG,
                "dropped group %s/%d: staleness %d > max_staleness %d",
                staleness,
                self.max_staleness,
            )
            return False
        return True

    def _turn_away(
        self,
        group: TrajectoryGroup,
        outcome: str,
        learner_version: int,
        level: int,
        fmt: str,
        *args: object,
    ) -> None:
        """Put a group that is not trained on in the ledger, and log why (``fmt`` names the
        group's ``actor_id``/``seq`` first, then ``args``)."""
        self.record(group, outcome, learner_version)
        log.log(level, fmt, group.actor_id, group.seq, *args)

    def collect(
        self,
        get: Callable[[float], TrajectoryGroup | None],
        n: int,
        learner_version: int,
        timeout_s: float,
        should_stop: Callable[[], bool] = lambda: False,
        on_idle: Callable[[], None] = lambda: None,
    ) -> list[TrajectoryGroup]:
        """Admitted groups until ``n`` are in hand, or fewer if ``should_stop`` turns true.
        ``on_idle`` runs whenever half a second passes with no group (housekeeping).

        Raises TimeoutError when no group at all arrives for ``timeout_s``.
        """
        batch: list[TrajectoryGroup] = []
        last_arrival = time.monotonic()
        while len(batch) < n:
            group = self._carried.popleft() if self._carried else get(0.5)
            if group is None:
                if should_stop():
                    return batch
                on_idle()
                if time.monotonic() - last_arrival > timeout_s:
                    raise TimeoutError(
                        f"no trajectory group for {timeout_s:.0f}s (have {len(batch)}/{n}); "
                        "are actors running and pointed at learner.address?"
                    )
                continue
            last_arrival = time.monotonic()
            if self.admit(group, learner_version) and self._has_signal(group, learner_version):
                batch.append(group)
        return batch

    def _has_signal(self, group: TrajectoryGroup, learner_version: int) -> bool:
        """False (the group skipped and counted) for a group without signal under dynamic
        sampling."""
        if self.signal is None or self.signal(group):
            return True
        self.skipped_no_signal += 1
        self._turn_away(
            group, "no_signal", learner_version, logging.DEBUG, "skipped group %s/%d: no signal"
        )
        return False

    def pending(self) -> list[TrajectoryGroup]:
        """Carried groups not consumed yet (they go back into the checkpoint)."""
        return list(self._carried)
