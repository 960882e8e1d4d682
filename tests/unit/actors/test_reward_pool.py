"""task.reward: a user's function in worker processes, with its failures counted, never fatal."""

from __future__ import annotations

import math
import os
import socket
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from actors.rewards import sandbox
from actors.rewards.pool import RewardCall, RewardPool, RewardPoolError
from actors.rewards.scoring import PoolScorer, TaskScorer, outcome_stats, problem_row
from actors.rewards.spec import RewardOutcome, RewardSpecError, combine, parse_reward_spec
from common import metric_names as mn
from common.config import load_config
from common.tasks import Problem, make_task

REWARDS = textwrap.dedent(
    """
    import math, os, socket, time

    def exact(prompt, completion, row):
        return float(completion.strip() == row["answer"])

    def parts(prompt, completion, row):
        return {"correct": float(completion == row["answer"]), "short": 0.5}

    def raises(prompt, completion, row):
        raise ValueError("no answer here")

    def hangs(prompt, completion, row):
        time.sleep(60)

    def nan(prompt, completion, row):
        return math.nan

    def exits(prompt, completion, row):
        os._exit(3)

    def text(prompt, completion, row):
        return "high"

    def loud(prompt, completion, row):
        print("a reward that prints")  # must not corrupt the replies
        return 1

    def connects(prompt, completion, row):
        socket.create_connection(("127.0.0.1", row["port"]), timeout=2).close()
        return 1.0

    def allocates(prompt, completion, row):
        block = bytearray(row["mb"] << 20)
        return float(len(block) > 0)

    def environment(prompt, completion, row):
        return float(any(k.startswith("SPECRL_") for k in os.environ))

    def two_args(prompt, completion):
        return 1.0
    """
)


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def call(completion: str = "42", **row) -> RewardCall:
    return RewardCall("What is 6 x 7?", completion, {"answer": "42", **row})


def pool(rewards_file: Path, name: str, **kwargs) -> RewardPool:
    return RewardPool(f"{rewards_file}:{name}", **kwargs)


def test_a_file_function_scores_each_completion_in_order(rewards_file):
    with pool(rewards_file, "exact") as p:
        outcomes = p.score([call("42"), call("41"), call(" 42 ")])
        assert [o.reward for o in outcomes] == [1.0, 0.0, 1.0]
        assert p.stats()["calls"] == 3 and not any(o.failure for o in outcomes)


def test_a_module_function_is_found_on_the_path(rewards_file, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(rewards_file.parent))
    with RewardPool("my_rewards:exact") as p:
        assert [o.reward for o in p.score([call("42")])] == [1.0]


def test_components_are_weighted_and_kept(rewards_file):
    with pool(rewards_file, "parts", weights={"short": 2.0}) as p:
        (outcome,) = p.score([call("42")])
    assert outcome.components == {"correct": 1.0, "short": 0.5}
    assert outcome.reward == 1.0 * 1.0 + 2.0 * 0.5


@pytest.mark.parametrize(
    ("name", "kind"),
    [("raises", "raised"), ("nan", "nonfinite"), ("exits", "crashed"), ("text", "invalid")],
)
def test_each_failure_gives_the_failure_reward_and_is_counted(rewards_file, name, kind):
    with pool(rewards_file, name, failure_reward=-1.0) as p:
        outcomes = p.score([call(), call(), call()])
        assert [(o.reward, o.failure) for o in outcomes] == [(-1.0, kind)] * 3
        assert p.stats()[kind] == 3
        assert sum(v for k, v in p.stats().items() if k != "calls") == 3


def test_a_hanging_call_is_stopped_at_its_timeout_and_the_worker_replaced(rewards_file):
    with pool(rewards_file, "hangs", workers=2, timeout_s=0.3) as p:
        started = time.monotonic()
        outcomes = p.score([call()] * 3)
        took = time.monotonic() - started
        assert [o.failure for o in outcomes] == ["timeout"] * 3
        # Each call waited its own timeout on one of two workers, never the 60 s sleep.
        assert took < 30, took
        pids = [w.process.pid for w in p._workers if w.process is not None]
    assert pids == []  # every hung worker was killed, none left running


