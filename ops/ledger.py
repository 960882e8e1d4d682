"""Reading the exactly-once ledger of a run (``run.ledger=true``): what was produced, what was
consumed, and what went missing or twice.

Actors write ``ledger/actor-{actor_id}.jsonl``: ``submitted`` when a group enters the outbox, and
at a clean exit the seqs still unacked. The learner writes ``ledger/learner.jsonl``: one outcome
per group (``trained``, ``skipped``, ``stale``, ``rejected``, ``pending_at_exit``, ``refused``), a
``checkpoint`` event after each checkpoint is on disk and a ``start`` event when it starts.

``refused`` (admission, common/link/receive/admission.py) is final when it is written: the group was acked as
refused, never logged, and no restart brings it back. It is kept apart from the consumed groups:
a hostile peer's refused groups were never produced by an actor of the run, and are not
"unknown" consumption.

A learner killed outright resumes from its last checkpoint: the steps after it are lost with the
model state, and the groups they consumed come back from the write-ahead log. So outcomes logged
after the last checkpoint of a learner that did not stop cleanly are *void* once the next learner
starts, and the same groups' new outcomes count instead.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ops.metrics_file import read_metrics

Key = tuple[str, int]


@dataclass
class Ledger:
    submitted: Counter = field(default_factory=Counter)
    """(actor_id, seq) -> times an actor put it in its outbox (1, or 2 if replayed from a spool)."""
    consumed: Counter = field(default_factory=Counter)
    """(actor_id, seq) -> times the learner trained, dropped as stale or rejected it (voided
    outcomes excluded): each must be exactly 1."""
    outcomes: dict[Key, str] = field(default_factory=dict)
    unacked_at_exit: set[Key] = field(default_factory=set)
    pending_at_exit: set[Key] = field(default_factory=set)
    """Acked by a learner that stopped before training them (carried in its checkpoint)."""
    trained: list[dict] = field(default_factory=list)
    refused: Counter = field(default_factory=Counter)
    """(actor_id, seq) -> times the learner refused it (admission; never trained)."""
    voided: int = 0
    """Outcomes rolled back by a learner restart (counted once, after the replay)."""
    learner_starts: int = 0

    @property
    def produced(self) -> set[Key]:
        return set(self.submitted)

    def lost(self) -> set[Key]:
        """Produced, never consumed, and not carried over by a clean exit."""
        return (
            self.produced
            - set(self.consumed)
            - set(self.refused)
            - self.pending_at_exit
            - self.unacked_at_exit
        )

    def duplicated(self) -> set[Key]:
        return {k for k, n in self.consumed.items() if n > 1}

    def unknown(self) -> set[Key]:
        """Consumed but never produced (a forged or corrupted identity)."""
        return set(self.consumed) - self.produced


def read_ledger(run_dir: Path) -> Ledger:
    ledger = Ledger()
    for path in sorted((run_dir / "ledger").glob("actor-*.jsonl")):
        for row in read_metrics(path):
            if row["event"] == "submitted":
                ledger.submitted[(row["actor_id"], row["seq"])] += 1
            elif row["event"] == "exit":
                ledger.unacked_at_exit.update((row["actor_id"], s) for s in row["unacked"])
    since_checkpoint: list[dict] = []
    committed: list[dict] = []
    pending: set[Key] = set()
    for row in read_metrics(run_dir / "ledger" / "learner.jsonl"):
        event = row.get("event")
        if event == "checkpoint":
            committed += since_checkpoint
            since_checkpoint = []
        elif event == "start":
            # The previous learner's outcomes after its last checkpoint are void (see above); a
            # clean exit ends with a checkpoint, so then nothing is.
            ledger.voided += sum(r["outcome"] != "pending_at_exit" for r in since_checkpoint)
            since_checkpoint = []
            ledger.learner_starts += 1
        elif row.get("outcome") == "refused":
            ledger.refused[(row["actor_id"], row["seq"])] += 1
        elif "outcome" in row:
            since_checkpoint.append(row)
    committed += since_checkpoint
    for row in committed:
        key = (row["actor_id"], row["seq"])
        if row["outcome"] == "pending_at_exit":
            pending.add(key)
            continue
        ledger.consumed[key] += 1
        ledger.outcomes[key] = row["outcome"]
        if row["outcome"] == "trained":
            ledger.trained.append(row)
    # A group carried over and consumed by the next learner run is no longer pending.
    ledger.pending_at_exit = pending - set(ledger.consumed)
    return ledger
