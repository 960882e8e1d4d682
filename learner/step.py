"""The learner's step math: one batch of groups → a PPO-clip loss on GRPO advantages → one
optimizer step (or a skipped one when the loss or the gradients are not finite)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from common import heap
from common import metric_names as mn
from common.config.actor import SpecConfig
from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from learner.batch import TrainBatch
from learner.distributed import DistContext
from learner.draft_loss import adapter_terms, draft_states
from learner.eagle_loss import eagle_terms
from learner.loss import LossOptions, Sequences, ppo_clip_loss
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
from learner.optim import draft_params, eagle_group, eagle_params
from learner.policy import PolicyModule, backbone, set_activation_checkpointing

log = logging.getLogger(__name__)

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
    "draft_acceptance",
    "eagle_kl",
    "draft_positions",
)
"""The per-micro-batch figures summed over micro-batches and ranks (``_StepTerms.loss``); with
the EAGLE-3 head, then each draft step's acceptance sum and its positions (``_eagle_keys``)."""


def _eagle_keys(steps: int) -> tuple[str, ...]:
    """The per-draft-step figures after ``_SUM_KEYS``: acceptance sums, then positions."""
    return tuple(f"eagle_accept_{j}" for j in range(1, steps + 1)) + tuple(
        f"eagle_positions_{j}" for j in range(1, steps + 1)
    )


def draft_acceptance_key(step: int) -> str:
    """The metric of the head's acceptance at draft step ``step``, measured on each batch before
    the update (teacher-forced: steps < ``step`` fed the head's own outputs)."""
    return f"{mn.SPEC_DRAFT_ACCEPTANCE}_step{step}"


def loss_options(cfg: LearnerConfig, agg_tokens: int = 0) -> LossOptions:
    """The policy loss's algorithm options from the config (``agg_tokens``: the task's
    ``max_new_tokens``, used when ``learner.loss_agg_tokens`` is 0)."""
    return LossOptions(
        clip_high=cfg.clip_high,
        ratio_level=cfg.ratio_level,
        aggregation=cfg.loss_agg,
        agg_tokens=float(cfg.loss_agg_tokens or agg_tokens or 1),
        tis_cap=cfg.tis_cap,
    )


@dataclass(frozen=True)
class LossPlan:
    """What a step's loss is made of, resolved once per trainer from the config and the
    policy: the early exit's or the adapter's draft loss (``spec.aux_coef > 0``), the EAGLE-3
    head's (``spec.method=eagle3``, ``spec.eagle_coef > 0``), the algorithm's options and the
    figures each micro-batch sums."""

    cfg: LearnerConfig
    sampling: SamplingConfig
    exit_layer: int = 0
    aux_coef: float = 0.0
    adapter: bool = False
    eagle_coef: float = 0.0
    """Weight of the EAGLE-3 head's loss (0: not trained)."""
    eagle_steps: int = 1
    """Draft steps the EAGLE-3 head is trained on (``spec.eagle_train_steps``)."""
    eagle_decay: float = 1.0
    """Step j's weight in the head's loss: ``eagle_decay ** (j - 1)`` (``spec.eagle_step_decay``)."""
    options: LossOptions | None = None
    """The algorithm options of the policy loss (None: GRPO's)."""
    keys: tuple[str, ...] = _SUM_KEYS
    """The figures each micro-batch's loss returns, in order (``_SUM_KEYS``, then the head's)."""

    @classmethod
    def resolve(
        cls,
        module: PolicyModule,
        cfg: LearnerConfig,
        sampling: SamplingConfig,
        spec: SpecConfig | None,
        agg_tokens: int,
    ) -> LossPlan:
        # The draft's loss only with spec.aux_coef > 0 (backbone checks exit_layer): the
        # adapter's when the policy has one, else the early exit's co-training loss.
        aux_coef = spec.aux_coef if spec is not None else 0.0
        adapter = aux_coef > 0 and spec is not None and spec.adapter and bool(draft_params(module))
        exit_layer = spec.exit_layer if spec is not None and aux_coef > 0 else 0
        if adapter:
            exit_layer = module.policy.args.draft_exit_layer
        eagle_coef, eagle_steps, eagle_decay = _eagle_terms(module, spec)
        keys = _SUM_KEYS + (_eagle_keys(eagle_steps) if eagle_coef > 0 else ())
        return cls(
            cfg,
            sampling,
            exit_layer,
            aux_coef,
            adapter,
            eagle_coef,
            eagle_steps,
            eagle_decay,
            loss_options(cfg, agg_tokens),
            keys,
        )


