"""The learner's parts built from the config: its trained state (from the newest checkpoint or
the model directory), what it admits, and the receiver actors deliver to."""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from common.config import SpecRLConfig
from common.config.actor import SpecConfig
from common.config.learner import LearnerConfig
from common.curve_keys import authorized_dir, learner_keys
from common.eagle import attach_eagle
from common.link.protocol import DecodeLimits, TrajectoryGroup
from common.link.receive.admission import Admission
from common.link.receive.receiver import GroupReceiver
from common.link.receive.wal import WalWriter
from common.link.transport import DEFAULT_HWM
from common.model import attach_draft
from common.model_args import Layout
from common.process_start import prepare
from common.tokenizer import Tokenizer, load_tokenizer
from learner.batch import RewardShaping, TrainBatch, has_signal
from learner.checkpoint import (
    FullState,
    full_state,
    latest_checkpoint,
    load_checkpoint,
    load_pending,
    load_sharded_model,
    load_sharded_optimizer,
    read_trainer_state,
    restore_optimizer,
)
from learner.distributed import (
    DistContext,
    empty_policy,
    full_model_state,
    full_optimizer_state,
    materialize,
    shard,
)
from learner.optim import make_optimizer, warm_up_lr
from learner.policy import (
    hf_config,
    is_builtin,
    load_policy,
    model_args,
    param_dtype,
    set_activation_checkpointing,
    unwrap,
)
from learner.prepare.fit_check import memory_facts
from learner.prepare.warm_start import ensure_model
from learner.step import Trainer

log = logging.getLogger(__name__)


@dataclass
class LearnerState:
    trainer: Trainer
    """The policy (``trainer.model``: the built-in ``Transformer`` or a ``transformers`` model,
    or its FSDP-sharded ``PolicyModule`` on N ranks), its optimizer, reference and loss plan."""
    tokenizer: Tokenizer
    step: int
    version: int
    dedupe: dict
    """Receiver dedupe state restored from the checkpoint (empty on a fresh start)."""
    pending: list[TrajectoryGroup]
    """Groups acked before the restart but never trained on (from the checkpoint)."""
    wal_from: int = 0
    """First write-ahead-log segment the checkpoint does not cover (0: none, or a fresh run)."""
    args: Layout | None = None
    """The architecture actors build from published versions (``common.policy_meta``)."""
    max_new_tokens: int = 0
    """The task's generation budget, where an algorithm option needs it (``learner.overlong``
    ``penalty``, ``loss_agg=seq_sum`` without ``loss_agg_tokens``); else 0."""
    shaping: RewardShaping = RewardShaping()
    """The reward-side algorithm options every rank collates with."""


