"""Held-out evaluation of multi-turn episodes: the evaluating actor plays ``eval.prompts``
held-out problems, ``eval.samples`` episodes each, with the version it holds (no weight swap
mid-evaluation), through the same episode runner as training; with ``eval.greedy`` one greedy
episode more per problem. The figures are single-turn evaluation's (avg@k, pass@k, the greedy
ones; ``actors/evaluation.py``) over the episodes' rewards (the sum of their turns'), and each
evaluation's episodes (every turn's text, the stop, the reward) go to
``<run dir>/eval/<actor id>.jsonl``.

Held-out problems: seeds from ``2**31`` up (training draws its seeds below ``2**31``, so none is
shared), and every ``reset`` gets ``options["split"] = "eval"``, which an environment with a
held-out set of its own reads (the built-in ``guess_number`` plays its held-out instances). An
environment failure scores ``env.failure_reward`` and is counted (``eval/reward_failed``). The
runner's counters and gauges are the training's: an evaluation leaves them as it found them.
"""

from __future__ import annotations

import copy
import logging
import time
from pathlib import Path

from actors.engines.rollout_engine import RolloutEngine, WeightSource
from actors.episodes.runner import Episode, EpisodeRunner
from actors.evaluation import EveryVersions, evaluation_figures, greedy_figures
from common import metric_names as mn
from common.config.run import EvalConfig
from common.metrics import MetricsWriter

log = logging.getLogger(__name__)

EVAL_SEED_BASE = 2**31
"""The first held-out seed (training's are below it)."""
EVAL_OPTIONS = {"split": "eval"}


def eval_seeds(prompts: int, seed: int) -> list[int]:
    """The held-out problems' seeds for ``eval.prompts`` and ``eval.seed``."""
    return [EVAL_SEED_BASE + seed * 1_000_003 + i for i in range(prompts)]


class EpisodeEvaluator(EveryVersions):
    """Evaluates the held-out episodes when the version reaches a new multiple of
    ``cfg.every`` (the interface of :class:`actors.evaluation.Evaluator`)."""

    def __init__(
        self,
        cfg: EvalConfig,
        runner: EpisodeRunner,
        failure_reward: float,
        samples_path: Path | None = None,
    ) -> None:
        super().__init__(cfg)
        self.runner, self.failure_reward = runner, failure_reward
        self.seeds = eval_seeds(cfg.prompts, cfg.seed)
        self.samples = MetricsWriter(samples_path) if samples_path is not None else None

    def run(
        self, engine: RolloutEngine, stop_source: WeightSource | None = None
    ) -> dict[str, float]:
        """Evaluate the version ``engine`` holds (``stop_source`` abandons it on a stop)."""
        version = engine.version
        self.begin(version)
        started = time.perf_counter()
        counts, gauges = copy.copy(self.runner.counts), dict(self.runner.gauges)
        try:
            sampled = self._play(self.cfg.samples, stop_source)
            greedy = None
            if self.cfg.greedy:
                with engine.greedy():
                    greedy = self._play(1, stop_source)
        finally:
            self.runner.counts, self.runner.gauges = counts, gauges
        rewards = [[self._reward(ep) for ep in row] for row in sampled]
        self.latest = evaluation_figures(rewards, self.cfg.pass_reward)
        failed = sum(bool(ep.failure) for row in sampled for ep in row)
        if greedy is not None:
            self.latest.update(
                greedy_figures([self._reward(row[0]) for row in greedy], self.cfg.pass_reward)
            )
            failed += sum(bool(row[0].failure) for row in greedy)
        self.latest.update(
            {
                mn.EVAL_VERSION: version,
                mn.EVAL_S: time.perf_counter() - started,
                mn.EVAL_REWARD_FAILED: failed,
            }
        )
        if self.samples is not None:
            self.samples.write(self._record(version, sampled, greedy))  # type: ignore[arg-type]
        log.info(
            "eval of version %d: avg@%d %.3f, pass@%d %.3f on %d held-out episodes' problems "
            "(%.1f s)",
            version,
            self.cfg.samples,
            self.latest[mn.EVAL_AVG_REWARD],
            self.cfg.samples,
            self.latest[mn.EVAL_PASS_AT_K],
            len(self.seeds),
            self.latest[mn.EVAL_S],
        )
        return self.latest

    def _play(self, samples: int, stop_source: WeightSource | None) -> list[list[Episode]]:
        return self.runner.run_batch(
            self.seeds, samples, stop_source, lambda group: None, options=EVAL_OPTIONS
        )

    def _reward(self, ep: Episode) -> float:
        return self.failure_reward if ep.failure else float(sum(ep.turn_rewards))

    def _record(self, version: int, sampled, greedy) -> dict:
        def episode(ep: Episode) -> dict:
            return {"turns": ep.seen, "stop": ep.stop, "reward": self._reward(ep)}

        problems = []
        for i, (seed, row) in enumerate(zip(self.seeds, sampled, strict=True)):
            entry = {"seed": seed, "episodes": [episode(ep) for ep in row]}
            if greedy is not None:
                entry["greedy"] = episode(greedy[i][0])
            problems.append(entry)
        return {mn.EVAL_VERSION: version, "problems": problems}

    def close(self) -> None:
        if self.samples is not None:
            self.samples.close()
