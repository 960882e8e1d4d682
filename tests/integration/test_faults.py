"""Faults against the real pipeline (processes, Redis, sockets), each checked with the ledger:
nothing acked is lost, nothing is trained twice, versions never go backwards, actors survive."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ops.ledger import read_ledger
from ops.processes import Process
from ops.redis_server import RedisServer
from testing.pipeline import Pipeline, wait_exit, warm_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model(tmp_path_factory.mktemp("model"))


def wait_for(cond, timeout_s: float, what: str, pipeline: Pipeline) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}:\n{pipeline.log_tail('learner')}")
        time.sleep(0.2)


def steps_done(pipeline: Pipeline) -> int:
    path = pipeline.run_dir / "metrics.jsonl"
    return len(pipeline.steps()) if path.exists() else 0


def started(pipeline: Pipeline, steps: int) -> Process:
    """The learner and two actors, started and through their first ``steps`` steps."""
    learner = pipeline.start(actors=2)
    wait_for(lambda: steps_done(pipeline) >= steps, 180, f"{steps} steps", pipeline)
    return learner


def assert_exactly_once(pipeline: Pipeline) -> None:
    ledger = read_ledger(pipeline.run_dir)
    assert ledger.trained, "nothing was trained"
    assert not ledger.duplicated(), sorted(ledger.duplicated())[:10]
    assert not ledger.unknown(), sorted(ledger.unknown())[:10]
    assert not ledger.lost(), sorted(ledger.lost())[:10]


def versions_only_grow(pipeline: Pipeline) -> list[int]:
    versions = [r["learner/version"] for r in pipeline.steps()]
    assert versions == sorted(versions) and len(set(versions)) == len(versions), versions
    return versions


def test_actor_sigkill_with_unacked_groups_is_resent_by_its_next_incarnation(
    tmp_path, redis_server, model_dir
):
    pipeline = Pipeline.make(tmp_path, redis_server.url, model_dir, ["run.steps=12"])
    try:
        learner = started(pipeline, steps=3)
        victim = pipeline.actors[0]
        # Freeze the learner so nothing gets acked, let actor 0 fill its outbox, kill it.
        learner.send_signal(signal.SIGSTOP)
        spool = tmp_path / "spool"
        wait_for(lambda: any(spool.glob("*-0/*/*.frame")), 60, "actor 0 to spool a group", pipeline)
        time.sleep(1.0)
        victim.kill()
        victim.wait()
        learner.send_signal(signal.SIGCONT)
        pipeline.actors.remove(victim)
        pipeline.start_actor(0)  # same name: finds the dead incarnation's spool
        assert wait_exit(learner, 300, pipeline) == 0, pipeline.log_tail("learner")
    finally:
        pipeline.stop_all()
    restarted = pipeline.log_tail("actor-0", 400)
    assert "resending" in restarted, restarted
    versions_only_grow(pipeline)
    assert_exactly_once(pipeline)


def test_learner_sigkill_resumes_from_checkpoint_and_write_ahead_log(
    tmp_path, redis_server, model_dir
):
    pipeline = Pipeline.make(
        tmp_path, redis_server.url, model_dir, ["run.steps=16", "learner.checkpoint_every=4"]
    )
    try:
        learner = started(pipeline, steps=6)
        learner.kill()  # no clean exit: no final checkpoint, the log is all there is
        learner.wait()
        time.sleep(2.0)  # actors keep generating into their outboxes meanwhile
        assert all(a.poll() is None for a in pipeline.actors)
        learner = pipeline.start_learner()
        assert wait_exit(learner, 300, pipeline) == 0, pipeline.log_tail("learner")
    finally:
        pipeline.stop_all()
    versions_only_grow(pipeline)
    ledger = read_ledger(pipeline.run_dir)
    assert ledger.learner_starts == 2
    assert "replayed from the write-ahead log" in pipeline.log_tail("learner", 400)
    assert_exactly_once(pipeline)


def test_redis_restart_learner_republishes_and_actors_keep_running(tmp_path, model_dir):
    with RedisServer(password="chaos") as server:
        pipeline = Pipeline.make(tmp_path, server.url, model_dir, ["run.steps=14"])
        try:
            learner = started(pipeline, steps=4)
            server.stop()  # no persistence: Redis comes back empty
            time.sleep(3.0)
            server.start()
            assert wait_exit(learner, 300, pipeline) == 0, pipeline.log_tail("learner")
            # An actor started after the restart finds weights (republished, not lost).
            late = pipeline.start_actor(2, ["actor.max_batches=1"])
            assert late.wait(timeout=120) == 0, pipeline.log_tail("actor-2")
        finally:
            pipeline.stop_all()
    for i, actor in enumerate(pipeline.actors):
        assert actor.returncode == 0, pipeline.log_tail(f"actor-{i}")
    versions_only_grow(pipeline)
    assert "lost Redis" in pipeline.log_tail("actor-0", 400)
    assert_exactly_once(pipeline)


def test_learner_unreachable_for_a_minute_does_not_kill_actors(tmp_path, redis_server, model_dir):
    outage_s = float(os.environ.get("SPECRL_OUTAGE_S", "60"))
    pipeline = Pipeline.make(tmp_path, redis_server.url, model_dir, ["run.steps=8"])
    try:
        learner = started(pipeline, steps=2)
        learner.send_signal(signal.SIGSTOP)  # port open, nobody answering: a hung learner
        time.sleep(outage_s)
        assert all(a.poll() is None for a in pipeline.actors), "an actor died during the outage"
        learner.send_signal(signal.SIGCONT)
        assert wait_exit(learner, 300, pipeline) == 0, pipeline.log_tail("learner")
    finally:
        pipeline.stop_all()
    for i, actor in enumerate(pipeline.actors):
        assert actor.returncode == 0, pipeline.log_tail(f"actor-{i}")
    assert_exactly_once(pipeline)
