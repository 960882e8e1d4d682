"""No single frame may crash the learner or poison the policy: poisoned but well-formed frames,
and frames far over its bounds (16 and 63 MiB among them), against a real ``specrl-learner``
process (real Redis, real sockets), then a valid group that must still be acked and trained.
Every one of them is counted on /metrics."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import msgpack
import pytest
import torch

from common.link.protocol import encode
from common.link.receive.wal import _LEN
from common.link.transport import connect_dealer
from common.model import load_pretrained
from learner.checkpoint import latest_checkpoint
from ops.ledger import read_ledger
from testing.hostile import (
    oversized_frames,
    poisoned_frames,
    refused_seqs,
    replies,
    send_when_connected,
    valid_group,
)
from testing.pipeline import Pipeline, wait_exit, warm_model
from testing.prometheus import scrape as scrape_port

pytestmark = pytest.mark.integration

GROUP_SIZE = 8  # actor.group_size's default: what the learner admits
HOSTILE = "hostile"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model(tmp_path_factory.mktemp("model"), steps=20)


def context_of(model_dir: Path) -> int:
    return load_pretrained(model_dir).args.max_position_embeddings


def learner_address(pipeline: Pipeline) -> str:
    return next(o for o in pipeline.overrides if o.startswith("learner.address=")).split("=", 1)[1]


def scrape(run_dir: Path) -> dict[tuple[str, tuple], float]:
    return scrape_port(int((run_dir / "prometheus" / "learner.port").read_text()))


def wait_for_port_file(pipeline: Pipeline, timeout_s: float = 120.0) -> None:
    path = pipeline.run_dir / "prometheus" / "learner.port"
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert pipeline.learner.poll() is None, pipeline.log_tail("learner")
        assert time.monotonic() < deadline, "the learner never served /metrics"
        time.sleep(0.2)


def assert_policy_finite(run_dir: Path) -> None:
    model = load_pretrained(latest_checkpoint(run_dir / "checkpoints"))
    bad = [n for n, p in model.state_dict().items() if not torch.isfinite(p).all()]
    assert not bad, f"non-finite tensors in the trained policy: {bad[:5]}"


def test_poisoned_and_oversized_frames_are_refused_counted_live_and_a_valid_group_still_trains(
    tmp_path, redis_server, model_dir
):
    pipeline = Pipeline.make(
        tmp_path,
        redis_server.url,
        model_dir,
        ["run.steps=1", "learner.groups_per_step=1", f"actor.group_size={GROUP_SIZE}"],
    )
    # The oversized ones first: libzmq used to drop each with its connection, unseen; now they
    # are read, counted and the connection serves the rest.
    poisons = oversized_frames(HOSTILE, first_seq=1000) + poisoned_frames(
        HOSTILE, GROUP_SIZE, context_of(model_dir), latest_version=0
    )
    refused = {p.seq: p.reason for p in poisons if p.verdict == "refused"}
    try:
        learner = pipeline.start_learner()
        wait_for_port_file(pipeline)
        dealer = connect_dealer(learner_address(pipeline), HOSTILE.encode())
        try:
            for poison in poisons:
                send_when_connected(dealer, [poison.frame])

            acks = replies(dealer, lambda a: len(refused_seqs(a)) >= len(refused), timeout_s=30)
            sent_at = time.monotonic()
            # Every refused group comes back refused, with its reason; nothing is acked as taken.
            assert refused_seqs(acks) == refused
            assert not [s for a in acks for s in a.seqs], "a poisoned group was acked as accepted"
            assert learner.poll() is None, pipeline.log_tail("learner")

            # The counters are on /metrics within a second, with no optimizer step taken.
            want_refused = Counter(p.reason for p in poisons if p.verdict == "refused")
            want_bad = Counter(p.reason for p in poisons if p.verdict == "bad")
            while True:
                metrics = scrape(pipeline.run_dir)
                shown_refused = {
                    r: metrics.get(("specrl_learner_groups_refused_total", (("reason", r),)))
                    for r in want_refused
                }
                shown_bad = {
                    r: metrics.get(("specrl_learner_bad_frames_total", (("reason", r),)))
                    for r in want_bad
                }
                shown_all = {
                    r: metrics.get(("specrl_learner_frames_refused_total", (("reason", r),)))
                    for r in want_refused + want_bad
                }
                if (
                    shown_refused == want_refused
                    and shown_bad == want_bad
                    and shown_all == want_refused + want_bad
                ):
                    break
                assert time.monotonic() - sent_at < 1.0, (shown_refused, shown_bad, shown_all)
                time.sleep(0.05)
            assert metrics.get(("specrl_learner_step", ()), 0) == 0  # no step yet
            # Read and refused on the one connection: the socket dropped none of them.
            assert metrics[("specrl_learner_connections_closed_total", ())] == 0

            # A valid group sent afterwards is acked as accepted and trained.
            good = valid_group(HOSTILE, 10_000, GROUP_SIZE)
            send_when_connected(dealer, [encode(good)])
            acks = replies(dealer, lambda acks: any(a.seqs for a in acks), timeout_s=60)
            assert [s for a in acks for s in a.seqs] == [10_000]
        finally:
            dealer.close(linger=0)
        assert wait_exit(learner, 120, pipeline) == 0, pipeline.log_tail("learner")
    finally:
        pipeline.stop_all()
    [step] = pipeline.steps()
    assert step["learner/step"] == 1 and step["learner/skipped_steps"] == 0
    assert step["learner/loss"] is not None  # a NaN would be written as null
    assert_policy_finite(pipeline.run_dir)
    ledger = read_ledger(pipeline.run_dir)
    assert set(ledger.refused) == {(HOSTILE, seq) for seq in refused}
    assert ledger.outcomes == {(HOSTILE, 10_000): "trained"}


def write_wal(directory: Path, records: list[bytes]) -> None:
    directory.mkdir(parents=True)
    with (directory / "00000000.wal").open("wb") as f:
        for record in records:
            f.write(_LEN.pack(len(record)) + record)


def test_a_logged_group_this_learner_refuses_is_skipped_and_counted_not_a_crash_loop(
    tmp_path, redis_server, model_dir
):
    """A write-ahead log written by an earlier learner (laxer checks, or a flipped bit) holds a
    record that no longer decodes and a group this learner refuses, then a good group: the
    learner starts, skips and counts the two, trains the good one."""
    wrong_size = valid_group("actor-a", 0, GROUP_SIZE - 1)
    good = valid_group("actor-a", 2, GROUP_SIZE)
    undecodable = msgpack.packb({"v": 1, "type": "group", "seq": 1})
    write_wal(tmp_path / "wal", [encode(wrong_size), undecodable, encode(good)])
    pipeline = Pipeline.make(
        tmp_path,
        redis_server.url,
        model_dir,
        ["run.steps=1", "learner.groups_per_step=1", f"actor.group_size={GROUP_SIZE}"],
    )
    learner = pipeline.start_learner()
    try:
        assert wait_exit(learner, 120, pipeline) == 0, pipeline.log_tail("learner")
    finally:
        pipeline.stop_all()
    [step] = pipeline.steps()
    assert step["learner/wal_skipped"] == 2
    log_text = pipeline.log_tail("learner", 400)
    assert "skipped logged group actor-a/0: wrong_group_size" in log_text
    assert "cannot decode" in log_text
    ledger = read_ledger(pipeline.run_dir)
    assert set(ledger.refused) == {("actor-a", 0)}
    assert ledger.outcomes == {("actor-a", 2): "trained"}
    assert_policy_finite(pipeline.run_dir)
