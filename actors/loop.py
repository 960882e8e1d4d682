"""The actor loop: sync weights → generate G completions per prompt → score → send groups."""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from actors.engines.rollout_engine import Rollout, RolloutEngine
from actors.episodes.evaluation import EpisodeEvaluator
from actors.episodes.runner import EpisodeRunner, episode_runner
from actors.evaluation import Evaluator
from actors.exporter import ActorExporter
from actors.rewards.scoring import (
    PoolScorer,
    Scorer,
    TaskScorer,
    completion_text,
    outcome_stats,
)
from actors.wiring import Recovery, group_sender, wire
from common import heap
from common import metric_names as mn
from common.config import SpecRLConfig
from common.entrypoint import StopFlag
from common.link.protocol import Completion, TrajectoryGroup
from common.link.send.sender import GroupSender
from common.metrics import MetricsWriter
from common.tasks import Problem, Task, held_out_problems
from common.tokenizer import Tokenizer
from common.weights.fetch.feed import StallMeter, WeightFeed, meter_loads, take
from common.weights.fetch.reader import WeightReader

log = logging.getLogger(__name__)


class ActorStats:
    """The actor's running totals (what :func:`run` returns)."""

    def __init__(self) -> None:
        self.batches, self.groups_sent, self.completions = 0, 0, 0
        self.tokens, self.weight_loads, self.reward_sum = 0, 0, 0.0
        self.groups_dropped = 0  # task.reward_on_failure=drop_group
        self.weight_fetch_s = 0.0  # the latest fetch
        self.wait_s = 0.0  # idle, waiting for a new version (synchronous mode only)


def make_groups(
    problems: list[Problem],
    prompts: list[list[int]],
    rollouts: list[list[Rollout]],
    scorer: Scorer,
    tokenizer: Tokenizer,
) -> list[TrajectoryGroup]:
    """Score every completion and wrap each prompt's completions into one TrajectoryGroup; a
    group's ``stats`` hold its reward figures (:func:`~actors.rewards.scoring.outcome_stats`)."""
    groups = []
    for problem, prompt, completions in zip(problems, prompts, rollouts, strict=True):
        texts = [completion_text(tokenizer, r) for r in completions]
        outcomes = scorer.score(problem, texts)
        scored = [
            Completion(
                token_ids=r.token_ids,
                behaviour_logprobs=r.behaviour_logprobs,
                token_versions=r.token_versions,
                reward=outcome.reward,
                finished=r.finished,
            )
            for r, outcome in zip(completions, outcomes, strict=True)
        ]
        # A group counts as its oldest sampled token's version: that is what its staleness is
        # about (an episode's environment tokens, version -1, were not sampled by any policy).
        versions = [
            int(v.min()) for c in scored if (v := c.token_versions[c.token_versions >= 0]).size
        ]
        groups.append(
            TrajectoryGroup(
                actor_id="",
                seq=0,
                prompt_id=problem.prompt_id,
                prompt_ids=np.asarray(prompt, dtype=np.int32),
                version=min(versions) if versions else 0,
                completions=scored,
                stats=outcome_stats(outcomes),
            )
        )
    return groups


GROUP_STAT_KEYS = (
    mn.ACTOR_TOKENS_PER_S,
    mn.SPEC_ACCEPTANCE_RATE,
    mn.SPEC_MEAN_ACCEPTED_LEN,
    mn.SPEC_TOKENS_PER_VERIFY_FORWARD,
    mn.SPEC_DRAFT_VERSION,
)


def group_stat(key: str) -> bool:
    """A rollout figure each group carries to the learner (which averages them per step):
    acceptance (by draft position too), tokens per verify, the draft's version, verification."""
    return (
        key in GROUP_STAT_KEYS
        or key.startswith(mn.SPEC_ACCEPTANCE_POS_PREFIX)
        or key.startswith(mn.VERIFY_GROUP)
    )