class Trainer:
    """The learner's optimizer steps on one policy: its module (FSDP-sharded or not), optimizer,
    reference model and :class:`LossPlan`, set up once; :meth:`step` per batch.

    One optimizer step of PPO-clip (ratio to the behaviour policy, dual-clipped) on GRPO
    advantages, plus the early-exit co-training loss when ``spec.aux_coef > 0`` and the EAGLE-3
    head's loss with ``spec.method=eagle3`` and ``spec.eagle_coef > 0`` (learner/eagle_loss.py).

    ``model``: the policy, or its FSDP-sharded ``PolicyModule`` with ``dist``. The batch is the
    full step's batch on every rank; this rank trains its shard of rows in micro-batches, with
    the one-batch update (``learner/microbatch.py``). A step whose loss (any micro-batch, any
    rank) or gradient norm is not finite is skipped: no optimizer step. ``agg_tokens``: the
    constant length of ``learner.loss_agg=seq_sum`` when ``learner.loss_agg_tokens`` is 0 (the
    task's ``max_new_tokens``)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: LearnerConfig,
        sampling: SamplingConfig,
        ref_model: nn.Module | None = None,
        spec: SpecConfig | None = None,
        dist: DistContext | None = None,
        agg_tokens: int = 0,
    ) -> None:
        self.model = model
        self.module = model if isinstance(model, PolicyModule) else PolicyModule(model)
        self.optimizer = optimizer
        self.ref_model = ref_model
        self.spec = spec
        self.dist = dist
        self.plan = LossPlan.resolve(self.module, cfg, sampling, spec, agg_tokens)
        set_activation_checkpointing(self.module.policy, cfg.activation_checkpointing)

    def step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on ``batch`` (the same call on every rank): the step's figures."""
        module, optimizer, plan, dist = self.module, self.optimizer, self.plan, self.dist
        cfg = plan.cfg
        module.train()
        world = dist.world if dist is not None else 1
        # Trained (sampled) tokens of the global batch (all on every rank), and its sequences.
        n_valid = batch.mask.sum()
        n_seqs = (batch.mask.sum(dim=-1) > 0).sum().float()
        terms = _StepTerms(plan, n_valid, n_seqs)
        micro = _rank_microbatches(batch, cfg.max_tokens_per_microbatch, dist)
        autocast = torch.autocast(
            batch.input_ids.device.type,
            dtype=torch.bfloat16,
            enabled=cfg.precision == "bf16-mixed",
        )
        _zero_grads(module, optimizer)
        sums = torch.zeros(len(plan.keys), dtype=torch.float64)
        for mb in micro:
            # Freed pages of the last micro-batch back to the OS first (a few ms): what glibc
            # keeps of them would otherwise sit under this one's peak. One process only: under
            # FSDP a rank trimming beside gloo's threads aborted at exit in 1 of 4 runs of a
            # 2-rank test.
            if dist is None:
                heap.trim()
            ref_lp = None
            if self.ref_model is not None and cfg.kl_coef > 0:
                with torch.no_grad(), autocast:
                    ref_lp = _chosen(self.ref_model, mb, terms)
            with autocast:
                loss, stats = module(terms.loss, mb, ref_lp)
            # FSDP averages gradients over ranks; each rank's loss is its share of the global sum.
            (loss * world).backward()
            sums += stats.double().cpu()
        if dist is not None:
            sums = dist.all_reduce_sum(sums.to(dist.device)).cpu()
        stats = dict(zip(plan.keys, sums.tolist(), strict=True))
        skipped, grad_norm = _apply_gradients(
            module, optimizer, stats["loss"], cfg.grad_clip, self.spec
        )
        figures = _metrics(
            stats, float(n_valid), len(micro), skipped, grad_norm, plan.adapter, plan.eagle_coef
        )
        if plan.eagle_coef > 0:
            figures |= _eagle_metrics(stats, plan.eagle_steps, optimizer)
        return figures


