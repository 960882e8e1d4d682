"""The learner loop: collect fresh groups → one GRPO/PPO step → publish a version → log → checkpoint."""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from common.config import LearnerConfig, SamplingConfig, SpecConfig, SpecRLConfig
from common.curve_keys import authorized_dir, learner_keys
from common.entrypoint import StopFlag
from common.metrics import MetricsWriter
from common.model import ModelArgs
from common.prometheus import LearnerExporter
from common.protocol import DecodeLimits, TrajectoryGroup
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
    FullState,
    TrainerState,
    full_state,
    latest_checkpoint,
    load_checkpoint,
    load_pending,
    restore_optimizer,
    save_checkpoint,
)
from learner.distributed import (
    DistContext,
    full_model_state,
    full_optimizer_state,
    init_from_env,
    load_optimizer_state,
    shard,
    shutdown,
)
from learner.loss import ppo_clip_loss
from learner.microbatch import (
    MicroBatch,
    chosen_logprobs,
    empty_microbatch,
    exit_kl_sum,
    plan_microbatches,
    row_lengths,
    shard_rows,
    take_rows,
)
from learner.policy import (
    PolicyModule,
    backbone,
    hf_config,
    load_policy,
    model_args,
    num_layers,
    param_dtype,
    set_activation_checkpointing,
    unwrap,
)
from learner.publisher import Publisher, publish_dtype
from learner.receiver import GroupReceiver
from learner.wal import WalWriter, replay, trim

log = logging.getLogger(__name__)


@dataclass
class LearnerState:
    model: nn.Module
    """The policy (built-in ``Transformer`` or ``transformers`` model), or its FSDP-sharded
    ``PolicyModule`` on N ranks."""
    tokenizer: Tokenizer
    optimizer: torch.optim.Optimizer
    ref_model: nn.Module | None
    step: int
    version: int
    dedupe: dict
    """Receiver dedupe state restored from the checkpoint (empty on a fresh start)."""
    pending: list[TrajectoryGroup]
    """Groups acked before the restart but never trained on (from the checkpoint)."""
    wal_from: int = 0
    """First write-ahead-log segment the checkpoint does not cover (0: none, or a fresh run)."""
    args: ModelArgs | None = None
    """The architecture actors build from published versions (``common.policy_meta``)."""


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    cfg: LearnerConfig,
    sampling: SamplingConfig,
    ref_model: nn.Module | None = None,
    spec: SpecConfig | None = None,
    dist: DistContext | None = None,
) -> dict[str, float]:
    """One optimizer step of PPO-clip (ratio to the behaviour policy, dual-clipped) on GRPO
    advantages, plus the early-exit co-training loss when ``spec.aux_coef > 0``.

    ``model``: the policy (built-in or ``transformers``), or its FSDP-sharded ``PolicyModule``
    with ``dist``. The batch is the full step's batch on every rank; this rank trains its shard
    of rows, in micro-batches of ``cfg.max_tokens_per_microbatch`` tokens, with log-probs of the
    chosen tokens only at completion positions, ``cfg.logprob_chunk_tokens`` at a time
    (``learner/microbatch.py``). Every term is normalised by the completion tokens of the whole
    batch, so micro-batches and ranks give the one-batch update. A step whose loss (any
    micro-batch, any rank) or gradient norm is not finite is skipped: no optimizer step."""
    module = model if isinstance(model, PolicyModule) else PolicyModule(model)
    policy = module.policy
    module.train()
    set_activation_checkpointing(policy, cfg.activation_checkpointing)
    aux_coef = spec.aux_coef if spec is not None else 0.0
    exit_layer = spec.exit_layer if aux_coef > 0 else 0
    if exit_layer and not 1 <= exit_layer < num_layers(policy):
        raise ValueError(f"spec.exit_layer={exit_layer} must be in [1, {num_layers(policy) - 1}]")
    world, rank = (dist.world, dist.rank) if dist is not None else (1, 0)
    lengths = row_lengths(batch)
    budget = cfg.max_tokens_per_microbatch
    plans = [
        plan_microbatches(shard_rows(lengths, world, r), lengths, budget) for r in range(world)
    ]
    micro = [take_rows(batch, rows, lengths) for rows in plans[rank]]
    # FSDP runs collectives in every forward/backward: all ranks run as many micro-batches.
    micro += [empty_microbatch(batch)] * (max(len(p) for p in plans) - len(micro))
    n_valid = batch.mask.sum()  # completion tokens of the global batch (every rank has it all)
    autocast = torch.autocast(
        batch.input_ids.device.type,
        dtype=torch.bfloat16,
        enabled=cfg.precision == "bf16-mixed",
    )
    terms = _StepTerms(cfg, sampling, exit_layer, aux_coef, n_valid)
    optimizer.zero_grad(set_to_none=True)
    sums = torch.zeros(len(_SUM_KEYS), dtype=torch.float64)
    for mb in micro:
        ref_lp = None
        if ref_model is not None and cfg.kl_coef > 0:
            with torch.no_grad(), autocast:
                ref_lp = _chosen(ref_model, mb, terms)
        with autocast:
            loss, stats = module(terms.loss, mb, ref_lp)
        # FSDP averages gradients over ranks; each rank's loss is its share of the global sum.
        (loss * world).backward()
        sums += stats.double().cpu()
    if dist is not None:
        sums = dist.all_reduce_sum(sums.to(dist.device)).cpu()
    stats = dict(zip(_SUM_KEYS, sums.tolist(), strict=True))
    # Defence in depth behind admission: a step whose loss or gradients are not finite would
    # put NaN into every weight (and every actor). It is skipped and counted, never taken.
    skipped = not math.isfinite(stats["loss"])
    grad_norm = torch.full((), float("nan"))
    if not skipped:
        params = [p for p in module.parameters() if p.grad is not None]
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        skipped = not bool(torch.isfinite(grad_norm))
    if skipped:
        optimizer.zero_grad(set_to_none=True)
        log.error(
            "learner: skipped a step with a non-finite loss (%s) or gradient norm (%s)",
            stats["loss"],
            float(grad_norm),
        )
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        "learner/skipped": float(skipped),
        "learner/loss": stats["loss"],
        "learner/pg_loss": stats["pg_loss"],
        "learner/kl": stats["kl"],
        "learner/clip_frac": stats["clip_frac"],
        "learner/truncated_frac": stats["truncated_frac"],
        "learner/ratio_mean": stats["ratio_mean"],
        "learner/abs_log_ratio": stats["abs_log_ratio"],
        "learner/outside_nucleus_frac": 1.0 - stats["usable"] / max(float(n_valid), 1.0),
        "learner/grad_norm": float(grad_norm),
        "learner/microbatches": float(len(micro)),
        "spec/exit_kl": stats["exit_kl"],
    }


