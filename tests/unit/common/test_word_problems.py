"""task=word_problems: generated English arithmetic stories, their answers, the held-out set."""

from __future__ import annotations

import random
import re

import pytest

from common.config.run import TaskConfig
from common.tasks import PromptPool, make_task, task_from_config
from common.word_problems import WordProblemsTask, eval_problems


def solve(prompt: str) -> int:
    """An independent reading of a story: the first count, then each 'Then ...' sentence."""
    count = int(re.match(r"\w+ has (\d+) ", prompt).group(1))
    for sentence in re.findall(r"Then ([^.]*)\.", prompt):
        if m := re.search(r"(?:buys|finds|gets) (\d+) more", sentence):
            count += int(m.group(1))
        elif m := re.search(r"(?:gives|loses|sells) (\d+) ", sentence):
            count -= int(m.group(1))
        elif "doubles" in sentence:
            count *= 2
        elif "triples" in sentence:
            count *= 3
        elif m := re.search(r"among (\d+) boxes", sentence):
            assert count % int(m.group(1)) == 0, prompt
            count //= int(m.group(1))
        else:
            raise AssertionError(f"unknown step {sentence!r}")
        assert count >= 0, prompt
    return count


def test_answers_follow_the_story() -> None:
    task = WordProblemsTask()
    problems = task.sample(random.Random(0), 500)
    for p in problems:
        assert solve(p.prompt) == int(p.answer), p.prompt
        assert p.prompt.endswith("Give the final answer as a number.")
    steps = [p.prompt.count("Then ") for p in problems]
    assert set(steps) == {1, 2, 3}
    # Fewer steps are likelier: 3:2:1.
    assert steps.count(1) > steps.count(2) > steps.count(3)


def test_sampling_is_deterministic_and_ids_are_stable() -> None:
    task = WordProblemsTask()
    a = task.sample(random.Random(5), 20)
    b = task.sample(random.Random(5), 20)
    assert a == b
    assert len({p.prompt_id for p in a}) == len({p.prompt for p in a})


def test_step_range_is_respected_and_validated() -> None:
    task = WordProblemsTask(min_steps=2, max_steps=2)
    assert {p.prompt.count("Then ") for p in task.sample(random.Random(1), 50)} == {2}
    with pytest.raises(ValueError, match="min_steps"):
        WordProblemsTask(min_steps=3, max_steps=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        WordProblemsTask(max_new_tokens=0)
    with pytest.raises(ValueError, match="task.min_steps"):
        TaskConfig(name="word_problems", min_steps=0)


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("She has 4 + 3 = 7 apples.\n#### 7", 1.0),
        ("The answer is \\boxed{7}.", 1.0),
        ("4 + 3 = 7, so the final answer is 7.", 1.0),
        ("#### 7.0", 1.0),
        ("4 + 3 = 7 apples, then she has 8.", 0.0),
        ("#### 8\nThe answer is 7", 0.0),
        ("no number at all", 0.0),
    ],
)
def test_reward_reads_the_final_number(completion: str, reward: float) -> None:
    task = WordProblemsTask()
    (problem,) = [p for p in task.sample(random.Random(3), 200) if p.answer == "7"][:1]
    assert task.reward(problem, completion) == reward


def test_training_pool_and_eval_set_are_disjoint() -> None:
    pool = task_from_config(TaskConfig(name="word_problems", pool_size=500))
    assert isinstance(pool, PromptPool)
    assert pool.max_new_tokens == 96
    held_out = eval_problems(pool.task, 200, pool.problems)
    assert len(held_out) == len({p.prompt for p in held_out}) == 200
    assert not {p.prompt for p in held_out} & {p.prompt for p in pool.problems}
    assert held_out == eval_problems(pool.task, 200, pool.problems)  # the same set every time


def test_make_task_knows_it_and_checks_arguments() -> None:
    assert isinstance(make_task("word_problems"), WordProblemsTask)
    with pytest.raises(TypeError, match="word_problems"):
        make_task("word_problems", min_digits=2)
    with pytest.raises(ValueError, match="word_problems"):
        make_task("nope")