def _eagle_terms(module: PolicyModule, spec: SpecConfig | None) -> tuple[float, int, float]:
    """(weight of the EAGLE-3 head's loss, 0 when it is not trained; its draft steps; their
    weights' decay)."""
    if spec is None or not spec.uses_eagle or not eagle_params(module):
        return 0.0, 1, 1.0
    return spec.eagle_coef, spec.eagle_train_steps, spec.eagle_step_decay


def _metrics(
    stats: dict[str, float],
    n_valid: float,
    micro: int,
    skipped: bool,
    grad_norm: float,
    adapter: bool,
    eagle: float,
) -> dict[str, float]:
    """The step's figures from the summed ``stats`` (``_SUM_KEYS``)."""
    figures = {
        mn.LEARNER_SKIPPED: float(skipped),
        mn.LEARNER_LOSS: stats["loss"],
        mn.LEARNER_PG_LOSS: stats["pg_loss"],
        mn.LEARNER_KL: stats["kl"],
        mn.LEARNER_CLIP_FRAC: stats["clip_frac"],
        mn.LEARNER_TRUNCATED_FRAC: stats["truncated_frac"],
        mn.LEARNER_RATIO_MEAN: stats["ratio_mean"],
        mn.LEARNER_ABS_LOG_RATIO: stats["abs_log_ratio"],
        mn.LEARNER_OUTSIDE_NUCLEUS_FRAC: 1.0 - stats["usable"] / max(n_valid, 1.0),
        mn.LEARNER_GRAD_NORM: grad_norm,
        mn.LEARNER_MICROBATCHES: float(micro),
        mn.SPEC_EXIT_KL: stats["exit_kl"],
    }
    if adapter:
        figures[mn.SPEC_DRAFT_ACCEPTANCE] = stats["draft_acceptance"] / max(n_valid, 1.0)
    if eagle > 0:
        positions = max(stats["draft_positions"], 1.0)
        figures[mn.SPEC_DRAFT_ACCEPTANCE] = stats["draft_acceptance"] / positions
        figures[mn.SPEC_EAGLE_KL] = stats["eagle_kl"]
    return figures


def _eagle_metrics(
    stats: dict[str, float], steps: int, optimizer: torch.optim.Optimizer
) -> dict[str, float]:
    """The head's acceptance at each draft step on this batch, before its update, the chain
    estimate they give, and its rate."""
    group = eagle_group(optimizer)
    figures, chain, reach = {}, 1.0, 1.0
    for j in range(1, steps + 1):
        rate = stats[f"eagle_accept_{j}"] / max(stats[f"eagle_positions_{j}"], 1.0)
        figures[draft_acceptance_key(j)] = rate
        reach *= rate
        chain += reach
    figures[mn.SPEC_DRAFT_CHAIN_ESTIMATE] = chain
    if group is not None:
        figures[mn.SPEC_EAGLE_LR] = float(group["lr"])
    return figures


def _rank_microbatches(
    batch: TrainBatch, budget: int, dist: DistContext | None
) -> list[MicroBatch]:
    """This rank's shard of the batch's rows in micro-batches of at most ``budget`` tokens,
    padded with empty micro-batches to the count of the rank with the most: FSDP runs
    collectives in every forward/backward, so all ranks run as many micro-batches."""
    world, rank = (dist.world, dist.rank) if dist is not None else (1, 0)
    lengths = row_lengths(batch)
    plans = [
        plan_microbatches(shard_rows(lengths, world, r), lengths, budget) for r in range(world)
    ]
    micro = [take_rows(batch, rows, lengths) for rows in plans[rank]]
    return micro + [empty_microbatch(batch)] * (max(len(p) for p in plans) - len(micro))


def _zero_grads(module: PolicyModule, optimizer: torch.optim.Optimizer) -> None:
    """Every gradient to None but the EAGLE-3 head's while it accumulates over learner steps
    (``spec.eagle_accumulate``)."""
    group = eagle_group(optimizer)
    keep = {id(p) for p in eagle_params(module)} if group and group["eagle_pending"] else set()
    for p in module.parameters():
        if id(p) not in keep:
            p.grad = None