_SUM_KEYS = (
    "loss",
    "pg_loss",
    "kl",
    "clip_frac",
    "truncated_frac",
    "ratio_mean",
    "abs_log_ratio",
    "usable",
    "exit_kl",
)


def _chosen(policy: nn.Module, mb: MicroBatch, terms: _StepTerms) -> torch.Tensor:
    """Log-probs [N] of the completion tokens of a micro-batch under ``policy``."""
    h, _ = backbone(policy, mb.input_ids)
    sel = mb.mask > 0
    return chosen_logprobs(
        policy.lm_head,
        h[:, :-1][sel],
        mb.targets[sel],
        terms.sampling.temperature,
        terms.sampling.top_p,
        terms.cfg.logprob_chunk_tokens,
    )


@dataclass
class _StepTerms:
    """The loss of one micro-batch (run inside ``PolicyModule.forward``)."""

    cfg: LearnerConfig
    sampling: SamplingConfig
    exit_layer: int
    aux_coef: float
    n_valid: torch.Tensor

    def loss(
        self, policy: nn.Module, mb: MicroBatch, ref_lp: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, sampling = self.cfg, self.sampling
        h, h_exit = backbone(policy, mb.input_ids, self.exit_layer)
        sel = mb.mask > 0  # [b, s-1]: completion positions, the only ones the loss reads
        h_sel = h[:, :-1][sel]  # [N, H]
        logprobs = chosen_logprobs(
            policy.lm_head,
            h_sel,
            mb.targets[sel],
            sampling.temperature,
            sampling.top_p,
            cfg.logprob_chunk_tokens,
        )
        # With top-p < 1 a sampled token can fall outside the current (or reference) nucleus:
        # its log-prob is -inf and the ratio undefined. Such tokens contribute nothing (they
        # still count in the denominator, which must be known before any micro-batch's
        # backward) and are counted.
        usable = torch.isfinite(logprobs)
        if ref_lp is not None:
            usable &= torch.isfinite(ref_lp)
            ref_lp = ref_lp.masked_fill(~usable, 0.0)[:, None]
        logprobs = logprobs.masked_fill(~usable, 0.0)
        advantages = mb.advantages[:, None].expand_as(mb.mask)[sel]  # [N]
        out = ppo_clip_loss(
            logprobs=logprobs[:, None],
            behaviour_logprobs=mb.behaviour_logprobs[sel][:, None],
            advantages=advantages,
            mask=usable.float()[:, None],
            clip_eps=cfg.clip_eps,
            dual_clip=cfg.dual_clip,
            ref_logprobs=ref_lp,
            kl_coef=cfg.kl_coef,
            num_tokens=self.n_valid,
        )
        loss = out.loss
        exit_kl = torch.zeros((), device=h.device)
        if self.exit_layer:
            exit_sum = exit_kl_sum(
                policy.lm_head,
                h_sel,
                h_exit[:, :-1][sel],
                sampling.temperature,
                cfg.logprob_chunk_tokens,
            )
            exit_kl = exit_sum / self.n_valid.clamp(min=1.0)
            loss = loss + self.aux_coef * exit_kl
        if h_sel.shape[0] == 0:
            # No completion token here (a padding micro-batch): a zero that still reaches every
            # parameter, so FSDP reduces the same gradients on every rank.
            loss = loss + 0.0 * policy.lm_head(h[:, :1]).float().sum()
        stats = torch.stack(
            [
                loss.detach().float(),
                out.pg_loss.float(),
                out.kl.float(),
                out.clip_frac.float(),
                out.truncated_frac.float(),
                out.ratio_mean.float(),
                out.abs_log_ratio.float(),
                usable.sum().float(),
                exit_kl.detach().float(),
            ]
        )
        return loss, stats


def make_optimizer(model: nn.Module, cfg: LearnerConfig) -> torch.optim.Optimizer:
    """AdamW over the model's parameters; its state takes their dtype (fp32 master weights and
    moments unless ``learner.precision=bf16``)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def setup(
    cfg: SpecRLConfig,
    checkpoint_root: Path,
    device: torch.device,
    dist: DistContext | None = None,
) -> LearnerState:
    """Model, optimizer and counters: from the newest checkpoint, else from the model directory.
    With ``dist``, every rank loads the same full weights and then shards them (FSDP2)."""
    lcfg = cfg.learner
    dtype = param_dtype(lcfg.precision)
    ckpt = latest_checkpoint(checkpoint_root) if lcfg.resume else None
    opt_tensors, param_groups = {}, []
    if ckpt is not None:
        policy, opt_tensors, trainer, param_groups = load_checkpoint(
            ckpt, device, lcfg.model_impl, dtype
        )
        tokenizer = load_tokenizer(ckpt)
        step, version, dedupe = trainer.step, trainer.version, trainer.dedupe
        wal_from = trainer.wal_from
        log.info(
            "resumed from %s (step %d, version %d)",
            ckpt,
            step,
            version,
        )
    else:
        if dist is not None and not dist.is_main:
            dist.barrier()  # rank 0 builds the model directory first (a warm start, once)
        model_dir = ensure_model(cfg)
        if dist is not None and dist.is_main:
            dist.barrier()
        policy = load_policy(model_dir, lcfg.model_impl, device, dtype)
        tokenizer = load_tokenizer(model_dir)
        step, version, dedupe, wal_from = 0, -1, {}, 0
    args = model_args(policy)  # refuses a model whose versions actors could not load
    set_activation_checkpointing(policy, lcfg.activation_checkpointing)
    ref_model = None
    if lcfg.kl_coef > 0:
        # The reference is the policy the run started from (the checkpoint's, after a resume);
        # a full replica on every rank.
        ref_model = copy.deepcopy(policy).eval().requires_grad_(False)
    model: nn.Module = policy if dist is None else shard(policy)
    optimizer = make_optimizer(model, lcfg)
    if ckpt is not None:
        if dist is None:
            restore_optimizer(model, optimizer, opt_tensors, param_groups)
        else:
            load_optimizer_state(model, optimizer, opt_tensors, param_groups)
    pending = []
    if ckpt is not None and (dist is None or dist.is_main):
        pending = load_pending(ckpt, DecodeLimits(vocab_size=args.vocab_size))
        log.info("%d groups carried over from the checkpoint", len(pending))
    return LearnerState(
        model, tokenizer, optimizer, ref_model, step, version, dedupe, pending, wal_from, args
    )


class PolicyView:
    """What the Publisher reads of the policy (``args``, ``state_dict()``, ``parameters()``).

    One process: the live model's state dict. FSDP: the full state dict gathered on rank 0 by the
    last ``refresh`` (a collective every rank calls at the same point); the republisher re-sends
    it without a collective."""

    def __init__(self, model: nn.Module, args: ModelArgs, dist: DistContext | None) -> None:
        self.model = model
        self.args = args
        self.dist = dist
        self._full: dict[str, torch.Tensor] = {}

    def refresh(self) -> None:
        if self.dist is not None:
            self._full = full_model_state(self.model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._full if self.dist is not None else unwrap(self.model).state_dict()

    def parameters(self):
        if self.dist is None:
            return unwrap(self.model).parameters()
        return iter(self._full.values())


def gather_checkpoint(state: LearnerState, dist: DistContext | None) -> FullState | None:
    """The model and optimizer to checkpoint: a collective under FSDP (None on ranks > 0)."""
    if dist is None:
        return full_state(state.model, state.optimizer)
    weights = full_model_state(state.model)
    opt_tensors, groups = full_optimizer_state(state.model, state.optimizer)
    if not dist.is_main:
        return None
    policy = unwrap(state.model)
    dtype = next(iter(weights.values())).dtype
    return FullState(hf_config(policy, dtype), weights, opt_tensors, groups)


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


def make_admission(cfg: SpecRLConfig, args: ModelArgs) -> Admission:
    """What this run trains on: its group size, the model's context (or a smaller learner
    budget) and the reward bound."""
    context = args.max_position_embeddings
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
    # Under torchrun (WORLD_SIZE > 1): data-parallel FSDP2 ranks; rank 0 runs everything below,
    # the others follow its broadcasts (learner/distributed.py).
    dist = init_from_env(timeout_s=max(3600.0, 2 * cfg.learner.group_timeout_s))
    if dist is not None and not dist.is_main:
        try:
            return follow(cfg, dist)
        finally:
            shutdown()
    try:
        return _run(cfg, dist)
    finally:
        if dist is not None:
            shutdown()


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
    view = PolicyView(state.model, state.args, dist)
    view.refresh()  # rank 0's first publish
    last: dict[str, float] = {}
    while True:
        op, version, groups = dist.receive(limits)
        if op == "stop":
            gather_checkpoint(state, dist)  # rank 0's final checkpoint
            return last
        batch = collate(groups, version, state.tokenizer.pad_id, dist.device)
        last = train_on(state, batch, cfg, dist)
        state.step += 1
        if state.step % cfg.learner.publish_every == 0 and not last["learner/skipped"]:
            view.refresh()
        if state.step % cfg.learner.checkpoint_every == 0:
            gather_checkpoint(state, dist)


def train_on(
    state: LearnerState, batch: TrainBatch, cfg: SpecRLConfig, dist: DistContext | None
) -> dict[str, float]:
    """One optimizer step on ``batch``: the same call on rank 0 and on the other ranks."""
    return train_step(
        state.model,
        state.optimizer,
        batch,
        cfg.learner,
        cfg.sampling,
        state.ref_model,
        cfg.spec,
        dist,
    )


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
        self.stop = StopFlag("learner")

        self.state = state = setup(cfg, self.checkpoint_root, self.device, dist)
        admission = make_admission(cfg, state.args)
        limits, frame_bytes = wire_limits(
            state.args.vocab_size, admission, cfg.learner.max_frame_bytes
        )
        self.readmission = Readmission(limits, admission)
        self.wal_dir = run_dir / "wal"
        replayed = replay_wal(self.wal_dir, state, cfg, self.readmission)
        store = store_from_config(cfg.redis, cfg.run.name)
        # Versions only grow, across restarts too: continue after the newest of the checkpoint,
        # what Redis holds, and what this run ever published (a private Redis may have lost
        # everything).
        latest = retry_redis(
            "learner", "reading the latest version", store.latest_version, self.stop
        )
        state.version = (
            max(
                state.version,
                latest if latest is not None else -1,
                read_version_mark(self.version_mark),
            )
            + 1
        )
        # Groups an earlier learner acked, admitted again against this one's bounds and version.
        state.pending = self.readmission.admit(state.pending, state.version)
        replayed = self.readmission.admit(replayed, state.version)
        # Uploads run on a background thread while the next step trains (Redis outages are
        # retried there); the version mark is written once a version is in Redis.
        self.view = PolicyView(state.model, state.args, dist)
        self.view.refresh()  # a collective under FSDP: every rank gathers, rank 0 keeps it
        self.publisher = Publisher(
            store,
            self.view,
            state.tokenizer,
            dtype=publish_dtype(self.view, cfg.learner.publish_dtype),
            max_inflight=cfg.learner.publish_max_inflight,
            upload=cfg.learner.publish_upload,
            should_stop=self.stop,
            on_published=lambda version: write_version_mark(self.version_mark, version),
            optimizer=state.optimizer,  # the snapshot runs on the upload thread, before a step
        )
        self.publisher.publish(state.version)
        # Republishing re-sends the last gathered state: rank 0 alone, no collective.
        self.republisher = Republisher(
            store,
            lambda: self.publisher.publish(state.version),
            busy=lambda: self.publisher.inflight > 0,
        )
        log.info(
            "learner: published version %d; waiting for actors at %s",
            state.version,
            cfg.learner.resolved_bind(),
        )

        self.metrics = MetricsWriter(run_dir / "metrics.jsonl")
        self.exporter = LearnerExporter.start(cfg, run_dir)
        self.ledger = (
            MetricsWriter(run_dir / "ledger" / "learner.jsonl") if cfg.run.ledger else None
        )
        if self.ledger is not None:
            # Outcomes a killed learner logged after its last checkpoint are void: the model
            # lost those steps and the groups come back from the write-ahead log.
            self.ledger.write({"event": "start", "resumed_step": state.step})
        record_refused(self.ledger, self.readmission.refused, state)
        self.buffer = StalenessBuffer(cfg.learner.max_staleness, cfg.actor.group_size, self.ledger)
        self.buffer.carry([*state.pending, *replayed])
        curve = None
        authorized = None
        if cfg.security.curve_dir:
            curve = learner_keys(Path(cfg.security.curve_dir))
            authorized = Path(
                cfg.security.authorized_keys or authorized_dir(Path(cfg.security.curve_dir))
            )
        self.receiver = GroupReceiver(
            cfg.learner.resolved_bind(),
            limits,
            queue_max=cfg.learner.queue_max,
            curve=curve,
            authorized_keys=authorized,
            wal=WalWriter(self.wal_dir, fsync=cfg.learner.wal_fsync) if cfg.learner.wal else None,
            hwm=max(2, min(DEFAULT_HWM, cfg.learner.recv_buffer_bytes // frame_bytes)),
            admission=admission,
            latest_version=lambda: state.version,
        )
        self.exporter.watch(
            lambda: {**self.receiver.stats(), "learner/wal_skipped": self.readmission.skipped}
        )
        self.skipped_steps = 0
        self.trainer = TrainerState(step=state.step, version=state.version)
        self.last: dict[str, float] = {}
        self.receiver.load_dedupe_state(state.dedupe)
        self.receiver.mark_seen(replayed)
        self.receiver.start()
        self.wall_start = time.perf_counter()

    def collect(self) -> list[TrajectoryGroup]:
        """Phase 1: fresh groups for the next step (stale ones are dropped and counted); fewer
        than a step's worth when a stop came first."""
        state, learner_cfg = self.state, self.cfg.learner
        self.buffer.step = state.step + 1
        self.republisher.check(state.version)
        return self.buffer.collect(
            self.receiver.get,
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
        batch = collate(groups, state.version, state.tokenizer.pad_id, self.device)
        step_metrics = train_on(state, batch, self.cfg, self.dist)
        skipped = step_metrics["learner/skipped"] > 0
        self.skipped_steps += skipped
        for group in groups:
            self.buffer.record(group, "skipped" if skipped else "trained", state.version)
        record_refused(self.ledger, self.receiver.take_refused(), state)
        state.step += 1
        return batch, step_metrics

    def publish(self, skipped: bool) -> None:
        """Phase 3: publish the new policy (every ``publish_every`` steps, not after a skip)."""
        if self.state.step % self.cfg.learner.publish_every == 0 and not skipped:
            self.state.version += 1
            self.view.refresh()
            self.publisher.publish(self.state.version)

    def log(
        self,
        batch: TrainBatch,
        groups: list[TrajectoryGroup],
        step_metrics: dict[str, float],
        times: StepTimes,
    ) -> None:
        """Phase 4: the step's figures to metrics.jsonl and Prometheus."""
        state, receiver = self.state, self.receiver
        self.last = {
            "learner/step": state.step,
            "learner/version": state.version,
            **step_metrics,
            **_batch_metrics(batch, groups),
            **_actor_metrics(receiver),
            **receiver.stats(),
            "learner/dropped_stale": self.buffer.dropped_stale,
            "learner/republished": self.republisher.republished,
            "learner/rejected_groups": self.buffer.rejected,
            "learner/skipped_steps": self.skipped_steps,
            "learner/wal_skipped": self.readmission.skipped,
            "learner/wait_s": times.collected - times.started,
            "learner/train_s": times.trained - times.collected,
            "learner/publish_s": times.published - times.trained,
            "learner/publish_upload_s": self.publisher.last_publish_s,
            "learner/publish_refused": self.publisher.refused,
            "learner/wall_s": times.published - self.wall_start,
        }
        self.exporter.update(self.last, batch.staleness)
        if state.step % self.cfg.learner.metrics_every == 0 or state.step == self.cfg.run.steps:
            self.metrics.write(self.last)

    def checkpoint(self, pending: list[TrajectoryGroup]) -> None:
        """Phase 5 (every ``checkpoint_every`` steps, and at exit): model, optimizer and every
        acked group not yet trained."""
        state, trainer = self.state, self.trainer
        trainer.step, trainer.version = state.step, state.version
        # One cut: every acked group is in the checkpoint's pending list, already trained, or
        # in a log segment from wal_from on.
        trainer.dedupe, queued, wal_from = self.receiver.checkpoint_cut()
        trainer.wal_from = wal_from if wal_from is not None else 0
        trainer.metrics = {k: v for k, v in self.last.items() if isinstance(v, int | float)}
        path = save_checkpoint(
            self.checkpoint_root,
            gather_checkpoint(state, self.dist),
            state.tokenizer,
            None,
            trainer,
            pending=[*self.buffer.pending(), *queued, *pending],
        )
        if wal_from is not None:
            trim(self.wal_dir, wal_from)
        if self.ledger is not None:
            self.ledger.write({"event": "checkpoint", "step": state.step})
        log.info("learner: checkpoint %s", path)

    def close(self, unfinished: list[TrajectoryGroup]) -> None:
        """Stop receiving, let the last version reach Redis, and checkpoint what is left."""
        state, receiver = self.state, self.receiver
        receiver.close()
        self.exporter.close()
        self.publisher.close()  # the last version reaches Redis before the final checkpoint
        # Acked but not trained on: carried in the checkpoint so a resumed learner trains them
        # (acked means the actor has forgotten them; this is the only copy).
        leftover = [*unfinished, *receiver.drain()]
        for group in [*self.buffer.pending(), *leftover]:
            self.buffer.record(group, "pending_at_exit", state.version)
        record_refused(self.ledger, receiver.take_refused(), state)
        if self.dist is not None:
            self.dist.send_stop()  # the other ranks join the final checkpoint's gather
        self.checkpoint(leftover)
        self.metrics.write(
            {
                "event": "learner_exit",
                "learner/step": state.step,
                "learner/version": state.version,
                **receiver.stats(),
            }
        )
        self.metrics.close()
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
            learner.publish(skipped=step_metrics["learner/skipped"] > 0)
            times.published = time.perf_counter()
            learner.log(batch, groups, step_metrics, times)
            if state.step % cfg.learner.checkpoint_every == 0:
                learner.checkpoint([])
    finally:
        learner.close(unfinished)
    return learner.last


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
        # The live actors' last weights fetch, averaged (0 before the first).
        "actor/weight_fetch_s": total("actor/weight_fetch_s") / max(len(live), 1),
    }
