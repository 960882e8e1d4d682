"""Evaluation during training: one actor generates ``eval.samples`` completions for each
held-out problem with the version it holds (no weight swap mid-evaluation) at the run's
sampling settings, and with ``eval.greedy`` one greedy completion more, scores them as rollouts
are scored, and reports avg@k, pass@k and the greedy figures with its status, which the learner
writes into the next step's record (metrics.jsonl, Prometheus, trackers). Every evaluation's
completions and rewards, per problem, go to ``<run dir>/eval/<actor id>.jsonl`` on the actor's
machine. Training goes on meanwhile: the learner trains on the other actors' groups and on
those already queued."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from actors.engines.rollout_engine import Rollout, RolloutEngine, WeightSource
from actors.rewards.scoring import Scorer, completion_text
from common import metric_names as mn
from common.config.run import EvalConfig
from common.metrics import MetricsWriter
from common.tasks import Problem
from common.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EveryVersions:
    """When an evaluation is due: the version reached a new multiple of ``cfg.every``; and the
    figures of the latest one (empty before the first)."""

    def __init__(self, cfg: EvalConfig) -> None:
        self.cfg = cfg
        self._last_bucket = -1
        self.latest: dict[str, float] = {}

    def due(self, version: int) -> bool:
        return version // self.cfg.every > self._last_bucket

    def begin(self, version: int) -> None:
        """An evaluation of ``version`` starts: the next is due at the next multiple."""
        self._last_bucket = version // self.cfg.every


class Evaluator(EveryVersions):
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
        super().__init__(cfg)
        self.problems, self.scorer = problems, scorer
        self.samples = MetricsWriter(samples_path) if samples_path is not None else None
        self.tokenizer, self.max_new_tokens = tokenizer, max_new_tokens
        self.prompts = [encode(p.prompt) for p in problems]

    def run(
        self, engine: RolloutEngine, stop_source: WeightSource | None = None
    ) -> dict[str, float]:
        """Evaluate the version ``engine`` holds; the figures (also kept in :attr:`latest`).
        ``stop_source`` is polled between decoding steps and raises to abandon the evaluation
        (a stop must not wait for hundreds of held-out completions); it brings no weights."""
        version = engine.version
        self.begin(version)
        started = time.perf_counter()
        k = self.cfg.samples
        sampled = self._scored(engine.generate(self.prompts, k, self.max_new_tokens, stop_source))
        per_problem = [
            {"prompt_id": p.prompt_id, "answer": p.answer, **scored}
            for p, scored in zip(self.problems, sampled, strict=True)
        ]
        rewards = [p["rewards"] for p in sampled]
        failed = sum(f is not None for p in sampled for f in p["failures"])
        self.latest = evaluation_figures(rewards, self.cfg.pass_reward)
        if self.cfg.greedy:
            with engine.greedy():
                greedy = self._scored(
                    engine.generate(self.prompts, 1, self.max_new_tokens, stop_source)
                )
            for row, scored in zip(per_problem, greedy, strict=True):
                row["greedy"] = {
                    "completion": scored["completions"][0],
                    "reward": scored["rewards"][0],
                    "failure": scored["failures"][0],
                }
            failed += sum(p["failures"][0] is not None for p in greedy)
            greedy_rewards = [p["rewards"][0] for p in greedy]
            self.latest.update(greedy_figures(greedy_rewards, self.cfg.pass_reward))
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
        if self.cfg.greedy:
            log.info(
                "eval of version %d, greedy: mean reward %.3f, pass %.3f",
                version,
                self.latest[mn.EVAL_GREEDY_AVG_REWARD],
                self.latest[mn.EVAL_GREEDY_PASS],
            )
        return self.latest

    def _scored(self, rollouts: list[list[Rollout]]) -> list[dict[str, Any]]:
        """Per problem: its ``completions`` (texts), ``rewards`` and ``failures`` (failure kinds,
        None where scored)."""
        scored = []
        for problem, completions in zip(self.problems, rollouts, strict=True):
            texts = [completion_text(self.tokenizer, r) for r in completions]
            outcomes = self.scorer.score(problem, texts)
            scored.append(
                {
                    "completions": texts,
                    "rewards": [o.reward for o in outcomes],
                    "failures": [o.failure for o in outcomes],
                }
            )
        return scored

    def close(self) -> None:
        if self.samples is not None:
            self.samples.close()


def greedy_figures(rewards: list[float], pass_reward: float) -> dict[str, float]:
    """The greedy completions' (one per prompt) mean reward and the share of prompts they pass:
    avg@1 and pass@1 of :func:`evaluation_figures`."""
    one = evaluation_figures([[r] for r in rewards], pass_reward)
    return {
        mn.EVAL_GREEDY_AVG_REWARD: one[mn.EVAL_AVG_REWARD],
        mn.EVAL_GREEDY_PASS: one[mn.EVAL_PASS_AT_1],
    }


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
