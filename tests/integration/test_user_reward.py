"""``specrl run task.reward=<file>.py:<function>``: a user's reward that raises, hangs or returns
NaN for some completions is counted in metrics.jsonl while the run goes on to its last step."""

from __future__ import annotations

import json
import textwrap

import pytest

from testing.pipeline import warm_model
from tests.integration.test_launcher import launch

pytestmark = pytest.mark.integration

# Deterministic per completion: a quarter each raise, hang and return NaN, the rest score as the
# built-in reverse task does.
FLAKY_REWARD = textwrap.dedent(
    """
    import hashlib, math, time

    def score(prompt, completion, row):
        kind = hashlib.sha256(completion.encode()).digest()[0] % 4
        if kind == 0:
            raise RuntimeError("the grader fell over")
        if kind == 1:
            time.sleep(30)
        if kind == 2:
            return math.nan
        return {"exact": float(completion.strip() == row["answer"]), "length": len(completion) / 10}
    """
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return warm_model(tmp_path_factory.mktemp("model"))


def test_a_flaky_user_reward_is_counted_and_the_run_completes(tmp_path, model_dir):
    reward = tmp_path / "flaky_reward.py"
    reward.write_text(FLAKY_REWARD)
    run_dir = tmp_path / "run"
    proc = launch(
        run_dir,
        model_dir,
        [
            "run.steps=5",
            f"task.reward={reward}:score",
            "task.reward_timeout_s=0.3",
            "task.reward_workers=2",
            "+task.reward_weights={length: 0}",
        ],
    )
    out, _ = proc.communicate(timeout=400)
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "completed" and summary["steps"] == 5, summary
    assert summary["exit_codes"] == {"learner": 0, "actor-0": 0, "actor-1": 0}, out
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "learner/loss" in r]
    assert len(steps) == 5
    # Every failure kind the function produces was counted (per group, averaged per step) ...
    for kind in ("raised", "timeout", "nonfinite"):
        assert sum(r.get(f"reward/failed_{kind}", 0.0) for r in steps) > 0, (kind, steps[-1])
    assert sum(r.get("reward/failed_crashed", 0.0) for r in steps) == 0
    # ... and the components of the calls that succeeded were logged beside them.
    assert all("reward/exact" in r and "reward/length" in r for r in steps), steps[-1]
    # The weight 0 took "length" out of the reward: exact is 0 or 1, so rewards are too.
    assert all(r["learner/reward_max"] <= 1.0 for r in steps)
    log = (run_dir / "actor-0.log").read_text()
    assert "first timeout failure" in log and "first raised failure" in log, log[-2000:]


def test_a_reward_that_cannot_load_stops_the_run_before_training_with_the_reason(
    tmp_path, model_dir
):
    reward = tmp_path / "broken_reward.py"
    reward.write_text("import a_module_that_is_not_installed\n")
    run_dir = tmp_path / "run"
    proc = launch(run_dir, model_dir, ["run.steps=3", f"task.reward={reward}:score"])
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "a_module_that_is_not_installed" in out, out