class GroupSubmitter:
    """``on_group`` callback of one batch: scores a group whose completions are all done and
    submits it at once, while the engine decodes the other groups."""

    def __init__(
        self,
        phases: ActorPhases,
        problems: list[Problem],
        prompts: list[list[int]],
        sender: GroupSender,
    ) -> None:
        self.phases, self.problems, self.prompts, self.sender = phases, problems, prompts, sender
        self.stopped = False
        self._lock = threading.Lock()

    def __call__(self, index: int, rollouts: list[Rollout]) -> None:
        if self.stopped:
            return  # a stop came while waiting out backpressure: send nothing more
        phases = self.phases
        [group] = make_groups(
            [self.problems[index]],
            [self.prompts[index]],
            [rollouts],
            phases.scorer,
            phases.tokenizer,
        )
        if group.stats.get(mn.REWARD_FAILED) and phases.cfg.task.reward_on_failure == "drop_group":
            phases.stats.groups_dropped += 1  # task.reward_on_failure=drop_group: never sent
            return
        self.send(group)

    def send(self, group: TrajectoryGroup) -> None:
        """Submit a scored group (an episode runner's too, from its threads): the rollout
        figures so far join its stats, then it waits out backpressure; nothing after a stop."""
        phases = self.phases
        with self._lock:
            if self.stopped:
                return
            # Per-group copies of the rollout figures so far (not reset): the learner averages
            # them per step, which gives acceptance against policy version.
            engine_stats = phases.engine.stats(reset=False).items()
            group.stats = {**group.stats, **{k: v for k, v in engine_stats if group_stat(k)}}
            if not submit_until_stopped(self.sender, group, phases.stop):
                self.stopped = True
                return
            if phases.ledger is not None:
                phases.ledger.write(
                    {"actor_id": phases.actor_id, "seq": group.seq, "event": "submitted"}
                )
            phases.stats.groups_sent += 1
            phases.stats.reward_sum += sum(c.reward for c in group.completions)
            phases.stats.completions += len(group.completions)


def submit_until_stopped(sender: GroupSender, group: TrajectoryGroup, should_stop) -> bool:
    """Hand ``group`` to the outbox, waiting out backpressure; False if a stop came first."""
    while not should_stop():
        try:
            sender.submit(group, timeout_s=1.0)
            return True
        except TimeoutError:
            continue  # the learner is behind or away: keep waiting, never drop the group
    return False


class GenerationStopped(Exception):
    """Raised from the engine's weight source when a stop is requested mid-generate, so the
    actor leaves a long rollout at the next decoding step instead of finishing it."""


