"""Multi-turn episodes through the whole pipeline: a learner and an actor as OS processes (real
Redis, ZeroMQ), the actor running the built-in ``lookup`` environment on the tiny char model
(actors/episodes/runner.py), the learner training on protocol v2 groups (sampled tokens only),
the evaluating actor playing held-out episodes (actors/episodes/evaluation.py)."""

from __future__ import annotations

import json

import pytest

from common import metric_names as mn
from ops.ledger import read_ledger
from testing.pipeline import Pipeline, warm_model

pytestmark = pytest.mark.integration

STEPS = 4
EPISODES = [
    "env.name=lookup",
    "env.max_turn_tokens=10",
    "env.max_total_tokens=100",
    "env.max_obs_tokens=32",
    "actor.prompts_per_batch=2",
    "env.problems_in_flight=1",  # the second problem admitted as the first one's group ends
    "learner.groups_per_step=2",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model(tmp_path_factory.mktemp("model"), steps=40)


def test_lookup_episodes_train_end_to_end(tmp_path, redis_server, model_dir):
    evaluation = ["eval.every=2", "eval.prompts=4", "eval.samples=2"]
    pipeline = Pipeline.make(
        tmp_path, redis_server.url, model_dir, [f"run.steps={STEPS}", *EPISODES, *evaluation]
    )
    pipeline.run_to_end(actors=1, timeout_s=300)
    assert pipeline.actors[0].returncode == 0, pipeline.log_tail("actor-0")
    steps = pipeline.steps()
    assert len(steps) == STEPS
    assert all(r.get(f"{mn.RECEIVER_BAD_FRAMES_PREFIX}wrong_version", 0) == 0 for r in steps)
    unknown = {k for r in steps for k in r if "/" in k and not mn.is_known(k)}
    assert not unknown, sorted(unknown)
    # The groups were episodes: several turns each, part of their tokens the environment's.
    assert all(r[mn.ENV_TURNS_MEAN] >= 1.0 for r in steps), steps
    assert all(0.0 <= r[mn.ENV_TOKEN_FRAC] < 1.0 for r in steps), [
        r[mn.ENV_TOKEN_FRAC] for r in steps
    ]
    assert max(r[mn.ENV_TOKEN_FRAC] for r in steps) > 0.0, [r[mn.ENV_TURNS_MEAN] for r in steps]
    ledger = read_ledger(tmp_path)
    assert ledger.trained and set(ledger.consumed) <= set(ledger.submitted)
    log = (tmp_path / "actor-0.log").read_text()
    assert "Traceback" not in log, pipeline.log_tail("actor-0")
    # The held-out evaluation played episodes too (eval.every with an environment): each
    # evaluation's episodes in the samples file (the learner's records carry the figures only
    # once a heartbeat brought them, which a 4-step run may end before).
    (path,) = (tmp_path / "eval").glob("*.jsonl")  # named by the actor id
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records, pipeline.log_tail("actor-0")
    for record in records:
        assert len(record["problems"]) == 4
        assert all(
            len(p["episodes"]) == 2 and p["episodes"][0]["turns"] for p in record["problems"]
        )
    assert "eval of version" in log
