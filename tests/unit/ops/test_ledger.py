"""The exactly-once ledger: voided outcomes after a learner restart, refused groups kept apart."""

from __future__ import annotations

import json
from pathlib import Path

from ops.ledger import read_ledger


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def outcome(seq: int, outcome: str, actor: str = "a") -> dict:
    return {"actor_id": actor, "seq": seq, "outcome": outcome}


def test_refused_groups_are_final_apart_from_consumed_and_never_unknown(tmp_path: Path) -> None:
    write(
        tmp_path / "ledger" / "actor-a.jsonl",
        [{"event": "submitted", "actor_id": "a", "seq": s} for s in range(4)],
    )
    write(
        tmp_path / "ledger" / "learner.jsonl",
        [
            {"event": "start"},
            outcome(0, "trained"),
            {"event": "checkpoint"},
            outcome(1, "trained"),  # voided: the learner is killed before its next checkpoint
            outcome(2, "refused"),  # final when written: acked as refused, never logged
            outcome(9, "refused", actor="hostile"),  # a peer that is no actor of the run
            {"event": "start"},
            outcome(1, "trained"),  # replayed from the write-ahead log
            outcome(3, "skipped"),
            {"event": "checkpoint"},
        ],
    )
    ledger = read_ledger(tmp_path)
    assert ledger.voided == 1
    assert set(ledger.refused) == {("a", 2), ("hostile", 9)}
    assert ledger.outcomes == {("a", 0): "trained", ("a", 1): "trained", ("a", 3): "skipped"}
    assert not ledger.lost() and not ledger.duplicated() and not ledger.unknown()


def test_a_group_never_consumed_nor_refused_is_lost(tmp_path: Path) -> None:
    write(
        tmp_path / "ledger" / "actor-a.jsonl",
        [{"event": "submitted", "actor_id": "a", "seq": s} for s in range(2)],
    )
    write(tmp_path / "ledger" / "learner.jsonl", [{"event": "start"}, outcome(0, "trained")])
    assert read_ledger(tmp_path).lost() == {("a", 1)}
