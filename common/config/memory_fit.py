"""The learner's memory per device, estimated from the model's config, and the check at start
that picks memory settings that fit (``learner.profile``) or refuses with the estimate.

Estimate per rank of an N-rank FSDP2 run (:func:`learner_plan`; ``specrl plan`` prints it):
- weights, gradients, AdamW moments: sharded over N. ``fp32`` and ``bf16-mixed`` keep fp32
  master weights, gradients and moments (4 + 4 + 8 bytes/parameter); ``bf16`` keeps all three in
  bf16 (2 + 2 + 4);
- FSDP working set (N > 1): the parameters gathered for compute, the root (embedding, LM head,
  final norm) plus two decoder layers (the one running and the one prefetched);
- a reference policy (``learner.kl_coef > 0``): a full replica on every rank;
- activations for one micro-batch of ``max_tokens`` tokens: with activation checkpointing, each
  layer's input kept plus one layer's internals during its recompute; without, every layer's
  internals; plus the hidden states and the LM-head chunk (``chunk`` x vocab fp32 logits, their
  log-softmax and gradient).

A micro-batch holds at most ``max(learner.max_tokens_per_microbatch, longest row)`` tokens (a
row longer than the budget goes alone), and never more than this rank's share of the batch;
the longest row is the longest the learner admits (``learner.max_seq_tokens``, else the model's
context). Estimates, not guarantees: allocator caching, CUDA context, NCCL buffers and
fragmentation come on top, so settings fit when the estimate is within :data:`USABLE_FRACTION`
of the device's memory.

``learner.profile=auto`` keeps the settings when they fit. Otherwise it walks a ladder, each
rung more frugal than the one before, changing only the settings still at their defaults (a
value other than the default is the user's and is kept): a 16k-token micro-batch budget (the
same update), ``bf16-mixed`` (half the activations), activation checkpointing, smaller budgets,
256-position log-prob chunks. It takes the first rung that fits. It never picks ``bf16`` (lossy AdamW state) and never changes
the number of ranks: when nothing fits, the refusal names what would (more ranks, ``bf16``, a
shorter ``learner.max_seq_tokens``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common.config.learner import LearnerConfig

if TYPE_CHECKING:
    from common.config import SpecRLConfig

GiB = 2**30
USABLE_FRACTION = 0.9
"""Share of a device's memory the estimate may fill; the rest is for what it leaves out."""
BUDGETS: tuple[int, ...] = (16384, 8192, 4096, 2048, 1024, 512)
"""Micro-batch token budgets ``auto`` tries, largest first."""
FRUGAL_CHUNK = 256
"""``logprob_chunk_tokens`` of the ladder's last rung."""
MEMORY_FIELDS: tuple[str, ...] = (
    "precision",
    "max_tokens_per_microbatch",
    "activation_checkpointing",
    "logprob_chunk_tokens",
)
"""The ``learner`` settings a profile sets."""
MAX_RANKS = 1024


