"""The learner loop: collect fresh groups → one GRPO/PPO step → publish a version → log → checkpoint."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from common import heap
from common import metric_names as mn
from common.config import SpecRLConfig
from common.config.learner import weights_group_refusal
from common.entrypoint import StopFlag
from common.link.protocol import TrajectoryGroup
from common.link.receive.admission import wire_limits
from common.link.receive.intake import ActorInfo, Intake
from common.link.receive.wal import trim
from common.metrics import MetricsWriter
from common.weights.publish.publisher import Publisher, publish_dtype
from common.weights.publish.writer import WeightWriter
from learner.batch import TrainBatch, collate
from learner.buffer import DeliveryLag, StalenessBuffer
from learner.checkpoint import TrainerState, save_checkpoint
from learner.checkpoint_sharded import save_sharded_checkpoint, use_sharded
from learner.distributed import DistContext, init_from_env, shutdown
from learner.exporter import LearnerExporter
from learner.replay import Readmission, record_refused, replay_wal
from learner.trackers import Trackers
from learner.versions import PolicyView, Republisher, next_version, write_version_mark
from learner.wiring import (
    LearnerState,
    build_receiver,
    gather_checkpoint,
    make_admission,
    setup,
    signal_filter,
    train_on,
)

log = logging.getLogger(__name__)


def run(cfg: SpecRLConfig) -> dict[str, float]:
    """Train for ``cfg.run.steps`` steps; returns the last metrics record."""
    if cfg.learner.weights_group:
        # Refused on CUDA before the process group forms or the model loads, every rank alike
        # (the device is the one init_from_env and Learner pick).
        refusal = weights_group_refusal("cuda" if torch.cuda.is_available() else "cpu")
        if refusal is not None:
            raise SystemExit(f"specrl-learner: refusing to start: learner.weights_group: {refusal}")
    torch.set_num_threads(cfg.run.torch_threads)
    heap.apply_mmap_threshold(cfg.run.mmap_threshold_bytes, "learner")
    heap.cap_onednn_cache(cfg.run.onednn_cache_capacity, "learner")
    torch.manual_seed(cfg.run.seed)
    # Under torchrun (WORLD_SIZE > 1): data-parallel FSDP2 ranks; rank 0 runs everything below,
    # the others follow its broadcasts (learner/distributed.py).
    dist = init_from_env(timeout_s=max(3600.0, 2 * cfg.learner.group_timeout_s))
    try:
        if dist is not None and not dist.is_main:
            return follow(cfg, dist)
        return _run(cfg, dist)
    finally:
        shutdown()  # a no-op without a process group


@dataclass(frozen=True)
class Cadence:
    """What follows a training step, on every rank alike."""

    publish: bool
    checkpoint: bool


def cadence(cfg: SpecRLConfig, step: int, skipped: bool) -> Cadence:
    """After step ``step`` (counted): publish every ``publish_every`` steps unless the step was
    skipped, checkpoint every ``checkpoint_every``. Rank 0 and the other ranks both decide with
    this one function: each publish and checkpoint gathers the full state, a collective every
    rank must join, so two rules that drifted apart would deadlock FSDP."""
    return Cadence(
        publish=step % cfg.learner.publish_every == 0 and not skipped,
        checkpoint=step % cfg.learner.checkpoint_every == 0,
    )


def follow(cfg: SpecRLConfig, dist: DistContext) -> dict[str, float]:
    """A rank > 0: trains its shard of each step rank 0 broadcasts, and joins the collectives
    that gather the full state for publishing and checkpoints. Never talks to Redis or actors."""
    # A stop signal (torchrun forwards it to every rank) must not end this rank: rank 0 decides
    # when to stop and still needs it for the final checkpoint's gather.
    StopFlag(f"learner rank {dist.rank}")
    checkpoint_root = cfg.run.resolved_dir() / "checkpoints"
    state = setup(cfg, checkpoint_root, dist.device, dist)
    limits, _ = wire_limits(
        state.args.vocab_size, make_admission(cfg, state.args), cfg.learner.max_frame_bytes
    )
    dtype = publish_dtype(state.trainer.model, cfg.learner.publish_dtype)
    view = PolicyView(state.trainer.model, state.args, dist, dtype)
    view.refresh()  # rank 0's first publish
    last: dict[str, float] = {}
    while True:
        op, version, groups = dist.receive(limits)
        if op == "stop":
            join_checkpoint(cfg, state, dist, checkpoint_root)  # rank 0's final checkpoint
            return last
        batch = collate(groups, version, state.tokenizer.pad_id, dist.device, state.shaping)
        last = train_on(state, batch, cfg)
        state.step += 1
        due = cadence(cfg, state.step, bool(last[mn.LEARNER_SKIPPED]))
        if due.publish:
            view.refresh()
        if due.checkpoint:
            join_checkpoint(cfg, state, dist, checkpoint_root)
        heap.trim()  # the step's freed activations and gathered state back to the OS


def join_checkpoint(cfg: SpecRLConfig, state: LearnerState, dist: DistContext, root: Path) -> None:
    """A rank > 0's part of rank 0's checkpoint: writing its shards, or joining the gather."""
    if use_sharded(cfg.learner, dist):
        save_sharded_checkpoint(root, state.trainer.model, state.trainer.optimizer, dist)
    else:
        gather_checkpoint(state, dist)


@dataclass
class StepTimes:
    """When the phases of one step started and ended (``time.perf_counter``)."""

    started: float
    collected: float = 0.0
    trained: float = 0.0
    published: float = 0.0


class Learner:
    """One learner process: what :func:`_run` wires up once, and the phases of its loop
    (collect, train, publish, log, checkpoint) as methods over that shared state."""

    def __init__(self, cfg: SpecRLConfig, dist: DistContext | None) -> None:
        self.cfg, self.dist = cfg, dist
        run_dir = cfg.run.resolved_dir()
        run_dir.mkdir(parents=True, exist_ok=True)
        if dist is not None:
            self.device = dist.device
        else:
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.checkpoint_root = run_dir / "checkpoints"
        self.version_mark = run_dir / "published_version"
        self.wal_dir = run_dir / "wal"
        self.stop = StopFlag("learner")

        self.state = state = setup(cfg, self.checkpoint_root, self.device, dist)
        admission = make_admission(cfg, state.args)
        limits, _ = wire_limits(state.args.vocab_size, admission, cfg.learner.max_frame_bytes)
        self.readmission = Readmission(limits, admission)
        replayed = replay_wal(self.wal_dir, state, cfg, self.readmission)
        store = WeightWriter.from_config(cfg.redis, cfg.run.name)
        state.version = next_version(store, state.version, self.version_mark, self.stop)
        # Groups an earlier learner acked, admitted again against this one's bounds and version.
        state.pending = self.readmission.admit(state.pending, state.version)
        replayed = self.readmission.admit(replayed, state.version)
        self._start_publishing(store)
        log.info(
            "learner: published version %d; waiting for actors at %s",
            state.version,
            cfg.learner.resolved_bind(),
        )
        self._open_logs(run_dir)
        self.buffer = StalenessBuffer(
            cfg.learner.max_staleness, admission, self.ledger, signal_filter(cfg, state)
        )
        self.buffer.carry([*state.pending, *replayed])
        self.lag = DeliveryLag(cfg.learner.max_staleness, cfg.learner.max_staleness_from_lag)
        self.receiver = build_receiver(cfg, limits, admission, self.wal_dir, lambda: state.version)
        self.intake = self.receiver.intake  # what arrived: groups, dedupe record, counters
        self.exporter.watch(
            lambda: {
                **self.intake.stats(),
                mn.LEARNER_WAL_SKIPPED: self.readmission.skipped,
                mn.LEARNER_DROPPED_STALE: self.buffer.dropped_stale,
                **self._group_metrics(),
            }
        )
        self.skipped_steps = 0
        self.trainer = TrainerState(step=state.step, version=state.version)
        self.last: dict[str, float] = {}
        self.evaluations = EvaluationIntake()  # the evaluating actor's figures (eval.every)
        self.intake.load_dedupe_state(state.dedupe)
        self.intake.mark_seen(replayed)
        self.receiver.start()
        self.wall_start = time.perf_counter()

    def _start_publishing(self, store: WeightWriter) -> None:
        """Publish the first version; the version mark is written once a version is in Redis."""
        state, lcfg = self.state, self.cfg.learner
        dtype = publish_dtype(state.trainer.model, lcfg.publish_dtype)
        self.view = PolicyView(state.trainer.model, state.args, self.dist, dtype)
        self.view.refresh()  # a collective under FSDP: every rank streams, rank 0 keeps it
        # learner.weights_group: the same versions also go, as bf16 buckets, to the actors that
        # joined the weights group (common/weights/collective.py); Redis keeps the order. The
        # sender broadcasts the publisher's snapshot of each version: no copy of its own here.
        self.collective = None
        if lcfg.weights_group and (self.dist is None or self.dist.rank == 0):
            from common.weights.publish.collective_sender import CollectiveSender

            self.collective = CollectiveSender.from_config(
                lcfg, store.client, store.run_id, self.device
            )
        self.publisher = Publisher(
            store,
            self.view,
            state.tokenizer,
            dtype=dtype,
            max_inflight=lcfg.publish_max_inflight,
            upload=lcfg.publish_upload,
            latest_wins=lcfg.publish_latest_wins,
            should_stop=self.stop,
            on_published=lambda version: write_version_mark(self.version_mark, version),
            # The snapshot is taken in the background, before a step.
            optimizer=state.trainer.optimizer,
            on_snapshot=self.collective.take if self.collective is not None else None,
        )
        self.publisher.publish(state.version)
        # Republishing re-sends the last gathered state: rank 0 alone, no collective.
        self.republisher = Republisher(
            store,
            lambda: self.publisher.publish(state.version),
            busy=lambda: self.publisher.inflight > 0,
        )

    def _group_metrics(self) -> dict[str, float]:
        """The weights group sender's counters and errors (``learner/weights_group_*``); none
        without ``learner.weights_group`` (or on ranks > 0)."""
        return self.collective.metrics() if self.collective is not None else {}

    def _open_logs(self, run_dir: Path) -> None:
        """metrics.jsonl, the Prometheus exporter and, with ``run.ledger``, the ledger of every
        group's outcome (opened with a ``start`` event and the refused groups of readmission)."""
        self.metrics = MetricsWriter(run_dir / "metrics.jsonl")
        self.trackers = Trackers.open(self.cfg, run_dir)  # run.report_to: W&B, TensorBoard
        self.exporter = LearnerExporter.start(self.cfg, run_dir)
        self.ledger = (
            MetricsWriter(run_dir / "ledger" / "learner.jsonl") if self.cfg.run.ledger else None
        )
        if self.ledger is not None:
            # Outcomes a killed learner logged after its last checkpoint are void: the model
            # lost those steps and the groups come back from the write-ahead log.
            self.ledger.write({"event": "start", "resumed_step": self.state.step})
        record_refused(self.ledger, self.readmission.refused, self.state)

    def collect(self) -> list[TrajectoryGroup]:
        """Phase 1: fresh groups for the next step (stale ones are dropped and counted); fewer
        than a step's worth when a stop came first."""
        state, learner_cfg = self.state, self.cfg.learner
        self.buffer.step = state.step + 1
        self.republisher.check(state.version)
        held = [info.version for info in self.intake.live_actors().values()]
        bound = self.lag.observe(state.version, held)
        if bound != self.buffer.max_staleness:
            log.info(
                "learner: staleness bound %d -> %d (weight-delivery lag %d versions)",
                self.buffer.max_staleness,
                bound,
                self.lag.lag,
            )
            self.buffer.max_staleness = bound
        return self.buffer.collect(
            self.intake.get,
            learner_cfg.groups_per_step,
            state.version,
            learner_cfg.group_timeout_s,
            should_stop=self.stop,
            on_idle=lambda: self.republisher.check(state.version),
        )

    def train(self, groups: list[TrajectoryGroup]) -> tuple[TrainBatch, dict[str, float]]:
        """Phase 2: one optimizer step (every rank trains its shard of the same batch)."""
        state = self.state
        if self.dist is not None:
            self.dist.send_step(groups, state.version)
        batch = collate(groups, state.version, state.tokenizer.pad_id, self.device, state.shaping)
        step_metrics = train_on(state, batch, self.cfg)
        skipped = step_metrics[mn.LEARNER_SKIPPED] > 0
        self.skipped_steps += skipped
        for group in groups:
            self.buffer.record(group, "skipped" if skipped else "trained", state.version)
        record_refused(self.ledger, self.intake.take_refused(), state)
        state.step += 1
        return batch, step_metrics

    def publish(self, due: bool) -> None:
        """Phase 3: publish the new policy when :func:`cadence` says so."""
        if due and self.view.refresh():  # False: non-finite shards, counted, not gathered
            self.state.version += 1
            self.publisher.publish(self.state.version)  # the weights group's too (on_snapshot)

    def _new_evaluation(self) -> dict[str, float]:
        """The evaluating actor's latest held-out evaluation (``eval/*``), once: in the first
        step record after its status brought it (see :class:`EvaluationIntake`)."""
        return self.evaluations.take(self.intake.live_actors(), self.state.version)

    def log(
        self,
        batch: TrainBatch,
        groups: list[TrajectoryGroup],
        step_metrics: dict[str, float],
        times: StepTimes,
    ) -> None:
        """Phase 4: the step's figures to metrics.jsonl and Prometheus."""
        state, intake = self.state, self.intake
        self.last = {
            mn.LEARNER_STEP: state.step,
            mn.LEARNER_VERSION: state.version,
            **step_metrics,
            **_batch_metrics(batch, groups),
            **_actor_metrics(intake),
            **self._new_evaluation(),
            **intake.stats(),
            mn.LEARNER_DROPPED_STALE: self.buffer.dropped_stale,
            mn.LEARNER_MAX_STALENESS: self.buffer.max_staleness,
            mn.LEARNER_WEIGHT_DELIVERY_LAG: self.lag.lag,
            mn.LEARNER_REPUBLISHED: self.republisher.republished,
            mn.LEARNER_REJECTED_GROUPS: self.buffer.rejected,
            mn.LEARNER_GROUPS_SKIPPED_NO_SIGNAL: self.buffer.skipped_no_signal,
            mn.LEARNER_SKIPPED_STEPS: self.skipped_steps,
            mn.LEARNER_WAL_SKIPPED: self.readmission.skipped,
            mn.LEARNER_WAIT_S: times.collected - times.started,
            mn.LEARNER_TRAIN_S: times.trained - times.collected,
            mn.LEARNER_PUBLISH_S: times.published - times.trained,
            mn.LEARNER_PUBLISH_UPLOAD_S: self.publisher.last_publish_s,
            mn.LEARNER_PUBLISH_REFUSED: self.publisher.refused + self.view.refused,
            mn.LEARNER_PUBLISH_SKIPPED_VERSIONS: self.publisher.skipped,
            mn.LEARNER_WALL_S: times.published - self.wall_start,
            **self._group_metrics(),
        }
        self.exporter.update(self.last, batch.staleness)
        if state.step % self.cfg.learner.metrics_every == 0 or state.step == self.cfg.run.steps:
            self.metrics.write(self.last)
            self.trackers.log(self.last)

    def checkpoint(self, pending: list[TrajectoryGroup]) -> None:
        """Phase 5 (every ``checkpoint_every`` steps, and at exit): model, optimizer and every
        acked group not yet trained."""
        state, trainer = self.state, self.trainer
        trainer.step, trainer.version = state.step, state.version
        # One cut: every acked group is in the checkpoint's pending list, already trained, or
        # in a log segment from wal_from on.
        trainer.dedupe, queued, wal_from = self.intake.checkpoint_cut()
        trainer.wal_from = wal_from if wal_from is not None else 0
        trainer.metrics = {k: v for k, v in self.last.items() if isinstance(v, int | float)}
        pending = [*self.buffer.pending(), *queued, *pending]
        if use_sharded(self.cfg.learner, self.dist):
            path = save_sharded_checkpoint(
                self.checkpoint_root,
                state.trainer.model,
                state.trainer.optimizer,
                self.dist,
                state.tokenizer,
                trainer,
                pending=pending,
            )
        else:
            path = save_checkpoint(
                self.checkpoint_root,
                gather_checkpoint(state, self.dist),
                state.tokenizer,
                None,
                trainer,
                pending=pending,
            )
        if wal_from is not None:
            trim(self.wal_dir, wal_from)
        if self.ledger is not None:
            self.ledger.write({"event": "checkpoint", "step": state.step})
        log.info("learner: checkpoint %s", path)

    def close(self, unfinished: list[TrajectoryGroup]) -> None:
        """Stop receiving, let the last version reach Redis, and checkpoint what is left."""
        state, intake = self.state, self.intake
        evaluation = self._new_evaluation()  # one that came after the last step's record
        self.receiver.close()
        self.exporter.close()
        self.publisher.close()  # the last version reaches Redis before the final checkpoint
        if self.collective is not None:
            self.collective.close()  # the group's members go back to Redis
        # Acked but not trained on: carried in the checkpoint so a resumed learner trains them
        # (acked means the actor has forgotten them; this is the only copy).
        leftover = [*unfinished, *intake.drain()]
        for group in [*self.buffer.pending(), *leftover]:
            self.buffer.record(group, "pending_at_exit", state.version)
        record_refused(self.ledger, intake.take_refused(), state)
        if self.dist is not None:
            self.dist.send_stop()  # the other ranks join the final checkpoint's gather
        self.checkpoint(leftover)
        self.metrics.write(
            {
                "event": "learner_exit",
                mn.LEARNER_STEP: state.step,
                mn.LEARNER_VERSION: state.version,
                **intake.stats(),
                **evaluation,
            }
        )
        if evaluation:
            self.trackers.log({mn.LEARNER_STEP: state.step, **evaluation})
        self.metrics.close()
        self.trackers.close()
        if self.ledger is not None:
            self.ledger.close()