@dataclass
class ActorPhases:
    """The phases of one actor's loop and what they share (built once by :func:`run`)."""

    cfg: SpecRLConfig
    engine: RolloutEngine
    feed: WeightFeed
    stall: StallMeter
    stats: ActorStats
    exporter: ActorExporter
    task: Task
    encode: Callable[[str], list[int]]
    rng: random.Random
    tokenizer: Tokenizer
    ledger: MetricsWriter | None
    actor_id: str
    stop: StopFlag
    reader: WeightReader | None = None
    """The run's weight reader, for its host-cache figures (``actor/host_cache_refused``)."""
    scorer: Scorer | None = None
    """What scores completions: the reward pool of ``task.reward``, else (None) the task's own."""
    evaluator: Evaluator | EpisodeEvaluator | None = None
    """The held-out evaluation this actor runs (``eval.every``, ``eval.actor``), if any."""
    episodes: EpisodeRunner | None = None
    """The turn loop of multi-turn episodes (``env.name``), instead of single-turn prompts."""

    def __post_init__(self) -> None:
        if self.scorer is None:
            self.scorer = TaskScorer(self.task)
        # The engine takes in each version on this thread, the decode loop's: its load and the
        # delayed verification of the rows in flight block decoding, so the stall meter counts
        # them beside take() (common/weights/fetch/feed.py).
        meter_loads(self.engine, self.stall, self.feed)

    def fetch(self, timeout_s: float = 0.0) -> tuple[int, dict[str, torch.Tensor]] | None:
        """A newer weights version the feed holds ready, if any (waiting up to ``timeout_s`` for
        one): fetched and verified in the background, so this never waits for Redis."""
        update = take(self.feed, self.stall, timeout_s)
        if update is not None:
            self.stats.weight_loads += 1
            self.stats.weight_fetch_s = self.feed.stats()[mn.ACTOR_WEIGHT_FETCH_S]
            self.exporter.observe_weight_fetch(self.stats.weight_fetch_s)
        return update

    def weight_source(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """What the engine polls between decoding steps: a newer version, if any, or
        :class:`GenerationStopped` once a stop is requested (finished groups are already sent)."""
        if self.stop():
            raise GenerationStopped
        return self.fetch()

    def stop_source(self) -> None:
        """The weight source of a call that must stay on one version (the evaluation): no
        weights, but :class:`GenerationStopped` once a stop is requested."""
        if self.stop():
            raise GenerationStopped

    def sync_weights(self, timeout_s: float = 0.0) -> None:
        """Phase 1: pick up the newest weights (waiting up to ``timeout_s`` for one)."""
        update = self.fetch(timeout_s)
        if update is not None:
            self.engine.load_weights(*update)  # metered (meter_loads in __post_init__)

    def generate_and_send(self, sender: GroupSender) -> int:
        """Phases 2 and 3: generate G completions for each prompt of a batch, each group scored
        and sent as soon as its G completions are done. Returns the version the batch started on."""
        cfg = self.cfg
        batch_version = self.engine.version
        if self.episodes is not None:
            return self.run_episodes(sender, batch_version)
        problems = self.task.sample(self.rng, cfg.actor.prompts_per_batch)
        prompts = [self.encode(p.prompt) for p in problems]
        submit = GroupSubmitter(self, problems, prompts, sender)
        try:
            self.engine.generate(
                prompts,
                cfg.actor.group_size,
                self.task.max_new_tokens,
                weight_source=self.weight_source,
                on_group=submit,
            )
        except GenerationStopped:
            log.info("actor %s: stop requested; left the batch in flight", self.actor_id)
        return batch_version

    def run_episodes(self, sender: GroupSender, batch_version: int) -> int:
        """Phases 2 and 3 with an environment: ``prompts_per_batch`` problems (one seed each,
        shared by the siblings), ``group_size`` episodes each, each group sent once its
        episodes end (actors/episodes/runner.py)."""
        cfg = self.cfg
        seeds = [self.rng.randrange(2**31) for _ in range(cfg.actor.prompts_per_batch)]
        submit = GroupSubmitter(self, [], [], sender)
        try:
            self.episodes.run_batch(
                seeds,
                cfg.actor.group_size,
                self.weight_source,
                submit.send,
                in_flight=cfg.env.problems_in_flight,
            )
        except GenerationStopped:
            log.info("actor %s: stop requested; left the episodes in flight", self.actor_id)
        return batch_version

    def wait_for_learner(self, batch_version: int) -> None:
        """Synchronous mode (``actor.wait_for_new_version``): idle until the learner has trained
        on the batch's version."""
        if not self.cfg.actor.wait_for_new_version:
            return
        wait_started = time.perf_counter()
        while self.engine.version <= batch_version and not self.stop():
            self.sync_weights(timeout_s=0.5)
        self.stats.wait_s += time.perf_counter() - wait_started

    def run_batches(self, sender: GroupSender, recovery: Recovery | None) -> None:
        """Batch after batch until a stop (or ``actor.max_batches``): the four phases."""
        while not self.stop():
            if recovery is not None:
                recovery.poll()
            if self.cfg.actor.max_batches and self.stats.batches >= self.cfg.actor.max_batches:
                break
            self.evaluate()
            with self.stall.running(self.feed):  # the decode loop, as the stall meter sees it
                self.sync_weights()  # Phase 1
                batch_version = self.generate_and_send(sender)  # Phases 2 and 3
            engine_stats = self.engine.stats()
            self.wait_for_learner(batch_version)  # synchronous mode only
            self.report(sender, engine_stats)  # Phase 4
            heap.trim()  # the batch's freed logits and retired weights back to the OS

    def evaluate(self) -> None:
        """The held-out evaluation, when the version held reaches a new multiple of
        ``eval.every`` (and at the first batch); its counters are left out of the rollouts'."""
        if self.evaluator is None or not self.evaluator.due(self.engine.version):
            return
        try:
            self.evaluator.run(self.engine, stop_source=self.stop_source)
        except GenerationStopped:
            log.info("actor %s: stop requested; left the evaluation unfinished", self.actor_id)
        self.engine.stats()  # drop the evaluation's tokens and acceptance from the batch's

    def report(self, sender: GroupSender, engine_stats: dict[str, float]) -> None:
        """Phase 4: the batch's figures to the learner (heartbeat status) and to Prometheus."""
        stats = self.stats
        stats.batches += 1
        stats.tokens += int(engine_stats[mn.ACTOR_TOKENS])
        status = {
            **engine_stats,
            **sender.stats(),
            **self.feed.stats(),
            **self.stall.figures(),
            **(self.reader.stats() if self.reader is not None else {}),
            mn.ACTOR_WAIT_S: stats.wait_s,
            mn.ACTOR_REWARD_MEAN: stats.reward_sum / max(stats.completions, 1),
            mn.ACTOR_REWARD_FAILURES: self.scorer.failures(),
            mn.ACTOR_REWARD_GROUPS_DROPPED: stats.groups_dropped,
            **(self.evaluator.latest if self.evaluator is not None else {}),
            **(self.episodes.counts if self.episodes is not None else {}),
            **(self.episodes.gauges if self.episodes is not None else {}),
        }
        sender.set_status(self.engine.version, status)
        self.exporter.update(
            {**status, mn.ACTOR_BATCHES: stats.batches, mn.ACTOR_GROUPS_SENT: stats.groups_sent},
            version=self.engine.version,
        )


def make_evaluator(
    cfg: SpecRLConfig, parts: Any, scorer: Any, episodes: EpisodeRunner | None
) -> Evaluator | EpisodeEvaluator | None:
    """The held-out evaluation of the evaluating actor (``eval.every``, ``eval.actor``): of
    episodes with an environment, else of single-turn problems."""
    if not cfg.eval.every or cfg.actor.index != cfg.eval.actor:
        return None
    samples = cfg.run.resolved_dir() / "eval" / f"{parts.actor_id}.jsonl"
    if episodes is not None:
        return EpisodeEvaluator(cfg.eval, episodes, cfg.env.failure_reward, samples)
    return Evaluator(
        cfg.eval,
        held_out_problems(parts.task, cfg.eval.prompts, cfg.eval.seed),
        parts.encode,
        scorer,
        parts.tokenizer,
        parts.task.max_new_tokens,
        samples,
    )


def run(cfg: SpecRLConfig) -> ActorStats:
    """The actor: wire its parts (:func:`actors.wiring.wire`), then decode batches and send
    their groups until a stop; what it did is returned."""
    torch.set_num_threads(cfg.run.torch_threads)
    heap.apply_mmap_threshold(cfg.run.mmap_threshold_bytes, "actor")
    heap.cap_onednn_cache(cfg.run.onednn_cache_capacity, "actor")
    if cfg.actor.nice:
        os.nice(cfg.actor.nice)  # on a machine shared with the learner, its steps come first
    stop = StopFlag("actor")
    stats = ActorStats()
    # The reward pool first: a task.reward that cannot start stops the actor before it connects.
    pool_scorer = PoolScorer.from_config(cfg.task) if cfg.task.reward else None
    try:
        parts = wire(cfg, stop)
    except BaseException:
        if pool_scorer is not None:
            pool_scorer.close()
        raise
    if parts is None:
        if pool_scorer is not None:
            pool_scorer.close()
        return stats
    scorer = pool_scorer or TaskScorer(parts.task)
    episodes = episode_runner(cfg, parts.engine, parts.tokenizer) if cfg.env.name else None
    evaluator = make_evaluator(cfg, parts, scorer, episodes)
    phases = ActorPhases(
        cfg=cfg,
        engine=parts.engine,
        feed=parts.feed,
        stall=StallMeter(),
        stats=stats,
        exporter=parts.exporter,
        task=parts.task,
        encode=parts.encode,
        rng=parts.rng,
        tokenizer=parts.tokenizer,
        ledger=parts.ledger,
        actor_id=parts.actor_id,
        stop=stop,
        reader=parts.store,
        scorer=scorer,
        evaluator=evaluator,
        episodes=episodes,
    )
    try:
        with group_sender(
            cfg, parts.actor_id, parts.limits, parts.spool, cfg.actor.outbox_max
        ) as sender:
            phases.run_batches(sender, parts.recovery)
            sender.close(timeout_s=5.0)  # waits for the last acks once (leaving the block won't)
            unacked = sender.unacked_seqs()
            parts.close_ledger(unacked)
    finally:
        parts.feed.close()  # joins its thread
        scorer.close()
        if evaluator is not None:
            evaluator.close()
        if phases.episodes is not None and phases.episodes.env_pool is not None:
            phases.episodes.env_pool.close()  # env.workers > 0: its worker processes
    parts.close(delete_spool=not unacked)
    log.info(
        "actor %s: stopped after %d batches, %d groups",
        parts.actor_id,
        stats.batches,
        stats.groups_sent,
    )
    return stats
