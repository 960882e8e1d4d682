"""The learner loop: collect fresh groups → one GRPO/PPO step → publish a version → log → checkpoint."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.config import LearnerConfig, SamplingConfig, SpecConfig, SpecRLConfig
from common.curve_keys import authorized_dir, learner_keys
from common.entrypoint import StopFlag
from common.metrics import MetricsWriter
from common.model import Transformer, load_pretrained
from common.prometheus import LearnerExporter
from common.protocol import DecodeLimits, TrajectoryGroup
from common.sampling import processed_logprobs, token_logprobs
from common.tokenizer import Tokenizer, load_tokenizer
from common.transport import DEFAULT_HWM
from common.warm_start import ensure_model
from common.weights import (
    REDIS_DOWN,
    WeightsError,
    WeightStore,
    retry_redis,
    store_from_config,
)
from learner.admission import Admission, wire_limits
from learner.batch import TrainBatch, collate
from learner.buffer import StalenessBuffer
from learner.checkpoint import (
    TrainerState,
    latest_checkpoint,
    load_checkpoint,
    load_pending,
    restore_optimizer,
    save_checkpoint,
)
from learner.loss import early_exit_kl, ppo_clip_loss
from learner.publisher import Publisher, publish_dtype
from learner.receiver import GroupReceiver
from learner.wal import WalWriter, replay, trim

log = logging.getLogger(__name__)


@dataclass
class LearnerState:
    model: Transformer
    tokenizer: Tokenizer
    optimizer: torch.optim.Optimizer
    ref_model: Transformer | None
    step: int
    version: int
    dedupe: dict
    """Receiver dedupe state restored from the checkpoint (empty on a fresh start)."""
    pending: list[TrajectoryGroup]
    """Groups acked before the restart but never trained on (from the checkpoint)."""
    wal_from: int = 0
    """First write-ahead-log segment the checkpoint does not cover (0: none, or a fresh run)."""


def train_step(
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    cfg: LearnerConfig,
    sampling: SamplingConfig,
    ref_model: Transformer | None = None,
    spec: SpecConfig | None = None,
) -> dict[str, float]:
    """One optimizer step of PPO-clip (ratio to the behaviour policy, dual-clipped) on GRPO
    advantages, plus the early-exit co-training loss when ``spec.aux_coef > 0``."""
    model.train()
    valid = batch.mask > 0
    aux_coef = spec.aux_coef if spec is not None else 0.0
    num_layers = model.args.num_hidden_layers
    x = model.model.embed_tokens(batch.input_ids)  # [B, S, H]
    if aux_coef > 0:
        exit_layer = spec.exit_layer
        if not 1 <= exit_layer < num_layers:
            raise ValueError(f"spec.exit_layer={exit_layer} must be in [1, {num_layers - 1}]")
        h_exit = model.run_layers(x, None, None, 0, exit_layer)
        logits = model.head(model.run_layers(h_exit, None, None, exit_layer, num_layers))[:, :-1]
        exit_logits = model.head(h_exit)[:, :-1]  # [B, S-1, V]
    else:
        logits = model.head(model.run_layers(x, None, None, 0, num_layers))[:, :-1]  # [B, S-1, V]
    logprobs = token_logprobs(logits, batch.targets, sampling.temperature, sampling.top_p)
    ref_logprobs = None
    if ref_model is not None and cfg.kl_coef > 0:
        with torch.no_grad():
            ref_logprobs = token_logprobs(
                ref_model(batch.input_ids)[:, :-1],
                batch.targets,
                sampling.temperature,
                sampling.top_p,
            )
    # With top-p < 1 a sampled token can fall outside the current (or reference) nucleus: its
    # log-prob is -inf and the ratio undefined. Such tokens leave the loss and are counted.
    usable = valid & torch.isfinite(logprobs)
    if ref_logprobs is not None:
        usable &= torch.isfinite(ref_logprobs)
        ref_logprobs = ref_logprobs.masked_fill(~usable, 0.0)
    logprobs = logprobs.masked_fill(~usable, 0.0)  # [B, S-1]
    out = ppo_clip_loss(
        logprobs=logprobs,
        behaviour_logprobs=batch.behaviour_logprobs,
        advantages=batch.advantages,
        mask=usable.float(),
        clip_eps=cfg.clip_eps,
        is_cap=cfg.is_cap,
        ref_logprobs=ref_logprobs,
        kl_coef=cfg.kl_coef,
    )
    loss = out.loss
    exit_kl = torch.zeros(())
    if aux_coef > 0:
        exit_kl = early_exit_kl(
            processed_logprobs(logits, sampling.temperature),
            processed_logprobs(exit_logits, sampling.temperature),
            batch.mask,
        )
        loss = loss + aux_coef * exit_kl
    optimizer.zero_grad(set_to_none=True)
    # Defence in depth behind admission: a step whose loss or gradients are not finite would
    # put NaN into every weight (and every actor). It is skipped and counted, never taken.
    skipped = not bool(torch.isfinite(loss))
    grad_norm = torch.full((), float("nan"))
    if not skipped:
        loss.backward()
        params = [p for p in model.parameters() if p.grad is not None]
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        skipped = not bool(torch.isfinite(grad_norm))
    if skipped:
        optimizer.zero_grad(set_to_none=True)
        log.error(
            "learner: skipped a step with a non-finite loss (%s) or gradient norm (%s)",
            float(loss.detach()),
            float(grad_norm),
        )
    else:
        optimizer.step()
    return {
        "learner/skipped": float(skipped),
        "learner/loss": float(out.loss.detach()),
        "learner/pg_loss": float(out.pg_loss),
        "learner/kl": float(out.kl),
        "learner/clip_frac": float(out.clip_frac),
        "learner/truncated_frac": float(out.truncated_frac),
        "learner/ratio_mean": float(out.ratio_mean),
        "learner/abs_log_ratio": float(out.abs_log_ratio),
        "learner/outside_nucleus_frac": float(1.0 - usable.sum() / valid.sum().clamp(min=1)),
        "learner/grad_norm": float(grad_norm),
        "spec/exit_kl": float(exit_kl.detach()),
    }


def make_optimizer(model: Transformer, cfg: LearnerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def setup(cfg: SpecRLConfig, checkpoint_root: Path, device: torch.device) -> LearnerState:
    """Model, optimizer and counters: from the newest checkpoint, else from the model directory."""
    ckpt = latest_checkpoint(checkpoint_root) if cfg.learner.resume else None
    if ckpt is not None:
        model, opt_tensors, trainer, param_groups = load_checkpoint(ckpt, device)
        tokenizer = load_tokenizer(ckpt)
        optimizer = make_optimizer(model, cfg.learner)
        restore_optimizer(model, optimizer, opt_tensors, param_groups)
        pending = load_pending(ckpt, DecodeLimits(vocab_size=model.args.vocab_size))
        step, version, dedupe = trainer.step, trainer.version, trainer.dedupe
        wal_from = trainer.wal_from
        log.info(
            "resumed from %s (step %d, version %d, %d groups carried over)",
            ckpt,
            step,
            version,
            len(pending),
        )
    else:
        model_dir = ensure_model(cfg)
        model = load_pretrained(model_dir, device=device)
        tokenizer = load_tokenizer(model_dir)
        optimizer = make_optimizer(model, cfg.learner)
        step, version, dedupe, pending, wal_from = 0, -1, {}, [], 0
    ref_model = None
    if cfg.learner.kl_coef > 0:
        # The reference is the policy the run started from (the checkpoint's, after a resume).
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    return LearnerState(
        model, tokenizer, optimizer, ref_model, step, version, dedupe, pending, wal_from
    )


def read_version_mark(path: Path) -> int:
    """Highest version this run ever published (-1 if none), kept beside the checkpoints."""
    return int(path.read_text()) if path.is_file() else -1


def write_version_mark(path: Path, version: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(version))
    tmp.replace(path)


class Republisher:
    """Puts the current version back when Redis has lost it (restarted without persistence, or
    flushed), so actors that start meanwhile find weights. Checks at most every ``every_s``."""

    def __init__(
        self, store: WeightStore, publish, every_s: float = 2.0, busy=lambda: False
    ) -> None:
        self.store = store
        self.publish = publish
        self.every_s = every_s
        self.busy = busy
        """True while a version is still uploading: it is not missing, just not there yet."""
        self.republished = 0
        self._next = time.monotonic() + every_s

    def check(self, version: int) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        try:
            latest = self.store.latest_version()
            if self.busy():
                return
            if latest is None or latest < version:
                log.warning(
                    "learner: Redis holds version %s, not %d (restarted?); republishing",
                    latest,
                    version,
                )
                self.publish()
                self.republished += 1
        except (*REDIS_DOWN, WeightsError) as e:
            log.warning("learner: cannot check or republish weights (%s); will retry", e)


def make_admission(cfg: SpecRLConfig, model: Transformer) -> Admission:
    """What this run trains on: its group size, the model's context (or a smaller learner
    budget) and the reward bound."""
    context = model.args.max_position_embeddings
    budget = cfg.learner.max_seq_tokens
    return Admission(
        group_size=cfg.actor.group_size,
        max_seq_tokens=min(context, budget) if budget > 0 else context,
        max_abs_reward=cfg.learner.max_abs_reward,
    )


@dataclass
class Readmission:
    """Groups that an earlier learner acked (in its log or checkpoint) put through this
    learner's decode limits and admission again; the refused are skipped, counted and put in
    the ledger, never trained and never a reason to stop."""

    limits: DecodeLimits
    admission: Admission
    skipped: int = 0
    refused: list[tuple[str, int, int, str]] = field(default_factory=list)

    def undecodable(self, what: str) -> None:
        self.skipped += 1
        log.error("learner: skipped a logged group this learner cannot decode: %s", what)

    def admit(self, groups: list[TrajectoryGroup], latest_version: int) -> list[TrajectoryGroup]:
        kept = []
        for group in groups:
            refusal = self.admission.refusal(group, latest_version)
            if refusal is None:
                kept.append(group)
                continue
            self.skipped += 1
            self.refused.append((group.actor_id, group.seq, group.version, refusal.reason))
            log.error(
                "learner: skipped logged group %s/%d: %s (%s)",
                group.actor_id,
                group.seq,
                refusal.reason,
                refusal.detail,
            )
        return kept


def replay_wal(
    wal_dir: Path, state: LearnerState, cfg: SpecRLConfig, readmission: Readmission
) -> list[TrajectoryGroup]:
    """Groups acked after the checkpoint (or since a fresh start) by a learner that did not stop
    cleanly; empty for a resume=false run, whose old log is discarded."""
    if not cfg.learner.resume:
        trim(wal_dir, 2**62)
        return []
    replayed = replay(wal_dir, state.wal_from, readmission.limits, readmission.undecodable)
    if replayed:
        log.info(
            "learner: %d acked group(s) replayed from the write-ahead log (segments >= %d)",
            len(replayed),
            state.wal_from,
        )
    return replayed


def run(cfg: SpecRLConfig) -> dict[str, float]:
    """Train for ``cfg.run.steps`` steps; returns the last metrics record."""
    torch.set_num_threads(cfg.run.torch_threads)
    torch.manual_seed(cfg.run.seed)
    run_dir = cfg.run.resolved_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    checkpoint_root = run_dir / "checkpoints"
    version_mark = run_dir / "published_version"
    stop = StopFlag("learner")

    state = setup(cfg, checkpoint_root, device)
    admission = make_admission(cfg, state.model)
    limits, frame_bytes = wire_limits(
        state.model.args.vocab_size, admission, cfg.learner.max_frame_bytes
    )
    readmission = Readmission(limits, admission)
    wal_dir = run_dir / "wal"
    replayed = replay_wal(wal_dir, state, cfg, readmission)
    store = store_from_config(cfg.redis, cfg.run.name)
    # Versions only grow, across restarts too: continue after the newest of the checkpoint, what
    # Redis holds, and what this run ever published (a private Redis may have lost everything).
    latest = retry_redis("learner", "reading the latest version", store.latest_version, stop)
    state.version = (
        max(state.version, latest if latest is not None else -1, read_version_mark(version_mark))
        + 1
    )
    # Groups an earlier learner acked, admitted again against this one's bounds and version.
    state.pending = readmission.admit(state.pending, state.version)
    replayed = readmission.admit(replayed, state.version)
    # Uploads run on a background thread while the next step trains (Redis outages are retried
    # there); the version mark is written once a version is in Redis.
    publisher = Publisher(
        store,
        state.model,
        state.tokenizer,
        dtype=publish_dtype(state.model, cfg.learner.publish_dtype),
        max_inflight=cfg.learner.publish_max_inflight,
        should_stop=stop,
        on_published=lambda version: write_version_mark(version_mark, version),
    )

    def publish() -> None:
        publisher.publish(state.version)

    publish()
    republisher = Republisher(store, publish, busy=lambda: publisher.inflight > 0)
    log.info(
        "learner: published version %d; waiting for actors at %s",
        state.version,
        cfg.learner.resolved_bind(),
    )

    metrics = MetricsWriter(run_dir / "metrics.jsonl")
    exporter = LearnerExporter.start(cfg, run_dir)
    ledger = MetricsWriter(run_dir / "ledger" / "learner.jsonl") if cfg.run.ledger else None
    if ledger is not None:
        # Outcomes a killed learner logged after its last checkpoint are void: the model lost
        # those steps and the groups come back from the write-ahead log.
        ledger.write({"event": "start", "resumed_step": state.step})
    record_refused(ledger, readmission.refused, state)
    buffer = StalenessBuffer(cfg.learner.max_staleness, cfg.actor.group_size, ledger)
    buffer.carry([*state.pending, *replayed])
    curve = None
    authorized = None
    if cfg.security.curve_dir:
        curve = learner_keys(Path(cfg.security.curve_dir))
        authorized = Path(
            cfg.security.authorized_keys or authorized_dir(Path(cfg.security.curve_dir))
        )
    receiver = GroupReceiver(
        cfg.learner.resolved_bind(),
        limits,
        queue_max=cfg.learner.queue_max,
        curve=curve,
        authorized_keys=authorized,
        wal=WalWriter(wal_dir, fsync=cfg.learner.wal_fsync) if cfg.learner.wal else None,
        hwm=max(2, min(DEFAULT_HWM, cfg.learner.recv_buffer_bytes // frame_bytes)),
        admission=admission,
        latest_version=lambda: state.version,
    )
    exporter.watch(lambda: {**receiver.stats(), "learner/wal_skipped": readmission.skipped})
    skipped_steps = 0
    trainer = TrainerState(step=state.step, version=state.version)
    last: dict[str, float] = {}

    def checkpoint(pending: list[TrajectoryGroup]) -> None:
        trainer.step, trainer.version = state.step, state.version
        # One cut: every acked group is in the checkpoint's pending list, already trained, or
        # in a log segment from wal_from on.
        trainer.dedupe, queued, wal_from = receiver.checkpoint_cut()
        trainer.wal_from = wal_from if wal_from is not None else 0
        trainer.metrics = {k: v for k, v in last.items() if isinstance(v, int | float)}
        path = save_checkpoint(
            checkpoint_root,
            state.model,
            state.tokenizer,
            state.optimizer,
            trainer,
            pending=[*buffer.pending(), *queued, *pending],
        )
        if wal_from is not None:
            trim(wal_dir, wal_from)
        if ledger is not None:
            ledger.write({"event": "checkpoint", "step": state.step})
        log.info("learner: checkpoint %s", path)

    receiver.load_dedupe_state(state.dedupe)
    receiver.mark_seen(replayed)
    receiver.start()
    wall_start = time.perf_counter()
    unfinished: list[TrajectoryGroup] = []
    try:
        while state.step < cfg.run.steps and not stop():
            # Phase 1: collect fresh groups (stale ones are dropped and counted).
            t0 = time.perf_counter()
            buffer.step = state.step + 1
            republisher.check(state.version)
            groups = buffer.collect(
                receiver.get,
                cfg.learner.groups_per_step,
                state.version,
                cfg.learner.group_timeout_s,
                should_stop=stop,
                on_idle=lambda: republisher.check(state.version),
            )
            if len(groups) < cfg.learner.groups_per_step:
                unfinished = groups  # a stop came first: keep them for the next run
                break
            t1 = time.perf_counter()
            # Phase 2: one optimizer step.
            batch = collate(groups, state.version, state.tokenizer.pad_id, device)
            step_metrics = train_step(
                state.model,
                state.optimizer,
                batch,
                cfg.learner,
                cfg.sampling,
                state.ref_model,
                cfg.spec,
            )
            skipped = step_metrics["learner/skipped"] > 0
            skipped_steps += skipped
            for group in groups:
                buffer.record(group, "skipped" if skipped else "trained", state.version)
            record_refused(ledger, receiver.take_refused(), state)
            state.step += 1
            t2 = time.perf_counter()
            # Phase 3: publish the new policy.
            if state.step % cfg.learner.publish_every == 0 and not skipped:
                state.version += 1
                publish()
            t3 = time.perf_counter()
            # Phase 4: log.
            last = {
                "learner/step": state.step,
                "learner/version": state.version,
                **step_metrics,
                **_batch_metrics(batch, groups),
                **_actor_metrics(receiver),
                **receiver.stats(),
                "learner/dropped_stale": buffer.dropped_stale,
                "learner/republished": republisher.republished,
                "learner/rejected_groups": buffer.rejected,
                "learner/skipped_steps": skipped_steps,
                "learner/wal_skipped": readmission.skipped,
                "learner/wait_s": t1 - t0,
                "learner/train_s": t2 - t1,
                "learner/publish_s": t3 - t2,
                "learner/publish_upload_s": publisher.last_publish_s,
                "learner/publish_refused": publisher.refused,
                "learner/wall_s": t3 - wall_start,
            }
            exporter.update(last, batch.staleness)
            if state.step % cfg.learner.metrics_every == 0 or state.step == cfg.run.steps:
                metrics.write(last)
            # Phase 5: checkpoint.
            if state.step % cfg.learner.checkpoint_every == 0:
                checkpoint([])
    finally:
        receiver.close()
        exporter.close()
        publisher.close()  # the last version reaches Redis before the final checkpoint
        # Acked but not trained on: carried in the checkpoint so a resumed learner trains them
        # (acked means the actor has forgotten them; this is the only copy).
        leftover = [*unfinished, *receiver.drain()]
        for group in [*buffer.pending(), *leftover]:
            buffer.record(group, "pending_at_exit", state.version)
        record_refused(ledger, receiver.take_refused(), state)
        checkpoint(leftover)
        metrics.write(
            {
                "event": "learner_exit",
                "learner/step": state.step,
                "learner/version": state.version,
                **receiver.stats(),
            }
        )
        metrics.close()
        if ledger is not None:
            ledger.close()
    return last


def record_refused(
    ledger: MetricsWriter | None, refused: list[tuple[str, int, int, str]], state: LearnerState
) -> None:
    """Refused groups' outcomes: final when they happen (acked as refused, never logged), so a
    learner restart never voids them."""
    if ledger is None:
        return
    for actor_id, seq, version, reason in refused:
        ledger.write(
            {
                "actor_id": actor_id,
                "seq": seq,
                "version": version,
                "learner_version": state.version,
                "step": state.step,
                "outcome": "refused",
                "reason": reason,
            }
        )


def _batch_metrics(batch: TrainBatch, groups: list) -> dict[str, float]:
    lengths = batch.mask.sum(dim=-1)
    finished = [c.finished for g in groups for c in g.completions]
    # Rollout figures the actors attached to each group (e.g. spec/acceptance_rate), averaged.
    rollout_keys = {k for g in groups for k in g.stats if k.startswith(("spec/", "verify/"))}
    rollout = {
        k: sum(g.stats[k] for g in groups if k in g.stats) / sum(k in g.stats for g in groups)
        for k in sorted(rollout_keys)
    }
    return {
        **rollout,
        "learner/reward_mean": float(batch.rewards.mean()),
        "learner/reward_max": float(batch.rewards.max()),
        "learner/staleness_mean": float(batch.staleness.float().mean()),
        "learner/staleness_max": int(batch.staleness.max()),
        "learner/staleness_hist": torch.bincount(batch.staleness.clamp(min=0)).tolist(),
        "learner/groups": len(groups),
        "learner/tokens": batch.num_tokens,
        "learner/completion_len_mean": float(lengths.mean()),
        "learner/finished_frac": sum(finished) / max(len(finished), 1),
    }


def _actor_metrics(receiver: GroupReceiver) -> dict[str, float]:
    live = receiver.live_actors()

    def total(key: str) -> float:
        return sum(info.stats.get(key, 0.0) for info in live.values())

    return {
        "actor/live": len(live),
        "actor/tokens_per_s": total("actor/tokens_per_s"),
        # Cumulative seconds the live actors idled waiting for a version (synchronous mode).
        "actor/wait_s": total("actor/wait_s"),
    }