def _apply_gradients(
    module: PolicyModule,
    optimizer: torch.optim.Optimizer,
    loss: float,
    grad_clip: float,
    spec: SpecConfig | None = None,
) -> tuple[bool, float]:
    """Clip the accumulated gradients and take the optimizer step, unless the loss or the
    gradient norm is not finite; ``(skipped, gradient norm)``. The EAGLE-3 head's group steps
    once its gradients of ``spec.eagle_accumulate`` learner steps are in (their mean, clipped on
    its own), at a rate warmed up over ``spec.eagle_lr_warmup_steps`` of its updates; until then
    its gradients are kept, out of this step.

    Defence in depth behind admission: a step whose loss or gradients are not finite would put
    NaN into every weight (and every actor). It is skipped and counted, never taken (and the
    head's accumulated gradients dropped)."""
    skipped = not math.isfinite(loss)
    grad_norm = torch.full((), float("nan"))
    head = [p for p in eagle_params(module) if p.grad is not None]
    group = eagle_group(optimizer) if head else None
    if not skipped:
        # The policy, its draft adapter and its EAGLE-3 head are clipped apart: a draft's
        # gradient must not scale the policy's update.
        drafts = {id(p) for p in draft_params(module) + eagle_params(module)}
        params = [p for p in module.parameters() if p.grad is not None and id(p) not in drafts]
        max_norm = grad_clip if grad_clip > 0 else float("inf")
        grad_norm = _full(torch.nn.utils.clip_grad_norm_(params, max_norm))
        finite = bool(torch.isfinite(grad_norm))
        draft = [p for p in draft_params(module) if p.grad is not None]
        if draft:
            finite &= bool(torch.isfinite(_full(torch.nn.utils.clip_grad_norm_(draft, max_norm))))
        head_due = _head_due(group, spec)
        if head and head_due:
            for p in head:
                p.grad.div_(group["eagle_pending"] + 1)  # the mean over the steps it holds
            finite &= bool(torch.isfinite(_full(torch.nn.utils.clip_grad_norm_(head, max_norm))))
        skipped = not finite
    if skipped:
        log.error(
            "learner: skipped a step with a non-finite loss (%s) or gradient norm (%s)",
            loss,
            float(grad_norm),
        )
        if group is not None:
            group["eagle_pending"] = 0
        optimizer.zero_grad(set_to_none=True)
        return skipped, float(grad_norm)
    held = [] if group is None or head_due else [(p, p.grad) for p in head]
    for p, _ in held:
        p.grad = None  # AdamW leaves a parameter without a gradient as it is
    if group is not None and head_due:
        group["lr"] = spec.eagle_lr * min(
            1.0, (group["eagle_updates"] + 1) / spec.eagle_lr_warmup_steps
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for p, grad in held:
        p.grad = grad
    if group is not None:
        group["eagle_pending"] = 0 if head_due else group["eagle_pending"] + 1
        group["eagle_updates"] += int(head_due)
    return skipped, float(grad_norm)


def _head_due(group: dict | None, spec: SpecConfig | None) -> bool:
    """Whether the head's group steps now: it holds ``spec.eagle_accumulate`` steps' gradients
    with this one (always without a spec)."""
    if group is None or spec is None:
        return True
    return group["eagle_pending"] + 1 >= spec.eagle_accumulate


def _full(norm: torch.Tensor) -> torch.Tensor:
    """A gradient norm as a plain tensor (FSDP's is a DTensor)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def _chosen(policy: nn.Module, mb: MicroBatch, terms: _StepTerms) -> torch.Tensor:
    """Log-probs [N] of the completion tokens of a micro-batch under ``policy``."""
    h, _ = backbone(policy, mb.input_ids)
    sel = mb.mask > 0
    return chosen_logprobs(
        policy.lm_head,
        h[:, :-1][sel],
        mb.targets[sel],
        terms.plan.sampling.temperature,
        terms.plan.sampling.top_p,
        terms.plan.cfg.logprob_chunk_tokens,
    )


@dataclass
class _StepTerms:
    """The loss of one micro-batch (run inside ``PolicyModule.forward``): the trainer's plan and
    the step's token and sequence counts."""

    plan: LossPlan
    n_valid: torch.Tensor
    """Trained (sampled) tokens of the global batch."""
    n_seqs: torch.Tensor | float = 1.0
    """Sequences (rows with completion tokens) of the global batch."""

    def loss(
        self, policy: nn.Module, mb: MicroBatch, ref_lp: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, sampling = self.plan.cfg, self.plan.sampling
        aux: list[torch.Tensor] | None = [] if self.plan.eagle_coef > 0 else None
        h, h_exit = backbone(
            policy, mb.input_ids, self.plan.exit_layer, raw_exit=self.plan.adapter, aux=aux
        )
        sel = mb.mask > 0  # [b, s-1]: sampled completion positions, the only ones the loss reads
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
            options=self.plan.options,
            sequences=self._sequences(mb, sel),
        )
        loss, draft = self._draft_terms(policy, mb, out.loss, (h, h_sel, h_exit), aux)
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
                *draft,
            ]
        )
        return loss, stats

    def _sequences(self, mb: MicroBatch, sel: torch.Tensor) -> Sequences | None:
        """Each selected token's row and its row's completion length, where the options need
        sequences."""
        opts = self.plan.options
        if opts is None or (opts.ratio_level == "token" and opts.aggregation == "token_mean"):
            return None
        b, t = mb.mask.shape
        ids = torch.arange(b, device=mb.mask.device)[:, None].expand(b, t)[sel]
        lengths = mb.mask.sum(dim=-1, keepdim=True).expand(b, t)[sel]
        return Sequences(ids[:, None], lengths[:, None], self.n_seqs)

    def _draft_terms(
        self,
        policy: nn.Module,
        mb: MicroBatch,
        loss: torch.Tensor,
        states: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
        aux: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``loss`` plus the drafts' losses, and their figures (exit KL, acceptance sum, EAGLE
        KL, EAGLE positions): the adapter's or the early exit's, and the EAGLE-3 head's.
        ``states``: the policy's final-normed states (all positions, completion positions) and
        those after the exit layer."""
        cfg, sampling = self.plan.cfg, self.plan.sampling
        h, h_sel, h_exit = states
        sel = mb.mask > 0
        n_valid = self.n_valid.clamp(min=1.0)
        zero = torch.zeros((), device=h.device)
        exit_kl, accept, eagle_kl, positions = zero, zero, zero, zero
        if self.plan.adapter:
            # The adapter's loss: detached from the policy (learner/draft_loss.py).
            d_sel = draft_states(policy, h_exit)[:, :-1][sel]
            kl_sum, accept = adapter_terms(
                policy, h_sel, d_sel, sampling.temperature, cfg.logprob_chunk_tokens
            )
            exit_kl = kl_sum / n_valid
            loss = loss + self.plan.aux_coef * exit_kl
        elif self.plan.exit_layer:
            exit_sum = exit_kl_sum(
                policy.lm_head,
                h_sel,
                h_exit[:, :-1][sel],
                sampling.temperature,
                cfg.logprob_chunk_tokens,
            )
            exit_kl = exit_sum / n_valid
            loss = loss + self.plan.aux_coef * exit_kl
        if aux is not None:
            # The EAGLE-3 head's loss: detached from the policy (learner/eagle_loss.py).
            kl_sum, step_accepts, step_counts = eagle_terms(
                policy,
                mb.input_ids,
                aux,
                h,
                sel,
                sampling.temperature,
                cfg.logprob_chunk_tokens,
                self.plan.eagle_steps,
                self.plan.eagle_decay,
            )
            eagle_kl = kl_sum / n_valid
            # A zero that reaches every parameter of the head even where this micro-batch has
            # no head position (padding, one-token prompts): FSDP reduces the same gradients on
            # every rank.
            reach = sum(p.sum() for p in policy.eagle.parameters())
            loss = loss + self.plan.eagle_coef * eagle_kl + 0.0 * reach
            accept, positions = step_accepts[0], step_counts[0]
            per_step = [*step_accepts, *step_counts]
        else:
            per_step = []
        figures = [exit_kl, accept, eagle_kl, positions, *per_step]
        return loss, [t.detach().float() for t in figures]
