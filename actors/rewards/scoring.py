"""How the actor scores a group's completions: the task's own reward in process
(:class:`TaskScorer`), or the user's function in the reward pool (:class:`PoolScorer`), and the
figures a group carries of it (``reward/<component>``, ``reward/failed_<kind>``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from actors.engines.rollout_engine import Rollout
from actors.rewards.pool import RewardCall, RewardPool
from actors.rewards.spec import FAILURE_KINDS, RewardOutcome
from common import metric_names as mn
from common.config.run import TaskConfig
from common.tasks import Problem, Task
from common.tokenizer import Tokenizer


class Scorer(Protocol):
    def score(self, problem: Problem, completions: Sequence[str]) -> list[RewardOutcome]:
        """One outcome per completion (decoded text before EOS) of ``problem``."""
        ...

    def failures(self) -> int:
        """Calls that gave no reward so far (every kind)."""
        ...

    def close(self) -> None: ...


class TaskScorer:
    """The task's built-in reward, called in the actor's process (it is exact and cannot hang)."""

    def __init__(self, task: Task) -> None:
        self.task = task

    def score(self, problem: Problem, completions: Sequence[str]) -> list[RewardOutcome]:
        return [RewardOutcome(reward=float(self.task.reward(problem, t))) for t in completions]

    def failures(self) -> int:
        return 0

    def close(self) -> None:
        pass


class PoolScorer:
    """``task.reward``'s function, called in the reward pool with each problem's data row."""

    def __init__(self, pool: RewardPool) -> None:
        self.pool = pool

    @classmethod
    def from_config(cls, cfg: TaskConfig) -> PoolScorer:
        return cls(
            RewardPool(
                cfg.reward,
                workers=cfg.reward_workers,
                timeout_s=cfg.reward_timeout_s,
                weights=cfg.reward_weights,
                sandbox=cfg.reward_sandbox,
                memory_mb=cfg.reward_memory_mb,
            )
        )

    def score(self, problem: Problem, completions: Sequence[str]) -> list[RewardOutcome]:
        row = problem_row(problem)
        return self.pool.score([RewardCall(problem.prompt, text, row) for text in completions])

    def failures(self) -> int:
        stats = self.pool.stats()
        return sum(stats[k] for k in FAILURE_KINDS)

    def close(self) -> None:
        self.pool.close()


def completion_text(tokenizer: Tokenizer, rollout: Rollout) -> str:
    """What a reward sees of ``rollout``: its text, without the EOS that finished it."""
    ids = rollout.token_ids[:-1] if rollout.finished else rollout.token_ids
    return tokenizer.decode(ids.tolist())


def problem_row(problem: Problem) -> dict[str, Any]:
    """The ``row`` a reward function receives: the data set's row when the task has one, else
    the problem's prompt, answer and id."""
    if problem.row is not None:
        return dict(problem.row)
    return {"prompt": problem.prompt, "answer": problem.answer, "prompt_id": problem.prompt_id}


def outcome_stats(outcomes: Sequence[RewardOutcome]) -> dict[str, float]:
    """A group's reward figures: each component's mean over the completions that returned it
    and, when any call failed, the failures by kind (the learner averages both per step)."""
    stats: dict[str, float] = {}
    names = sorted({name for o in outcomes for name in o.components})
    for name in names:
        values = [o.components[name] for o in outcomes if name in o.components]
        stats[f"{mn.REWARD_PREFIX}{name}"] = sum(values) / len(values)
    failed = [o.failure for o in outcomes if o.failure is not None]
    if failed:
        stats[mn.REWARD_FAILED] = float(len(failed))
        for kind in FAILURE_KINDS:
            stats[f"{mn.REWARD_FAILED}_{kind}"] = float(failed.count(kind))
    return stats
