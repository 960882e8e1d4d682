"""The GPU profile: defaults for a Hugging Face model on CUDA devices, chosen from the model and
the devices at start; a value the user set always wins.

The dataclass defaults fit the built-in toy on a CPU (``learner.lr=3e-4``, fp32, a 512-token
vLLM context, 16 rows per actor). On CUDA with a real model directory (``model.path``, or a
real-model preset) the learner and each actor on a GPU start instead from:

- ``learner.lr`` in the range RL post-training recipes use at the model's size
  (:data:`LR_BANDS`), with a short linear warm-up (``learner.lr_warmup_steps``);
- ``learner.precision=bf16-mixed``, ``learner.publish_dtype=bfloat16`` and ``run.tf32=true``
  (on GPUs with bf16 and TF32: compute capability 8.0 and up);
- ``engine.vllm_max_model_len`` and ``learner.max_seq_tokens`` from the task: its longest
  tokenized prompt (or the length it declares) plus ``max_new_tokens``;
- ``actor.prompts_per_batch`` for about :data:`GPU_ROWS` rows per generate call, fewer when
  their KV cache would not fit the GPU, and ``learner.groups_per_step`` for :data:`STEP_ROWS`
  completions per optimizer step;
- ``learner.queue_max`` and ``actor.outbox_max`` of at least a step's and a call's groups
  (:func:`pipeline_sizes`), so actors do not wait on acks while a step trains,
  ``learner.tis_cap`` = :data:`TIS_CAP`, and ``learner.max_staleness_from_lag`` =
  :data:`STALENESS_FROM_LAG` (the bound follows the measured weight-delivery lag);
- ``engine.vllm_stop_token_ids``: every ``eos_token_id`` of the model's ``generation_config.json``
  (an int or a list: Llama 3 and Qwen chat models end turns on several).

:func:`gpu_profile` is a pure function of (the model's ``config.json``, its
``generation_config.json``, the devices, the task's facts, the run's config, the keys the user
set), so a CPU tests it; ``common/process_start.py`` gathers those at start, resolves (``common/config/resolve.py``) and
logs it as a table of ``setting = value (why)``. Without CUDA it is never called.

A key the user set (:func:`explicit_keys`: named on the command line, or composed to a value
other than the dataclass default, as a model preset's YAML does) is kept. A learning rate far
above the model's range (over :data:`UNUSUAL_LR_FACTOR` times its top, e.g. 3e-4 at 7B) is
refused with :class:`UnusualLearningRate`, or only warned about with
``learner.allow_unusual_lr=true``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.config import SpecRLConfig

GiB = 2**30

# Learning rates of open RL post-training recipes (GRPO/PPO on a policy of the size), the
# anchors of issue 42:
# - 7B-8B: 1e-6. verl's GRPO examples train Qwen2/Qwen2.5-7B at actor.optim.lr=1e-6;
#   OpenRLHF's Llama-3-8B PPO/GRPO examples at 5e-7..1e-6; prime-rl's 7B-class RL configs at
#   1e-6; DAPO trains Qwen2.5-32B at 1e-6 too.
# - 1.5B-3B: 1e-6..2e-6 (TinyZero's Qwen2.5-3B GRPO at 1e-6, DeepScaleR-1.5B at 1e-6..2e-6).
# - below 1B: higher, up to about 1e-5 (small-model GRPO examples at 1e-6..1e-5; this
#   repository's SmolLM2-135M preset trains at 2e-5 on a CPU).
# Above the top of a band by UNUSUAL_LR_FACTOR an update moves nearly every bf16 weight each
# step: a policy trained into the ground within tens of steps, and every version a keyframe.


@dataclass(frozen=True)
class LrBand:
    """The learning rates RL recipes use for policies below ``below`` parameters."""

    below: float
    """Parameters (exclusive upper bound) of the band."""
    lr: float
    """What the profile picks."""
    low: float
    """Lowest rate recipes use at this size."""
    high: float
    """Highest rate recipes use at this size."""
    anchor: str
    """Where the numbers come from, for the table."""


LR_BANDS: tuple[LrBand, ...] = (
    LrBand(0.3e9, 1e-5, 1e-6, 3e-5, "below 0.3B: up to ~1e-5"),
    LrBand(1e9, 5e-6, 1e-6, 1e-5, "0.3B-1B GRPO: 1e-6..1e-5"),
    LrBand(4e9, 2e-6, 5e-7, 5e-6, "1.5B-3B GRPO: 1e-6..2e-6"),
    LrBand(math.inf, 1e-6, 2e-7, 3e-6, "7B-8B GRPO in verl/OpenRLHF/prime-rl: 1e-6"),
)
UNUSUAL_LR_FACTOR = 10.0
"""A learning rate over this many times the top of the model's band is refused (without
``learner.allow_unusual_lr``)."""
WARMUP_RATIO = 0.03
"""Warm-up steps as a share of ``run.steps`` (OpenRLHF's default ``lr_warmup_ratio``)."""
MAX_WARMUP_STEPS = 50
"""The most warm-up steps the profile picks."""
GPU_ROWS = 256
"""Rows (completions) per generate call the profile aims at on a GPU actor: enough for vLLM's
scheduler (which batches them continuously inside the call) to keep a GPU busy."""
STEP_ROWS = 512
"""Completions per optimizer step the profile aims at (``learner.groups_per_step`` groups):
about two GPU actors' calls, within the hundreds to thousands RL recipes update on at 7B."""
LENGTH_QUANTUM = 128
"""``engine.vllm_max_model_len`` and ``learner.max_seq_tokens`` are rounded up to this."""
TIS_CAP = 2.0
"""``learner.tis_cap`` the profile turns on: vLLM's sampling and the learner's forward differ
in bf16 kernels, so the behaviour log-probs the actors record are not the learner's; a cap of 2
on the per-token weight is verl's default for the same correction."""
STALENESS_FROM_LAG = 8
"""``learner.max_staleness_from_lag`` the profile sets: the staleness bound follows the measured
weight-delivery lag up to this many versions (a 7B version through Redis is projected at several
learner steps: ``publish_7b_projected_s_redis`` in docs/benchmarks.md)."""
ACTOR_MEMORY_SHARE = 0.9
"""Share of an actor's GPU its engine may fill, unless ``engine.vllm_kwargs`` sets
``gpu_memory_utilization`` (vLLM's default)."""
PROFILE_KEYS: tuple[str, ...] = (
    "learner.lr",
    "learner.lr_warmup_steps",
    "learner.precision",
    "learner.publish_dtype",
    "learner.max_seq_tokens",
    "run.tf32",
    "engine.vllm_max_model_len",
    "engine.vllm_stop_token_ids",
    "actor.prompts_per_batch",
    "learner.groups_per_step",
    "learner.queue_max",
    "actor.outbox_max",
    "learner.tis_cap",
    "learner.max_staleness_from_lag",
)
"""The settings the profile chooses (``section.field``)."""


class UnusualLearningRate(ValueError):
    """``learner.lr`` far above the range RL recipes use at the model's size."""


@dataclass(frozen=True)
class Devices:
    """The CUDA devices a process runs on, as the profile needs them."""

    cuda: bool
    """Whether this process trains or generates on CUDA."""
    count: int = 0
    """CUDA devices the process sees."""
    name: str = ""
    """The device's name (``NVIDIA H100 80GB HBM3``)."""
    memory_gib: float = 0.0
    """Memory of one device, GiB (0: unknown)."""
    capability: tuple[int, int] = (0, 0)
    """Compute capability; (0, 0): unknown, taken as recent (bf16 and TF32)."""

    @property
    def bf16(self) -> bool:
        """bf16 matrix units (and TF32): compute capability 8.0 (Ampere) and up."""
        return self.capability == (0, 0) or self.capability >= (8, 0)

    def describe(self) -> str:
        if not self.cuda:
            return "no CUDA"
        memory = f", {self.memory_gib:.0f} GiB" if self.memory_gib else ""
        return f"{self.count} x {self.name or 'CUDA device'}{memory}"


@dataclass(frozen=True)
class TaskFacts:
    """What the task tells the profile about row lengths."""

    max_prompt_tokens: int = 0
    """Longest prompt in tokens, as the actors encode it; 0: unknown."""
    max_new_tokens: int = 0
    """The task's generation budget per completion."""
    source: str = ""
    """How ``max_prompt_tokens`` was found (for the table)."""


@dataclass(frozen=True)
class Setting:
    """One line of the profile: a key, its value and why."""

    key: str
    """``section.field``."""
    value: Any
    """The value the run gets."""
    why: str
    """The reason, for the table."""
    kept: bool = False
    """The user's value, kept as set."""


@dataclass(frozen=True)
class Note:
    """A warning of the profile, and the config sections it concerns."""

    sections: tuple[str, ...]
    """Sections whose processes log it (``learner``, ``actor``, ``engine``, ``run``)."""
    text: str
    """The warning."""


@dataclass(frozen=True)
class GpuProfile:
    """The profile's settings (the user's kept ones included) and its warnings."""

    settings: tuple[Setting, ...]
    """One per key the profile chooses, in the table's order."""
    notes: tuple[Note, ...] = ()
    """What the run should hear about: a value out of range, a setting left as it was."""
    heading: str = ""
    """The table's first line: the model's size and the devices."""

    def changes(self, sections: Collection[str] | None = None) -> dict[str, Any]:
        """``key -> value`` of the settings the profile sets (not the user's), in ``sections``
        (all when None)."""
        return {
            s.key: s.value
            for s in self.settings
            if not s.kept and (sections is None or s.key.split(".")[0] in sections)
        }

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(n.text for n in self.notes)

    def warnings_for(self, sections: Collection[str]) -> list[str]:
        """The warnings that concern any of ``sections``."""
        return [n.text for n in self.notes if set(n.sections) & set(sections)]

    def table(self, sections: Collection[str] | None = None) -> str:
        """The heading, then ``key = value (why)`` per setting in ``sections``."""
        rows = [s for s in self.settings if sections is None or s.key.split(".")[0] in sections]
        width = max((len(s.key) for s in rows), default=0)
        lines = [self.heading] if self.heading else []
        lines += [f"  {s.key.ljust(width)} = {_shown(s.value)} ({s.why})" for s in rows]
        return "\n".join(lines)


def _shown(value: Any) -> str:
    """A value as an override writes it (``true``, ``1e-06``, ``[151645, 151643]``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def model_parameters(model_config: Mapping[str, Any]) -> int:
    """Parameters of a decoder-only model from its ``config.json``: embedding (and an untied LM
    head), per layer attention (GQA, Qwen2's q/k/v bias), a gated MLP and two norms, the final
    norm."""
    hidden, layers = int(model_config["hidden_size"]), int(model_config["num_hidden_layers"])
    heads = int(model_config["num_attention_heads"])
    kv_heads = int(model_config.get("num_key_value_heads") or heads)
    head_dim = int(model_config.get("head_dim") or hidden // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    bias = model_config.get("model_type") == "qwen2" or bool(model_config.get("attention_bias"))
    attention = 2 * hidden * q + 2 * hidden * kv + ((q + 2 * kv) if bias else 0)
    mlp = 3 * hidden * int(model_config["intermediate_size"])
    tied = bool(model_config.get("tie_word_embeddings", False))
    embeddings = int(model_config["vocab_size"]) * hidden * (1 if tied else 2)
    return layers * (attention + mlp + 2 * hidden) + embeddings + hidden


def kv_bytes_per_token(model_config: Mapping[str, Any], dtype_bytes: int = 2) -> int:
    """KV cache bytes of one token across the layers (keys and values, bf16)."""
    heads = int(model_config["num_attention_heads"])
    kv_heads = int(model_config.get("num_key_value_heads") or heads)
    head_dim = int(model_config.get("head_dim") or int(model_config["hidden_size"]) // heads)
    return 2 * int(model_config["num_hidden_layers"]) * kv_heads * head_dim * dtype_bytes


def eos_token_ids(
    generation_config: Mapping[str, Any] | None, model_config: Mapping[str, Any]
) -> list[int]:
    """Every EOS id of the model: ``generation_config.json``'s ``eos_token_id`` (an int or a
    list), else ``config.json``'s; in order, without repeats."""
    raw = (generation_config or {}).get("eos_token_id")
    if raw is None:
        raw = model_config.get("eos_token_id")
    values = raw if isinstance(raw, list) else [] if raw is None else [raw]
    return list(dict.fromkeys(int(v) for v in values))


def lr_band(parameters: int) -> LrBand:
    """The band of :data:`LR_BANDS` a model of ``parameters`` falls in."""
    return next(b for b in LR_BANDS if parameters < b.below)


def billions(parameters: int) -> str:
    return f"{parameters / 1e9:.2f}B"


def check_lr(lr: float, parameters: int, allow_unusual: bool) -> str | None:
    """A warning for an ``lr`` outside the usual range of the model's size, or None. Raises
    :class:`UnusualLearningRate` when ``lr`` is over :data:`UNUSUAL_LR_FACTOR` times its top,
    unless ``allow_unusual``: then that is a warning too."""
    band = lr_band(parameters)
    if band.low <= lr <= band.high:
        return None
    size = f"a {billions(parameters)}-parameter model"
    usual = f"RL recipes use {band.low:g}..{band.high:g} at this size ({band.anchor})"
    if lr > UNUSUAL_LR_FACTOR * band.high:
        reason = (
            f"learner.lr={lr:g} is far above the learning rates for {size}: {usual}; over "
            f"{UNUSUAL_LR_FACTOR * band.high:g} an update changes nearly every bf16 weight each "
            "step and is likely to wreck the policy within tens of steps"
        )
        if not allow_unusual:
            raise UnusualLearningRate(
                f"{reason}. Leave learner.lr unset (the GPU profile picks {band.lr:g}), set "
                f"one in range, or pass learner.allow_unusual_lr=true to run with it anyway"
            )
        return f"{reason} (learner.allow_unusual_lr=true: running with it)"
    side = "above" if lr > band.high else "below"
    return f"learner.lr={lr:g} is {side} the usual range for {size}: {usual}"


def named_keys(overrides: Sequence[str]) -> frozenset[str]:
    """The keys ``overrides`` set on the command line (``key=value``, ``+key=value``,
    ``++key=value``)."""
    return frozenset(o.split("=", 1)[0].lstrip("+") for o in overrides if "=" in o)


def set_keys(cfg: SpecRLConfig, changes: dict[str, Any]) -> None:
    """Set each ``section.name`` of ``changes`` on ``cfg`` (in place)."""
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)