def test_prints_go_to_stderr_not_into_the_replies(rewards_file):
    with pool(rewards_file, "loud") as p:
        assert [o.reward for o in p.score([call(), call()])] == [1.0, 1.0]


def test_a_row_with_types_msgpack_lacks_is_sent_as_text(rewards_file):
    import datetime

    with pool(rewards_file, "exact") as p:
        row = {"answer": "42", "when": datetime.date(2026, 1, 2), "n": np.int64(3)}
        assert p.score([RewardCall("p", "42", row)])[0].reward == 1.0


def test_secrets_in_the_environment_do_not_reach_a_worker(rewards_file, monkeypatch):
    monkeypatch.setenv("SPECRL_REDIS_PASSWORD", "hunter2")
    with pool(rewards_file, "environment") as p:
        assert p.score([call()])[0].reward == 0.0


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("{dir}/nowhere.py:f", "no file"),
        ("{dir}/my_rewards.py:absent", "has no function 'absent'"),
        ("no_such_module_xyz:f", "no module"),
        ("{dir}/my_rewards.py:two_args", "must accept the keyword arguments"),
    ],
)
def test_a_spec_that_cannot_start_is_refused_at_start(rewards_file, spec, message):
    with pytest.raises(RewardPoolError, match=message):
        RewardPool(spec.format(dir=rewards_file.parent))


@pytest.mark.parametrize("spec", ["score", ":score", "file.py:", "m:not-a-name"])
def test_a_malformed_spec_is_refused_by_form_in_the_config_too(spec):
    with pytest.raises(RewardSpecError):
        parse_reward_spec(spec)
    with pytest.raises(ValueError, match="task.reward"):
        load_config([f"task.reward='{spec}'"])


def test_a_target_that_is_neither_file_nor_module_is_refused():
    with pytest.raises(RewardSpecError, match="neither a .py file nor a dotted module"):
        parse_reward_spec("a b:score")


def test_config_refuses_bad_reward_settings():
    for override in (
        "task.reward_workers=0",
        "task.reward_timeout_s=0",
        "task.reward_on_failure=x",
    ):
        with pytest.raises(ValueError, match=override.split("=")[0]):
            load_config([override])
    cfg = load_config(["task.reward=m:f", "+task.reward_weights={a: 2, b: 0.5}"])
    assert cfg.task.reward_weights == {"a": 2.0, "b": 0.5}


def test_combine_takes_numbers_bools_and_dicts_and_refuses_the_rest():
    assert combine(1, {}) == RewardOutcome(reward=1.0)
    assert combine(True, {}).reward == 1.0  # `return answer == expected`
    assert combine({"a": 1, "b": 2}, {"b": 0.5}).reward == 2.0
    assert combine({}, {}).failure == "invalid"
    assert combine({"a": "x"}, {}).failure == "invalid"
    assert combine(None, {}).failure == "invalid"
    assert combine({"a": math.inf}, {}).failure == "nonfinite"
    assert combine(math.nan, {}, failure_reward=-0.5) == RewardOutcome(
        reward=-0.5, failure="nonfinite", detail="returned nan"
    )


def test_the_builtin_reward_as_a_function_scores_like_the_task(rewards_file):
    task = make_task("word_problems")
    import random

    problems = task.sample(random.Random(0), 4)
    completions = [f"So the answer is {p.answer}." for p in problems[:2]] + ["no idea", "7"] * 1
    builtin = TaskScorer(task)
    with RewardPool("actors.rewards.builtin:numeric_answer") as p:
        scorer = PoolScorer(p)
        for problem in problems:
            got = [o.reward for o in scorer.score(problem, completions)]
            assert got == [o.reward for o in builtin.score(problem, completions)]


def test_a_data_set_row_reaches_the_function_whole(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "Name a colour.", "answer": "blue", "meta": {"level": 3}}\n')
    task = make_task("dataset", path=data, numeric_answers=False)
    (problem,) = task.problems
    assert problem.answer == "blue"
    assert problem_row(problem) == {
        "prompt": "Name a colour.",
        "answer": "blue",
        "meta": {"level": 3},
    }
    generated = Problem("p:1", "1+1=", "2")
    assert problem_row(generated) == {"prompt": "1+1=", "answer": "2", "prompt_id": "p:1"}