def setup(
    cfg: SpecRLConfig,
    checkpoint_root: Path,
    device: torch.device,
    dist: DistContext | None = None,
) -> LearnerState:
    """Model, optimizer and counters: from the newest checkpoint, else from the model directory.
    With ``dist`` the model is sharded (FSDP2): a fresh start loads the full weights on every
    rank and shards them; a resume has each rank read only its shards of the checkpoint."""
    lcfg = cfg.learner
    ckpt = latest_checkpoint(checkpoint_root) if lcfg.resume else None
    start_dir = None  # the model the run started from: trained from, or the KL reference
    if ckpt is None or lcfg.kl_coef > 0:
        if dist is not None and not dist.is_main:
            dist.barrier()  # rank 0 builds the model directory first (a warm start, once)
        start_dir = ensure_model(cfg)
        if dist is not None and dist.is_main:
            dist.barrier()
    model_dir = ckpt if ckpt is not None else start_dir
    assert model_dir is not None
    # The resolve step, once, now that the memory is known: the GPU profile, the precision
    # fallback and the memory settings that fit the device (learner.profile), or a refusal;
    # before any model is built.
    prepare(cfg, None, "learner", memory_facts(cfg, model_dir, device, dist))
    dtype = param_dtype(lcfg.precision)
    opt_tensors, param_groups = {}, []
    if ckpt is not None and dist is None:
        policy, opt_tensors, trainer, param_groups = load_checkpoint(
            ckpt, device, lcfg.model_impl, dtype
        )
    elif ckpt is not None:
        # Parameters on the meta device; each rank reads its shards once sharded (below).
        policy = empty_policy(ckpt, lcfg.model_impl, dtype)
        trainer, param_groups = read_trainer_state(ckpt)
    if ckpt is not None:
        tokenizer = load_tokenizer(ckpt)
        step, version, dedupe = trainer.step, trainer.version, trainer.dedupe
        wal_from = trainer.wal_from
        log.info("resumed from %s (step %d, version %d)", ckpt, step, version)
    else:
        policy = load_policy(model_dir, lcfg.model_impl, device, dtype)
        tokenizer = load_tokenizer(model_dir)
        step, version, dedupe, wal_from = 0, -1, {}, 0
    attach_adapter(policy, cfg.spec, dist)
    attach_eagle_head(policy, cfg.spec, dist)
    restore_sharpening(policy, [model_dir, Path(cfg.model.path)] if cfg.model.path else [model_dir])
    args = model_args(policy)  # refuses a model whose versions actors could not load
    set_activation_checkpointing(policy, lcfg.activation_checkpointing)
    ref_model = reference_model(lcfg, policy, start_dir if ckpt is not None else None, device)
    model: nn.Module = policy if dist is None else shard(policy, lcfg.precision)
    if ckpt is not None and dist is not None:
        materialize(model, device)
        load_sharded_model(model, ckpt)
    optimizer = make_optimizer(model, lcfg, cfg.spec)
    if ckpt is not None:
        if dist is None:
            restore_optimizer(model, optimizer, opt_tensors, param_groups)
        else:
            load_sharded_optimizer(model, optimizer, ckpt, param_groups)
    pending = []
    if ckpt is not None and (dist is None or dist.is_main):
        pending = load_pending(ckpt, DecodeLimits(vocab_size=args.vocab_size))
        log.info("%d groups carried over from the checkpoint", len(pending))
    max_new_tokens = algorithm_max_new_tokens(cfg)
    trainer = Trainer(
        model, optimizer, lcfg, cfg.sampling, ref_model, cfg.spec, dist, max_new_tokens
    )
    state = LearnerState(trainer, tokenizer, step, version, dedupe, pending, wal_from, args)
    state.max_new_tokens = max_new_tokens
    state.shaping = RewardShaping.from_config(lcfg, state.max_new_tokens)
    return state


def reference_model(
    lcfg: LearnerConfig, policy: nn.Module, start_dir: Path | None, device: torch.device
) -> nn.Module | None:
    """The KL reference (``learner.kl_coef > 0``, else None): the policy the run started from,
    a full replica on every rank. On a fresh start (``start_dir`` None) a copy of ``policy``;
    after a resume it is read again from ``start_dir`` (the checkpoint's policy has moved on,
    and a sharded checkpoint holds no whole one) and checked against the checkpoint's."""
    if lcfg.kl_coef <= 0:
        return None
    if start_dir is None:
        ref_model = copy.deepcopy(policy)
    else:
        ref_model = load_policy(start_dir, lcfg.model_impl, device, param_dtype(lcfg.precision))
        check_reference(ref_model, policy, start_dir)
    return ref_model.eval().requires_grad_(False)


def check_reference(ref_model: nn.Module, policy: nn.Module, start_dir: Path) -> None:
    """Refuse a KL reference (the run's starting model, read again on a resume) whose
    parameters are not the resumed policy's, by name and shape: the model directory was changed
    or replaced since the run began. (The policy may hold more: a draft head attached since.)"""
    shapes = {name: tuple(p.shape) for name, p in policy.named_parameters()}
    wrong = [name for name, p in ref_model.named_parameters() if shapes.get(name) != tuple(p.shape)]
    if wrong:
        raise ValueError(
            f"learner.kl_coef > 0: the KL reference is the model the run started from, "
            f"{start_dir}, but {len(wrong)} of its parameters (e.g. {wrong[0]}) are not the "
            "checkpoint's: resume with the model the run started from"
        )