def explicit_keys(overrides: Sequence[str], cfg: SpecRLConfig) -> frozenset[str]:
    """The profile's keys (:data:`PROFILE_KEYS`, plus ``learner.allow_unusual_lr``) the user set:
    named in ``overrides`` (``key=value``, ``+key=value``, ``++key=value``), or composed to a
    value other than the dataclass default (a YAML group option such as a model preset sets
    values chosen for its model; so does code)."""
    named = named_keys(overrides)
    keys = (*PROFILE_KEYS, "learner.allow_unusual_lr")
    return frozenset(k for k in keys if k in named or _differs_from_default(cfg, k))


def _differs_from_default(cfg: SpecRLConfig, key: str) -> bool:
    section_name, name = key.split(".")
    section = getattr(cfg, section_name)
    field = {f.name: f for f in dataclasses.fields(section)}[name]
    default = (
        field.default_factory() if field.default is dataclasses.MISSING else field.default  # type: ignore[misc]
    )
    return getattr(section, name) != default


def warmup_steps(steps: int) -> int:
    """:data:`WARMUP_RATIO` of ``steps``, between 1 (none) and :data:`MAX_WARMUP_STEPS`."""
    return max(1, min(MAX_WARMUP_STEPS, round(WARMUP_RATIO * steps)))