def test_outcome_stats_give_component_means_and_failures_by_kind():
    outcomes = [
        RewardOutcome(1.0, {"correct": 1.0, "short": 0.0}),
        RewardOutcome(0.5, {"correct": 0.0, "short": 1.0}),
        RewardOutcome(0.0, failure="timeout"),
    ]
    stats = outcome_stats(outcomes)
    assert stats["reward/correct"] == 0.5 and stats["reward/short"] == 0.5
    assert stats[mn.REWARD_FAILED] == 1.0 and stats[f"{mn.REWARD_FAILED}_timeout"] == 1.0
    assert stats[f"{mn.REWARD_FAILED}_raised"] == 0.0
    assert outcome_stats([RewardOutcome(1.0)]) == {}


SANDBOX_REFUSAL = sandbox.unavailable()
sandboxed = pytest.mark.skipif(
    SANDBOX_REFUSAL is not None, reason=f"no reward sandbox here: {SANDBOX_REFUSAL}"
)


@sandboxed
def test_the_sandbox_cuts_the_network_that_an_unconfined_worker_has(rewards_file):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        with pool(rewards_file, "connects") as p:
            assert p.score([call(port=port)])[0].reward == 1.0
        listener.accept()[0].close()
        with pool(rewards_file, "connects", sandbox=True) as p:
            (outcome,) = p.score([call(port=port)])
        # Its own network namespace: the host's loopback (and the listener) is not there.
        assert outcome.failure == "raised", outcome
        assert "refused" in outcome.detail or "unreachable" in outcome.detail, outcome
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()


@sandboxed
def test_the_sandbox_caps_memory_and_runs_each_call_in_a_fresh_process(rewards_file):
    with pool(rewards_file, "allocates", sandbox=True, memory_mb=256) as p:
        small, large = p.score([call(mb=16), call(mb=1024)])
        assert small.reward == 1.0
        assert large.failure == "raised" and "MemoryError" in large.detail
        assert all(w.process is None for w in p._workers)  # none kept between calls
    with pool(rewards_file, "allocates", memory_mb=256) as p:  # unconfined: no such cap
        assert p.score([call(mb=512)])[0].reward == 1.0


@sandboxed
def test_the_sandbox_worker_sees_no_inherited_environment(rewards_file, monkeypatch):
    monkeypatch.setenv("SPECRL_ACTOR_TOKEN", "secret")
    with pool(rewards_file, "environment", sandbox=True) as p:
        assert p.score([call()])[0].reward == 0.0
    assert os.environ["SPECRL_ACTOR_TOKEN"] == "secret"


def test_the_example_user_reward_scores_as_the_builtin_does():
    """examples/word_problems_reward.py (docs/recipes.md): its `correct` component equals the
    built-in numeric reward on completions in every format the rule covers."""
    from common.dataset_task import numeric_reward

    task = make_task("word_problems")
    import random

    problems = task.sample(random.Random(1), 6)
    forms = [
        "So {a} in all. The answer is \\boxed{{{a}}}.",
        "#### {a}",
        "It is {a}, or maybe {a}1",
        "\\boxed{{\\frac{{1}}{{2}}}} then {a}",
        "10-3 = 7, so -{a}",
        "{a}.0",
        "no number at all",
        "\\boxed{{{a}",  # unclosed: the last number counts
    ]
    root = Path(__file__).resolve().parents[3]
    spec = f"{root / 'examples' / 'word_problems_reward.py'}:score"
    with RewardPool(spec, weights={"marked": 0.0}) as p:
        scorer = PoolScorer(p)
        for problem in problems:
            texts = [f.format(a=problem.answer) for f in forms]
            outcomes = scorer.score(problem, texts)
            assert [o.reward for o in outcomes] == [
                numeric_reward(problem.answer, t) for t in texts
            ], problem
            assert all(set(o.components) == {"correct", "marked"} for o in outcomes)