def _run(cfg: SpecRLConfig, dist: DistContext | None) -> dict[str, float]:
    learner = Learner(cfg, dist)
    state = learner.state
    unfinished: list[TrajectoryGroup] = []
    deadline = time.monotonic() + cfg.run.max_wall_s if cfg.run.max_wall_s else float("inf")
    try:
        while state.step < cfg.run.steps and not learner.stop() and time.monotonic() < deadline:
            times = StepTimes(started=time.perf_counter())
            groups = learner.collect()
            if len(groups) < cfg.learner.groups_per_step:
                unfinished = groups  # a stop came first: keep them for the next run
                break
            times.collected = time.perf_counter()
            batch, step_metrics = learner.train(groups)
            times.trained = time.perf_counter()
            due = cadence(cfg, state.step, step_metrics[mn.LEARNER_SKIPPED] > 0)
            learner.publish(due.publish)
            times.published = time.perf_counter()
            learner.log(batch, groups, step_metrics, times)
            if due.checkpoint:
                learner.checkpoint([])
            heap.trim()  # the step's freed activations and gathered state back to the OS
    finally:
        learner.close(unfinished)
    return learner.last


def _batch_metrics(batch: TrainBatch, groups: list) -> dict[str, float]:
    lengths = batch.mask.sum(dim=-1)
    finished = [c.finished for g in groups for c in g.completions]
    # Rollout figures the actors attached to each group (e.g. spec/acceptance_rate), averaged.
    rollout_keys = {k for g in groups for k in g.stats if k.startswith(mn.ROLLOUT_GROUPS)}
    rollout = {
        k: sum(g.stats[k] for g in groups if k in g.stats) / sum(k in g.stats for g in groups)
        for k in sorted(rollout_keys)
    }
    return {
        **rollout,
        mn.LEARNER_REWARD_MEAN: float(batch.rewards.mean()),
        mn.LEARNER_REWARD_MAX: float(batch.rewards.max()),
        mn.LEARNER_STALENESS_MEAN: float(batch.staleness.float().mean()),
        mn.LEARNER_STALENESS_MAX: int(batch.staleness.max()),
        mn.LEARNER_STALENESS_HIST: torch.bincount(batch.staleness.clamp(min=0)).tolist(),
        mn.LEARNER_GROUPS: len(groups),
        mn.LEARNER_TOKENS: batch.num_tokens,
        mn.LEARNER_COMPLETION_LEN_MEAN: float(lengths.mean()),
        mn.LEARNER_FINISHED_FRAC: sum(finished) / max(len(finished), 1),
    }