@dataclass
class Shape:
    vocab: int
    """Vocabulary size (rows of the embedding and the LM head)."""
    hidden: int
    """Hidden size."""
    intermediate: int
    """MLP width."""
    layers: int
    """Decoder layers."""
    heads: int
    """Attention (query) heads."""
    kv_heads: int
    """Key/value heads (grouped-query attention)."""
    head_dim: int
    """Dimension of one head."""
    tied: bool
    """Whether the LM head shares the embedding's weights."""
    qkv_bias: bool
    """Whether q/k/v projections carry biases (Qwen2)."""
    context: int = 0
    """``max_position_embeddings`` (0: not given)."""

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Shape:
        heads = cfg["num_attention_heads"]
        return cls(
            vocab=cfg["vocab_size"],
            hidden=cfg["hidden_size"],
            intermediate=cfg["intermediate_size"],
            layers=cfg["num_hidden_layers"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            tied=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias", False)),
            context=int(cfg.get("max_position_embeddings") or 0),
        )

    def layer_params(self) -> int:
        H, D = self.hidden, self.head_dim
        q, kv = self.heads * D, self.kv_heads * D
        attn = H * q + 2 * H * kv + q * H + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * H * self.intermediate + 2 * H

    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()

    def layer_activation_elems(self) -> int:
        """Elements one decoder layer keeps per token for backward (norm outputs, q/k/v,
        attention output, residuals, the SwiGLU's gate, up, activation and product)."""
        H, D = self.hidden, self.head_dim
        return 4 * H + (2 * self.heads + 2 * self.kv_heads) * D + 4 * self.intermediate


def learner_plan(
    shape: Shape,
    gpus: int = 1,
    precision: str = "bf16-mixed",
    max_tokens: int = 8192,
    chunk: int = 1024,
    checkpointing: bool = True,
    reference: bool = False,
) -> dict[str, float]:
    """Bytes per GPU of the learner (see the module docstring)."""
    master = 2 if precision == "bf16" else 4  # bytes/param of weights, gradients; x2 for AdamW
    compute = 2 if precision in ("bf16", "bf16-mixed") else 4  # bytes/element of activations
    P = shape.params()
    weights = P * master / gpus
    grads = P * master / gpus
    optimizer = 2 * P * master / gpus
    gathered = 0.0
    if gpus > 1:
        gathered = (shape.root_params() + 2 * shape.layer_params()) * master
    ref = float(P * master) if reference else 0.0
    per_layer = shape.layer_activation_elems() * compute * max_tokens
    if checkpointing:
        activations = shape.layers * shape.hidden * compute * max_tokens + per_layer
    else:
        activations = shape.layers * per_layer
    hidden = 2 * max_tokens * shape.hidden * 4  # final hidden states and their gradient
    head = 3 * min(chunk or max_tokens, max_tokens) * shape.vocab * 4
    total = weights + grads + optimizer + gathered + ref + activations + hidden + head
    return {
        "params": P,
        "weights": weights,
        "gradients": grads,
        "optimizer": optimizer,
        "fsdp_gathered": gathered,
        "reference": ref,
        "activations": activations + hidden,
        "lm_head_chunk": head,
        "total": total,
    }


# ------------------------------------------------------------------------------ profiles


@dataclass(frozen=True)
class Profile:
    """The learner's memory settings (:data:`MEMORY_FIELDS`)."""

    precision: str
    """``learner.precision``."""
    max_tokens_per_microbatch: int
    """``learner.max_tokens_per_microbatch`` (0: the whole batch)."""
    activation_checkpointing: bool
    """``learner.activation_checkpointing``."""
    logprob_chunk_tokens: int
    """``learner.logprob_chunk_tokens``."""

    @classmethod
    def of(cls, lcfg: LearnerConfig) -> Profile:
        return cls(**{name: getattr(lcfg, name) for name in MEMORY_FIELDS})

    def apply(self, lcfg: LearnerConfig) -> None:
        for name in MEMORY_FIELDS:
            setattr(lcfg, name, getattr(self, name))

    def overrides(self) -> str:
        """As ``learner.*`` overrides."""
        return " ".join(f"learner.{name}={_value(getattr(self, name))}" for name in MEMORY_FIELDS)


def user_set(lcfg: LearnerConfig) -> set[str]:
    """The memory settings whose value differs from the dataclass default: the user's (from the
    command line, a YAML group such as a model preset, or code). ``auto`` keeps them."""
    defaults = {f.name: f.default for f in dataclasses.fields(LearnerConfig)}
    return {name for name in MEMORY_FIELDS if getattr(lcfg, name) != defaults[name]}


@dataclass(frozen=True)
class Workload:
    """What bounds one micro-batch: the step's rows, the longest row, the ranks sharing them."""

    rows: int
    """Rows of one learner step (groups x completions)."""
    longest_row: int
    """Tokens of the longest row the learner admits."""
    ranks: int = 1
    """Learner ranks sharing the rows (FSDP)."""
    reference: bool = False
    """Whether a reference policy is kept (``learner.kl_coef > 0``)."""

    def tokens(self, budget: int) -> int:
        """Most tokens one micro-batch of this rank holds under ``budget`` (0: the whole batch)."""
        whole = math.ceil(self.rows / self.ranks) * self.longest_row
        return whole if budget <= 0 else min(whole, max(budget, self.longest_row))

    def with_ranks(self, ranks: int) -> Workload:
        return dataclasses.replace(self, ranks=ranks)

    @classmethod
    def of(cls, cfg: SpecRLConfig, shape: Shape, ranks: int) -> Workload:
        bound = cfg.learner.max_seq_tokens
        context = shape.context or bound
        longest = min(context, bound) if bound > 0 else context
        if longest <= 0:
            raise ValueError(
                "the model's config has no max_position_embeddings: set learner.max_seq_tokens "
                "so the learner's memory can be estimated (or learner.profile=off)"
            )
        return cls(
            rows=cfg.learner.groups_per_step * cfg.actor.group_size,
            longest_row=longest,
            ranks=ranks,
            reference=cfg.learner.kl_coef > 0,
        )


def estimate(shape: Shape, work: Workload, profile: Profile) -> dict[str, float]:
    """:func:`learner_plan` for these settings, with their micro-batch's token count."""
    tokens = work.tokens(profile.max_tokens_per_microbatch)
    plan = learner_plan(
        shape,
        work.ranks,
        profile.precision,
        tokens,
        profile.logprob_chunk_tokens,
        profile.activation_checkpointing,
        work.reference,
    )
    plan["tokens"] = tokens
    return plan


def ladder(shape: Shape, work: Workload, start: Profile, fixed: set[str]) -> list[Profile]:
    """``start``, then rungs each more frugal than the one before (an estimate strictly lower),
    changing only the settings not in ``fixed``."""
    # A budget first: micro-batches give the same update. Then bf16 compute, which halves the
    # activations; then recomputing each layer, which costs a forward.
    steps: list[dict[str, Any]] = [{"max_tokens_per_microbatch": BUDGETS[0]}]
    if start.precision == "fp32":
        steps.append({"precision": "bf16-mixed"})
    steps.append({"activation_checkpointing": True})
    steps += [{"max_tokens_per_microbatch": b} for b in BUDGETS[1:]]
    steps.append({"logprob_chunk_tokens": FRUGAL_CHUNK})
    rungs = [start]
    lowest = estimate(shape, work, start)["total"]
    for step in steps:
        change = {k: v for k, v in step.items() if k not in fixed}
        budget = change.get("max_tokens_per_microbatch")
        current = rungs[-1].max_tokens_per_microbatch
        if budget is not None and 0 < current <= budget:
            continue  # never a larger budget than the one already set
        chunk = change.get("logprob_chunk_tokens")
        if chunk is not None and 0 < rungs[-1].logprob_chunk_tokens <= chunk:
            continue
        if not change:
            continue
        rung = dataclasses.replace(rungs[-1], **change)
        total = estimate(shape, work, rung)["total"]
        if total < lowest:
            rungs.append(rung)
            lowest = total
    return rungs


def first_fit(
    shape: Shape, work: Workload, start: Profile, fixed: set[str], usable: float
) -> tuple[Profile, dict[str, float]] | None:
    """The first rung of :func:`ladder` whose estimate fits ``usable`` bytes, or None."""
    for rung in ladder(shape, work, start, fixed):
        plan = estimate(shape, work, rung)
        if plan["total"] <= usable:
            return rung, plan
    return None


class FitError(ValueError):
    """The learner's estimate exceeds the device's memory, even with the most frugal settings
    it may use."""


@dataclass
class Fit:
    profile: Profile
    """The settings picked."""
    plan: dict[str, float]
    """Their estimate (:func:`learner_plan`'s parts, bytes per device)."""
    available: float
    """Bytes of device memory planned against."""

    @property
    def usable(self) -> float:
        return self.available * USABLE_FRACTION


def choose(
    shape: Shape,
    work: Workload,
    lcfg: LearnerConfig,
    available: float,
    source: str = "",
    model: str = "MODEL_DIR",
    keep: Collection[str] = (),
) -> Fit:
    """The settings the learner runs with: ``lcfg``'s when they fit; under ``profile=auto`` the
    first fitting rung of the ladder over the settings the user left at their defaults (and
    not in ``keep``: fields an earlier layer of the resolve step set, e.g. the precision
    fallback's ``fp32``). Raises :class:`FitError` with the estimate and what would fit when
    nothing does."""
    usable = available * USABLE_FRACTION
    start = Profile.of(lcfg)
    fixed = set(MEMORY_FIELDS) if lcfg.profile == "manual" else user_set(lcfg) | set(keep)
    found = first_fit(shape, work, start, fixed, usable)
    if found is not None:
        return Fit(found[0], found[1], available)
    raise FitError(refusal(shape, work, lcfg, fixed, available, source, model))


def _gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def describe(plan: dict[str, float]) -> str:
    """``total GiB (weights + gradients + ...)`` of one estimate (MiB below 1 GiB)."""
    scale, unit = (GiB, "GiB") if plan["total"] >= GiB else (2**20, "MiB")

    def amount(key: str) -> str:
        return f"{plan[key] / scale:.1f}"

    parts = [
        f"weights {amount('weights')}",
        f"gradients {amount('gradients')}",
        f"AdamW {amount('optimizer')}",
    ]
    if plan["fsdp_gathered"]:
        parts.append(f"FSDP gathered {amount('fsdp_gathered')}")
    if plan["reference"]:
        parts.append(f"reference {amount('reference')}")
    parts.append(f"activations {amount('activations')} ({int(plan['tokens'])} tokens)")
    parts.append(f"LM-head chunk {amount('lm_head_chunk')}")
    return f"{amount('total')} {unit} ({' + '.join(parts)})"


def _value(value: Any) -> str:
    """A setting as an override writes it (``true``, not ``True``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def _settings(profile: Profile) -> str:
    return ", ".join(f"{name}={_value(getattr(profile, name))}" for name in MEMORY_FIELDS)


def refusal(
    shape: Shape,
    work: Workload,
    lcfg: LearnerConfig,
    fixed: set[str],
    available: float,
    source: str,
    model: str,
) -> str:
    """The message of a start refused: the estimate of the most frugal settings allowed, the
    memory, and what would fit."""
    usable = available * USABLE_FRACTION
    start = Profile.of(lcfg)
    frugal = ladder(shape, work, start, fixed)[-1]
    plan = estimate(shape, work, frugal)
    ranks = f"{work.ranks} rank{'s' if work.ranks > 1 else ''}"
    lines = [
        f"the learner does not fit in device memory (learner.profile={lcfg.profile}): "
        f"{shape.params() / 1e9:.2f}B parameters on {ranks} need {describe(plan)} per device "
        f"with {_settings(frugal)}; {_gib(available)} GiB available ({source}), "
        f"{_gib(usable)} GiB usable ({USABLE_FRACTION:.0%}: the rest is for the CUDA context, "
        "allocator and NCCL buffers)."
    ]
    free_fit = first_fit(shape, work, start, set(), usable)
    if fixed and free_fit is not None:
        kept = ", ".join(
            f"learner.{f}={_value(getattr(lcfg, f))}" for f in MEMORY_FIELDS if f in fixed
        )
        why = (
            "learner.profile=manual uses the settings as given"
            if lcfg.profile == "manual"
            else "learner.profile=auto changes only the settings left at their defaults"
        )
        lines.append(
            f"These settings fit ({describe(free_fit[1])}): {free_fit[0].overrides()}. "
            f"Kept as set: {kept} ({why})."
        )
    # What would fit, with the settings kept as they are, else with auto free to change them.
    auto_note = " (learner.profile=auto with these settings at their defaults)"
    more = _fewest_ranks(shape, work, start, fixed, usable)
    if more is None and fixed:
        more = _fewest_ranks(shape, work, start, set(), usable)
        more = None if more is None else (*more[:2], auto_note)
    if more is not None:
        n, (profile, more_plan), note = more
        lines.append(
            f"It fits on {n} devices of this size, sharded with FSDP2 "
            f"(torchrun --nproc-per-node {n} -m learner.main, or LEARNER_GPUS={n} in docker "
            f"compose): {describe(more_plan)} per device with {_settings(profile)}{note}."
        )
    else:
        lines.append(f"It does not fit on up to {MAX_RANKS} devices of this size.")
    bf16 = dataclasses.replace(start, precision="bf16")
    bf16_fit, note = first_fit(shape, work, bf16, fixed | {"precision"}, usable), ""
    if bf16_fit is None and fixed:
        bf16_fit, note = first_fit(shape, work, bf16, {"precision"}, usable), auto_note
    if bf16_fit is not None:
        lines.append(
            f"On {ranks} it fits with learner.precision=bf16{note}: {describe(bf16_fit[1])} with "
            f"{_settings(bf16_fit[0])}; bf16 AdamW state rounds small updates away."
        )
    if plan["tokens"] == work.longest_row > frugal.max_tokens_per_microbatch > 0:
        bound = "learner.max_seq_tokens" if lcfg.max_seq_tokens > 0 else "the model's context"
        lines.append(
            f"A micro-batch holds at least one row of up to {work.longest_row} tokens ({bound}); "
            "a lower learner.max_seq_tokens shrinks it."
        )
    lines.append(
        f"`specrl plan {model} --gpus N --precision P --max-tokens T --memory-gib M` prints "
        "these estimates; learner.device_memory_gib sets the memory planned against, "
        "learner.profile=off skips the check."
    )
    return "\n".join(lines)


def _fewest_ranks(
    shape: Shape, work: Workload, start: Profile, fixed: set[str], usable: float
) -> tuple[int, tuple[Profile, dict[str, float]], str] | None:
    """The fewest ranks (above ``work.ranks``, up to :data:`MAX_RANKS`) on which a rung fits."""
    for n in sorted({*range(work.ranks + 1, 65), 128, 256, 512, MAX_RANKS}):
        found = first_fit(shape, work.with_ranks(n), start, fixed, usable)
        if found is not None:
            return n, found, ""
    return None