def round_up(n: int, quantum: int = LENGTH_QUANTUM) -> int:
    return -(-n // quantum) * quantum


class _Builder:
    """Collects settings: the profile's value for a key the user left alone, the user's kept."""

    def __init__(self, cfg: SpecRLConfig, explicit: Collection[str]) -> None:
        self.cfg, self.explicit = cfg, explicit
        self.settings: list[Setting] = []
        self.notes: list[Note] = []

    def warn(self, sections: str, text: str) -> None:
        """A warning for the processes that apply ``sections`` (space-separated)."""
        self.notes.append(Note(tuple(sections.split()), text))

    def current(self, key: str) -> Any:
        section, name = key.split(".")
        return getattr(getattr(self.cfg, section), name)

    def choose(self, key: str, value: Any, why: str) -> None:
        if key in self.explicit:
            self.settings.append(
                Setting(key, self.current(key), f"yours; the profile: {value}", True)
            )
        else:
            self.settings.append(Setting(key, value, why))

    def value(self, key: str) -> Any:
        """What ``key`` will be: the user's, or the profile's once chosen."""
        for s in self.settings:
            if s.key == key:
                return s.value
        return self.current(key)


def gpu_profile(
    model_config: Mapping[str, Any],
    generation_config: Mapping[str, Any] | None,
    devices: Devices,
    task: TaskFacts,
    cfg: SpecRLConfig,
    explicit: Collection[str],
) -> GpuProfile:
    """The settings of the GPU profile for the model of ``model_config`` (its ``config.json``)
    on ``devices``; keys in ``explicit`` keep ``cfg``'s values. Empty without CUDA. Raises
    :class:`UnusualLearningRate` for a learning rate far above the model's range, unless
    ``learner.allow_unusual_lr``."""
    if not devices.cuda:
        return GpuProfile(())
    parameters = model_parameters(model_config)
    b = _Builder(cfg, explicit)
    _learning_rate(b, parameters)
    _precision(b, devices)
    _lengths(b, model_config, task)
    _rows(b, model_config, devices, parameters)
    _pipeline(b)
    _stop_ids(b, model_config, generation_config)
    heading = (
        f"GPU profile for {billions(parameters)} parameters on {devices.describe()} "
        "(setting = value (why); set any of them to override)"
    )
    return GpuProfile(tuple(b.settings), tuple(b.notes), heading)


def _learning_rate(b: _Builder, parameters: int) -> None:
    band = lr_band(parameters)
    b.choose("learner.lr", band.lr, f"{billions(parameters)} parameters; {band.anchor}")
    if "learner.lr" in b.explicit:
        warning = check_lr(b.cfg.learner.lr, parameters, b.cfg.learner.allow_unusual_lr)
        if warning:
            b.warn("learner", warning)
    warmup = warmup_steps(b.cfg.run.steps)
    b.choose(
        "learner.lr_warmup_steps",
        warmup,
        f"linear warm-up over {WARMUP_RATIO:.0%} of run.steps={b.cfg.run.steps}, at most "
        f"{MAX_WARMUP_STEPS}",
    )


def _precision(b: _Builder, devices: Devices) -> None:
    if not devices.bf16:
        b.warn(
            "learner run",
            f"{devices.name or 'this GPU'} (compute capability {devices.capability[0]}."
            f"{devices.capability[1]}) has no bf16: learner.precision, learner.publish_dtype "
            "and run.tf32 keep their defaults",
        )
        return
    b.choose(
        "learner.precision",
        "bf16-mixed",
        "bf16 compute, fp32 master weights and AdamW state (FSDP2 mixed precision)",
    )
    b.choose(
        "learner.publish_dtype", "bfloat16", "half the bytes of fp32 per version; vLLM serves bf16"
    )
    b.choose("run.tf32", True, "fp32 matmuls outside autocast on TF32 tensor cores")


def _lengths(b: _Builder, model_config: Mapping[str, Any], task: TaskFacts) -> None:
    context = int(model_config.get("max_position_embeddings") or 0)
    if task.max_prompt_tokens <= 0:
        b.warn(
            "learner engine",
            "the task's prompt lengths are unknown: engine.vllm_max_model_len and "
            "learner.max_seq_tokens keep their values",
        )
        return
    need = task.max_prompt_tokens + task.max_new_tokens
    length = round_up(need)
    why = (
        f"longest prompt {task.max_prompt_tokens} tokens ({task.source}) + max_new_tokens "
        f"{task.max_new_tokens}, rounded up to {LENGTH_QUANTUM}"
    )
    if context and length > context:
        length = context
        why += f", capped at the model's context {context}"
        if need > context:
            b.warn(
                "engine",
                f"prompts up to {task.max_prompt_tokens} tokens + {task.max_new_tokens} new "
                f"tokens exceed the model's context ({context}): longer prompts are refused "
                "and counted (actor/prompts_too_long)",
            )
    b.choose("engine.vllm_max_model_len", length, why)
    b.choose("learner.max_seq_tokens", length, "the longest row an actor sends")


def _rows(b: _Builder, model_config: Mapping[str, Any], devices: Devices, parameters: int) -> None:
    group = b.cfg.actor.group_size
    if b.cfg.actor.wait_for_new_version:
        b.warn(
            "actor learner",
            "actor.wait_for_new_version ties learner.groups_per_step to "
            "actor.prompts_per_batch: both keep their values",
        )
        return
    rows = GPU_ROWS
    why = f"{GPU_ROWS} rows per generate call ({GPU_ROWS // group} prompts x group_size {group})"
    length = int(b.value("engine.vllm_max_model_len"))
    share = float(b.cfg.engine.vllm_kwargs.get("gpu_memory_utilization", ACTOR_MEMORY_SHARE))
    if devices.memory_gib:
        weights = 2 * parameters  # bf16
        kv_room = devices.memory_gib * GiB * share - 1.1 * weights
        fits = int(max(kv_room, 0) // (kv_bytes_per_token(model_config) * length))
        if fits < rows:
            rows = max(group, fits)
            why = (
                f"the KV cache of {rows} rows of {length} tokens fits beside the bf16 weights "
                f"in {share:.0%} of {devices.memory_gib:.0f} GiB"
            )
    b.choose("actor.prompts_per_batch", max(1, rows // group), why)
    b.choose(
        "learner.groups_per_step",
        max(1, STEP_ROWS // group),
        f"{STEP_ROWS} completions per optimizer step ({STEP_ROWS // group} groups of {group}): "
        "a GPU actor's call feeds a step or two, so few groups arrive too stale to train on",
    )


def pipeline_sizes(groups_per_step: int, prompts_per_batch: int) -> tuple[int, int]:
    """``(learner.queue_max, actor.outbox_max)`` that keep actors from waiting on a learner
    that keeps up on average: the queue holds the next step's groups while a step trains, and
    an outbox holds a whole generate call's groups while the learner is busy."""
    return groups_per_step, prompts_per_batch


def _pipeline(b: _Builder) -> None:
    step, call = int(b.value("learner.groups_per_step")), int(b.value("actor.prompts_per_batch"))
    queue, outbox = pipeline_sizes(step, call)
    if queue > b.current("learner.queue_max"):
        b.choose(
            "learner.queue_max",
            queue,
            f"a step's groups ({step}) wait while the step before trains; fewer make every "
            "actor wait on the learner during each step",
        )
    if outbox > b.current("actor.outbox_max"):
        b.choose(
            "actor.outbox_max",
            outbox,
            f"a generate call's groups ({call} prompts) go out as they finish without waiting "
            "for acks",
        )
    b.choose(
        "learner.tis_cap",
        TIS_CAP,
        "truncated importance sampling against the engine's log-probs (vLLM's bf16 kernels "
        "are not the learner's)",
    )
    floor = int(b.value("learner.max_staleness"))
    if floor > 0:
        b.choose(
            "learner.max_staleness_from_lag",
            max(STALENESS_FROM_LAG, floor),
            f"the staleness bound follows the measured weight-delivery lag (+1, from "
            f"max_staleness={floor}): groups generated while a version was on its way are "
            "trained with tis_cap, not dropped",
        )


def _stop_ids(
    b: _Builder, model_config: Mapping[str, Any], generation_config: Mapping[str, Any] | None
) -> None:
    ids = eos_token_ids(generation_config, model_config)
    if not ids:
        return
    if b.cfg.engine.name == "torch":
        if len(ids) > 1:
            b.warn(
                "engine",
                f"the model ends turns on {ids} (generation_config.json); engine=torch stops on "
                "the tokenizer's EOS only: use engine=vllm to stop on all of them",
            )
        return
    b.choose(
        "engine.vllm_stop_token_ids",
        ids,
        "every eos_token_id of generation_config.json, with the tokenizer's EOS",
    )