def algorithm_max_new_tokens(cfg: SpecRLConfig) -> int:
    """The task's ``max_new_tokens`` where an algorithm option needs it, else 0 (the task is
    built only then: a data-set task reads its file)."""
    lcfg = cfg.learner
    if lcfg.overlong != "penalty" and (lcfg.loss_agg != "seq_sum" or lcfg.loss_agg_tokens):
        return 0
    from common.tasks import task_from_config

    return int(task_from_config(cfg.task).max_new_tokens)


def signal_filter(
    cfg: SpecRLConfig, state: LearnerState
) -> Callable[[TrajectoryGroup], bool] | None:
    """Dynamic sampling's test of a group (``learner.dynamic_sampling``), else None."""
    if not cfg.learner.dynamic_sampling:
        return None
    return lambda group: has_signal(group, state.shaping)


def attach_adapter(policy: nn.Module, spec: SpecConfig, dist: DistContext | None) -> None:
    """``spec.adapter``: give a policy without a draft adapter an untrained one (a warm-started
    one comes with the model directory, ``specrl warm-draft``)."""
    if not spec.adapter:
        return  # an adapter the model has rides along in every version, untrained
    has = getattr(policy, "draft", None) is not None
    if not is_builtin(policy):
        raise ValueError(
            "spec.adapter needs the built-in model (learner.model_impl=builtin): the draft "
            "adapter is part of common.model.Transformer"
        )
    if dist is not None:
        raise ValueError("spec.adapter is not supported with learner.ranks > 1 yet (FSDP2)")
    if not has:
        attach_draft(policy, spec.exit_layer)
        log.info(
            "spec.adapter: attached an untrained draft adapter after layer %d (whole "
            "vocabulary; `specrl warm-draft` warm-starts one over a reduced vocabulary)",
            spec.exit_layer,
        )


def attach_eagle_head(policy: nn.Module, spec: SpecConfig, dist: DistContext | None) -> None:
    """``spec.method=eagle3``: give a policy without an EAGLE-3 head an untrained one (vLLM's
    inputs, the whole vocabulary; a warm-started one comes with the model directory, ``specrl
    warm-draft spec.method=eagle3``); a head the policy has is kept. Its tensors (``eagle.*``)
    are then in the policy's state dict, so every published version carries them, and its
    ``eagle_aux_layers`` and ``eagle_vocab_size`` in the version's config. With learner ranks
    (FSDP2) the head is part of the root unit: sharded with the embedding and the LM head,
    gathered for the loss, its gradients reduce-scattered like theirs."""
    if not spec.uses_eagle:
        return  # a head the model has rides along in every version, untrained
    if not is_builtin(policy):
        raise ValueError(
            "spec.method=eagle3 needs the built-in model (learner.model_impl=builtin): the "
            "EAGLE-3 head is part of common.model.Transformer"
        )
    if policy.eagle is None:
        attach_eagle(policy)
        log.warning(
            "spec.method=eagle3: attached an UNTRAINED EAGLE-3 head (inputs after layers %s, "
            "whole vocabulary): its drafts are rarely accepted until the learner has trained "
            "it; `specrl warm-draft spec=eagle3` warm-starts one from the model's own "
            "samples, over a reduced vocabulary",
            list(policy.args.eagle_aux_layers),
        )


