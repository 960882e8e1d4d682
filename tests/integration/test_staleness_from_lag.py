"""``learner.max_staleness_from_lag``: the learner's staleness bound follows the measured
weight-delivery lag, on a real learner process fed over a real socket by an actor whose weights
never arrive (it holds version 0 and says so in its heartbeats): its groups, up to the cap, are
trained instead of dropped, and the figures show the bound and the lag it followed."""

from __future__ import annotations

import json
import threading

import pytest

from common import metric_names as mn
from common.link.send.sender import GroupSender
from testing.hostile import valid_group
from testing.pipeline import Pipeline, wait_exit, warm_model

pytestmark = pytest.mark.integration

GROUP = 4
FLOOR, CAP, STEPS = 1, 4, 5


def feed_from_version_zero(address: str, stop: threading.Event) -> None:
    """An actor that never loads a version: every group and heartbeat says version 0."""
    with GroupSender(address, "lagging", outbox_max=2, heartbeat_interval_s=0.2) as sender:
        sender.set_status(0, {})
        seq = 0
        while not stop.is_set():
            try:
                sender.submit(valid_group("lagging", seq, GROUP, version=0), timeout_s=0.5)
                seq += 1
            except TimeoutError:
                continue  # outbox full while the learner trains


def test_the_bound_follows_an_actor_whose_weights_lag(tmp_path, redis_server):
    model = warm_model(tmp_path / "model")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    extra = [
        f"actor.group_size={GROUP}",
        "learner.groups_per_step=1",
        f"learner.max_staleness={FLOOR}",
        f"learner.max_staleness_from_lag={CAP}",
        "learner.group_timeout_s=120",
        f"run.steps={STEPS}",
        "run.torch_threads=1",
    ]
    pipeline = Pipeline.make(run_dir, redis_server.url, model, extra)
    address = next(o for o in pipeline.overrides if o.startswith("learner.address="))
    stop = threading.Event()
    feeder = threading.Thread(
        target=feed_from_version_zero, args=(address.split("=", 1)[1], stop), daemon=True
    )
    try:
        learner = pipeline.start_learner()
        feeder.start()
        assert wait_exit(learner, 300, pipeline) == 0, pipeline.log_tail("learner")
    finally:
        stop.set()
        feeder.join(timeout=30)
        pipeline.stop_all()
    steps = pipeline.steps()
    assert [r[mn.LEARNER_VERSION] for r in steps] == [1, 2, 3, 4, 5]
    # Step at learner version v (before its publish: v = step - 1): the slowest actor holds 0,
    # so the lag is v and the bound v + 1, between the floor and the cap.
    lags = [r[mn.LEARNER_WEIGHT_DELIVERY_LAG] for r in steps]
    assert lags == [0, 1, 2, 3, 4]
    assert [r[mn.LEARNER_MAX_STALENESS] for r in steps] == [
        min(max(FLOOR, lag + 1), CAP) for lag in lags
    ]
    ledger = [
        json.loads(line)
        for line in (run_dir / "ledger" / "learner.jsonl").read_text().splitlines()
        if '"outcome"' in line
    ]
    trained = [r["learner_version"] - r["version"] for r in ledger if r["outcome"] == "trained"]
    # Groups max_staleness=1 alone would have dropped: trained, up to the cap.
    assert sorted(trained) == [0, 1, 2, 3, 4]
    assert all(r["learner_version"] - r["version"] > CAP for r in ledger if r["outcome"] == "stale")
