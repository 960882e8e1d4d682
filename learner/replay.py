"""Groups an earlier learner acked but never trained on (its write-ahead log and its checkpoint's
pending list), admitted again by this learner; and the ledger lines of refused groups."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from common.config import SpecRLConfig
from common.link.protocol import DecodeLimits, TrajectoryGroup
from common.link.receive.admission import Admission
from common.link.receive.wal import replay, trim
from common.metrics import MetricsWriter
from learner.wiring import LearnerState

log = logging.getLogger(__name__)


@dataclass
class Readmission:
    """Groups that an earlier learner acked (in its log or checkpoint) put through this
    learner's decode limits and admission again; the refused are skipped, counted and put in
    the ledger, never trained and never a reason to stop."""

    limits: DecodeLimits
    admission: Admission
    skipped: int = 0
    refused: list[tuple[str, int, int, str]] = field(default_factory=list)

    def undecodable(self, what: str) -> None:
        self.skipped += 1
        log.error("learner: skipped a logged group this learner cannot decode: %s", what)

    def admit(self, groups: list[TrajectoryGroup], latest_version: int) -> list[TrajectoryGroup]:
        kept = []
        for group in groups:
            refusal = self.admission.refusal(group, latest_version)
            if refusal is None:
                kept.append(group)
                continue
            self.skipped += 1
            self.refused.append((group.actor_id, group.seq, group.version, refusal.reason))
            log.error(
                "learner: skipped logged group %s/%d: %s (%s)",
                group.actor_id,
                group.seq,
                refusal.reason,
                refusal.detail,
            )
        return kept


def replay_wal(
    wal_dir: Path, state: LearnerState, cfg: SpecRLConfig, readmission: Readmission
) -> list[TrajectoryGroup]:
    """Groups acked after the checkpoint (or since a fresh start) by a learner that did not stop
    cleanly; empty for a resume=false run, whose old log is discarded."""
    if not cfg.learner.resume:
        trim(wal_dir, 2**62)
        return []
    replayed = replay(wal_dir, state.wal_from, readmission.limits, readmission.undecodable)
    if replayed:
        log.info(
            "learner: %d acked group(s) replayed from the write-ahead log (segments >= %d)",
            len(replayed),
            state.wal_from,
        )
    return replayed


def record_refused(
    ledger: MetricsWriter | None, refused: list[tuple[str, int, int, str]], state: LearnerState
) -> None:
    """Refused groups' outcomes: final when they happen (acked as refused, never logged), so a
    learner restart never voids them."""
    if ledger is None:
        return
    for actor_id, seq, version, reason in refused:
        ledger.write(
            {
                "actor_id": actor_id,
                "seq": seq,
                "version": version,
                "learner_version": state.version,
                "step": state.step,
                "outcome": "refused",
                "reason": reason,
            }
        )