def restore_sharpening(policy: nn.Module, dirs: list[Path]) -> None:
    """The draft sharpening s of a warm-started head (``EagleHead.sharpening``): its LM head
    holds the trained rows over s, so the learner trains on its logits times s. Read from the
    first of ``dirs`` whose ``config.json`` records it (a checkpoint's config does not: then the
    model directory's, where the warm start wrote it); 1 when none does."""
    import json

    from learner.prepare.eagle_warmup import SHARPENING_KEY

    head = getattr(policy, "eagle", None)
    if head is None:
        return
    for directory in dirs:
        config = directory / "config.json"
        if config.is_file():
            value = json.loads(config.read_text()).get(SHARPENING_KEY)
            if value is not None:
                head.sharpening = float(value)
                log.info("EAGLE-3 head: draft sharpening %.3g (from %s)", head.sharpening, config)
                return


def gather_checkpoint(state: LearnerState, dist: DistContext | None) -> FullState | None:
    """The model and optimizer to checkpoint: a collective under FSDP (None on ranks > 0)."""
    if dist is None:
        return full_state(state.trainer.model, state.trainer.optimizer)
    weights = full_model_state(state.trainer.model)
    opt_tensors, groups = full_optimizer_state(state.trainer.model, state.trainer.optimizer)
    if not dist.is_main:
        return None
    policy = unwrap(state.trainer.model)
    dtype = next(iter(weights.values())).dtype
    return FullState(hf_config(policy, dtype), weights, opt_tensors, groups)


def train_on(state: LearnerState, batch: TrainBatch, cfg: SpecRLConfig) -> dict[str, float]:
    """One optimizer step on ``batch`` at the run's learning rate for ``state.step``: the same
    call on rank 0 and on the other ranks."""
    warm_up_lr(state.trainer.optimizer, cfg.learner, state.step, cfg.run.steps)
    return state.trainer.step(batch)


def make_admission(cfg: SpecRLConfig, args: Layout) -> Admission:
    """What this run trains on: its group size, the model's context (or a smaller learner
    budget) and the reward bound."""
    context = args.max_position_embeddings
    budget = cfg.learner.max_seq_tokens
    return Admission(
        group_size=cfg.actor.group_size,
        max_seq_tokens=min(context, budget) if budget > 0 else context,
        max_abs_reward=cfg.learner.max_abs_reward,
    )


def build_receiver(
    cfg: SpecRLConfig,
    limits: DecodeLimits,
    admission: Admission,
    wal_dir: Path,
    latest_version: Callable[[], int],
) -> GroupReceiver:
    """The receiver on ``learner.bind``: CURVE and its allow-list when ``security.curve_dir`` is
    set, the write-ahead log when ``common.link.receive.wal`` is, and a receive high-water mark of
    ``learner.recv_buffer_bytes`` over the decode bound (what a valid frame can be), 64 at most.

    Not over the socket's own frame bound: libzmq 4.3.5 aborts the whole process
    (``Assertion failed: !_io_error``, src/stream_engine_base.cpp:310) when a connection whose
    input the high-water mark has paused then fails, as an actor killed while the learner is
    paused does; with a mark of 2 frames that ended the fault tests' learners. A mark above an
    actor's window of unacked groups keeps honest actors from ever reaching it. The price: a
    peer able to connect may have up to this many frames of ``learner.max_frame_bytes`` queued
    (``security.curve_dir`` decides who can)."""
    curve = authorized = None
    if cfg.security.curve_dir:
        curve = learner_keys(Path(cfg.security.curve_dir))
        authorized = Path(
            cfg.security.authorized_keys or authorized_dir(Path(cfg.security.curve_dir))
        )
    return GroupReceiver(
        cfg.learner.resolved_bind(),
        limits,
        queue_max=cfg.learner.queue_max,
        curve=curve,
        authorized_keys=authorized,
        wal=WalWriter(wal_dir, fsync=cfg.learner.wal_fsync) if cfg.learner.wal else None,
        hwm=max(2, min(DEFAULT_HWM, cfg.learner.recv_buffer_bytes // limits.max_frame_bytes)),
        admission=admission,
        latest_version=latest_version,
    )