class EvaluationIntake:
    """Which ``eval/*`` figures of the actors' heartbeats reach the records.

    One actor evaluates (``eval.actor``), but the wire carries no actor index and an actor
    chooses its own id, so any connected actor could send ``eval/*``. The learner takes them
    from one actor only: the first live one to report them, and no other while it stays live
    (a restarted evaluator, with a fresh id, is taken once the old one is forgotten). A version
    above the learner's own is refused: no actor holds it, and a forged ``eval/version`` of 1e9
    would hide every later real evaluation. Each evaluation is taken once."""

    def __init__(self) -> None:
        self.version = -1  # the latest evaluation taken
        self.actor_id: str | None = None  # the actor whose figures are taken
        self.refused = 0  # heartbeats with eval/* refused (another actor, or a version too new)
        self._refused_seen: set[tuple[str, float]] = set()

    def take(self, live: Mapping[str, ActorInfo], learner_version: int) -> dict[str, float]:
        """The new evaluation among ``live`` actors' statuses, or {}."""
        if self.actor_id not in live:
            self.actor_id = None  # forgotten (silent past actor_timeout_s): the next one reports
        for actor_id, info in live.items():
            version = info.stats.get(mn.EVAL_VERSION)
            if version is None or version <= self.version:
                continue
            if self.actor_id not in (None, actor_id) or version > learner_version:
                self._refuse(actor_id, version, learner_version)
                continue
            self.actor_id, self.version = actor_id, int(version)
            return {k: v for k, v in info.stats.items() if k.startswith(mn.EVAL_PREFIX)}
        return {}

    def _refuse(self, actor_id: str, version: float, learner_version: int) -> None:
        if (actor_id, version) in self._refused_seen or len(self._refused_seen) > 1024:
            return  # counted and logged once per (actor, version); bounded against a flood
        self._refused_seen.add((actor_id, version))
        self.refused += 1
        log.warning(
            "learner: eval/* of version %s from actor %s refused: %s",
            version,
            actor_id,
            f"above the learner's version {learner_version}"
            if version > learner_version
            else f"actor {self.actor_id} evaluates",
        )


def _actor_metrics(intake: Intake) -> dict[str, float]:
    live = intake.live_actors()

    def total(key: str) -> float:
        return sum(info.stats.get(key, 0.0) for info in live.values())

    return {
        mn.ACTOR_LIVE: len(live),
        mn.ACTOR_TOKENS_PER_S: total(mn.ACTOR_TOKENS_PER_S),
        # Cumulative seconds the live actors idled waiting for a version (synchronous mode).
        mn.ACTOR_WAIT_S: total(mn.ACTOR_WAIT_S),
        # The live actors' last weights fetch, averaged (0 before the first).
        mn.ACTOR_WEIGHT_FETCH_S: total(mn.ACTOR_WEIGHT_FETCH_S) / max(len(live), 1),
    }
