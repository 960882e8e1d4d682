"""Evaluation during training: one actor generates ``eval.samples`` completions for each
held-out problem with the version it holds (no weight swap mid-evaluation), scores them as
rollouts are scored, and reports avg@k and pass@k with its status, which the learner writes into
the next step's record (metrics.jsonl, Prometheus, trackers). Every evaluation's completions and
rewards, per problem, go to ``<run dir>/eval/<actor id>.jsonl`` on the actor's machine. Training
goes on meanwhile: the learner trains on the other actors' groups and on those already queued."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from actors.engines.rollout_engine import RolloutEngine
from actors.rewards.scoring import Scorer, completion_text
from common import metric_names as mn
from common.config.run import EvalConfig
from common.metrics import MetricsWriter
from common.tasks import Problem
from common.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Evaluator:
    """Evaluates ``problems`` when the version reaches a new multiple of ``cfg.every``."""

    def __init__(
        self,
        cfg: EvalConfig,
        problems: list[Problem],
        encode: Callable[[str], list[int]],
        scorer: Scorer,
        tokenizer: Tokenizer,
        max_new_tokens: int,
        samples_path: Path | None = None,
    ) -> None:
        self.cfg, self.problems, self.scorer = cfg, problems, scorer
        self.samples = MetricsWriter(samples_path) if samples_path is not None else None
        self.tokenizer, self.max_new_tokens = tokenizer, max_new_tokens
        self.prompts = [encode(p.prompt) for p in problems]
        self._last_bucket = -1
        self.latest: dict[str, float] = {}
        """The figures of the latest evaluation (empty before the first)."""

    def due(self, version: int) -> bool:
        return version // self.cfg.every > self._last_bucket

    def run(self, engine: RolloutEngine) -> dict[str, float]:
        """Evaluate the version ``engine`` holds; the figures (also kept in :attr:`latest`)."""
        version = engine.version
        self._last_bucket = version // self.cfg.every
        started = time.perf_counter()
        k = self.cfg.samples
        rollouts = engine.generate(self.prompts, k, self.max_new_tokens)
        rewards, failed, per_problem = [], 0, []
        for problem, completions in zip(self.problems, rollouts, strict=True):
            texts = [completion_text(self.tokenizer, r) for r in completions]
            outcomes = self.scorer.score(problem, texts)
            failed += sum(o.failure is not None for o in outcomes)
            rewards.append([o.reward for o in outcomes])
            per_problem.append(
                {
                    "prompt_id": problem.prompt_id,
                    "answer": problem.answer,
                    "completions": texts,
                    "rewards": rewards[-1],
                    "failures": [o.failure for o in outcomes],
                }
            )
        self.latest = evaluation_figures(rewards, self.cfg.pass_reward)
        self.latest.update(
            {
                mn.EVAL_VERSION: version,
                mn.EVAL_S: time.perf_counter() - started,
                mn.EVAL_REWARD_FAILED: failed,
            }
        )
        if self.samples is not None:
            self.samples.write({mn.EVAL_VERSION: version, "problems": per_problem})  # type: ignore[dict-item]
        log.info(
            "eval of version %d: avg@%d %.3f, pass@1 %.3f, pass@%d %.3f on %d prompts (%.1f s)",
            version,
            k,
            self.latest[mn.EVAL_AVG_REWARD],
            self.latest[mn.EVAL_PASS_AT_1],
            k,
            self.latest[mn.EVAL_PASS_AT_K],
            len(self.problems),
            self.latest[mn.EVAL_S],
        )
        return self.latest

    def close(self) -> None:
        if self.samples is not None:
            self.samples.close()


def evaluation_figures(rewards: list[list[float]], pass_reward: float) -> dict[str, float]:
    """avg@k (the mean reward of every completion), pass@1 (the share of completions that pass)
    and pass@k (the share of prompts with at least one of their k completions passing)."""
    flat = [r for per_prompt in rewards for r in per_prompt]
    if not flat:
        raise ValueError("no completions to evaluate")
    return {
        mn.EVAL_AVG_REWARD: sum(flat) / len(flat),
        mn.EVAL_PASS_AT_1: sum(r >= pass_reward for r in flat) / len(flat),
        mn.EVAL_PASS_AT_K: sum(any(r >= pass_reward for r in p) for p in rewards) / len(rewards),
        mn.EVAL_K: len(rewards[0]),
        mn.EVAL_PROMPTS: len(rewards),
    }
