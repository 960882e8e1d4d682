"""The resolve step: the one place a process's config changes after it is composed.

A process composes its config from ``configs/`` and the command line (what the user asked
for; ``specrl run`` saves it as ``runs/<name>/config.yaml``), gathers the facts of the machine it
runs on (:class:`Facts`: the CUDA device, whether the CPU computes bf16 fast, the model's
config, the task's prompt lengths, the learner's memory) and calls :func:`resolve` once. Three
layers, in this order, each changing only what the user left unset:

1. ``gpu`` — the GPU profile (``common/config/gpu_profile.py``): on CUDA with a real model,
   the settings the model and device call for (learning rate, precision, lengths, rows).
2. ``precision`` — on a CPU without bf16 matrix instructions, bf16 compute moves to fp32
   (``common/cpu_precision.py`` says why: emulated bf16 is ~24x slower there).
3. ``memory`` — the learner's memory fit (``common/config/memory_fit.py``, ``learner.profile``):
   last, so it fits the precision the process will compute in, and never undoes a setting an
   earlier layer chose.

:func:`resolve` is pure: it returns a new config and the list of changes with their reasons;
it reads no device and writes nothing. The process logs :meth:`Resolution.table` and saves the
resolved config beside the asked one (``runs/<name>/resolved/<process>.yaml``,
:func:`common.process_start.save_resolved`); ``specrl run``'s preflight calls the same function, so
a refusal (an unusual learning rate, a learner that cannot fit its device) stops the run before
any process starts.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from common.config.gpu_profile import (
    Devices,
    GpuProfile,
    TaskFacts,
    explicit_keys,
    gpu_profile,
    named_keys,
    set_keys,
)
from common.config.memory_fit import MEMORY_FIELDS, Shape, Workload, choose, describe

if TYPE_CHECKING:
    from common.config import SpecRLConfig

Role = Literal["learner", "actor"]
ROLE_SECTIONS: dict[Role, tuple[str, ...]] = {
    "learner": ("learner", "run"),
    "actor": ("actor", "engine", "run"),
}
"""The config sections each process resolves (the GPU profile sets only these)."""
PRECISION_WHY = "this CPU has no bf16 matrix instructions (no AVX512-BF16 or AMX): bf16 is emulated"


@dataclass(frozen=True)
class MemoryFacts:
    """What the learner's memory fit needs: the model's shape and the memory of one device."""

    shape: Shape
    """The model's shape, from its ``config.json``."""
    available: float
    """Bytes of memory per device (the least over the learner's ranks)."""
    source: str
    """Where ``available`` comes from (for the table and a refusal)."""
    ranks: int = 1
    """Learner ranks (FSDP)."""
    model: str = "MODEL_DIR"
    """The model directory, as a refusal names it."""


@dataclass(frozen=True)
class Facts:
    """The machine and the inputs, as measured by the process (or by the launcher's preflight)."""

    role: Role
    """The process: ``learner`` or ``actor``."""
    devices: Devices = Devices(cuda=False)
    """The CUDA device the process computes on (``cuda=False``: the CPU)."""
    bf16_fast: bool = True
    """Whether the device this process computes on has bf16 matrix units."""
    model_config: Mapping[str, Any] | None = None
    """The model directory's ``config.json`` (None: the built-in model, or no directory yet)."""
    generation_config: Mapping[str, Any] | None = None
    """The model directory's ``generation_config.json``, if any."""
    task: TaskFacts = TaskFacts()
    """The task's longest prompt and generation budget (the GPU profile's lengths)."""
    memory: MemoryFacts | None = None
    """The learner's memory facts; None: no fit (``learner.profile=off``, an actor, unknown)."""


@dataclass(frozen=True)
class Change:
    """One setting the resolve step changed."""

    key: str
    """``section.field``."""
    before: Any
    """The value asked for."""
    after: Any
    """The value the process runs with."""
    layer: str
    """``gpu``, ``precision`` or ``memory``."""
    why: str
    """The reason, for the table."""


@dataclass
class Resolution:
    """The resolved config and what changed on the way, with the layers' warnings."""

    cfg: SpecRLConfig
    """The resolved config (a copy of the one asked for)."""
    changes: list[Change] = field(default_factory=list)
    """What changed, in the order the layers changed it."""
    warnings: list[str] = field(default_factory=list)
    """The GPU profile's warnings for this process's sections."""
    notes: list[str] = field(default_factory=list)
    """What the layers found, to log (the learner's memory estimate)."""
    profile: GpuProfile | None = None
    """The GPU profile, where one applied (its table is logged too)."""

    def table(self) -> str:
        """``key: before -> after (layer: why)``, one line per change."""
        if not self.changes:
            return "resolve step: nothing changed"
        width = max(len(c.key) for c in self.changes)
        lines = [f"resolve step: {len(self.changes)} settings changed"]
        lines += [
            f"  {c.key.ljust(width)}: {_shown(c.before)} -> {_shown(c.after)} ({c.layer}: {c.why})"
            for c in self.changes
        ]
        return "\n".join(lines)

    def changed(self) -> dict[str, Any]:
        """``key -> value`` of every change (the last one of a key)."""
        return {c.key: c.after for c in self.changes}


def resolve(cfg: SpecRLConfig, facts: Facts, overrides: Sequence[str]) -> Resolution:
    """The config ``facts.role``'s process runs with (a copy; ``cfg`` is not touched) and what
    changed (module docstring). Raises :class:`~common.config.gpu_profile.UnusualLearningRate`
    or :class:`~common.config.memory_fit.FitError` for a config that cannot run as asked."""
    out = Resolution(copy.deepcopy(cfg))
    _gpu_layer(out, cfg, facts, overrides)
    _precision_layer(out, facts, overrides)
    _memory_layer(out, facts)
    return out


def _record(
    out: Resolution, changes: Mapping[str, Any], layer: str, why: Mapping[str, str]
) -> None:
    """Set ``changes`` on ``out.cfg``, recording those that change a value."""
    for key, value in changes.items():
        before = get_key(out.cfg, key)
        if before != value:
            out.changes.append(Change(key, before, value, layer, why[key]))
    set_keys(out.cfg, dict(changes))


def get_key(cfg: SpecRLConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _gpu_layer(
    out: Resolution, asked: SpecRLConfig, facts: Facts, overrides: Sequence[str]
) -> None:
    if not (facts.devices.cuda and asked.run.gpu_profile and asked.model.path):
        return
    if facts.model_config is None or "hidden_size" not in facts.model_config:
        return
    profile = gpu_profile(
        facts.model_config,
        facts.generation_config,
        facts.devices,
        facts.task,
        asked,
        explicit_keys(overrides, asked),
    )
    sections = ROLE_SECTIONS[facts.role]
    why = {s.key: s.why for s in profile.settings}
    _record(out, profile.changes(sections), "gpu", why)
    out.warnings += profile.warnings_for(sections)
    out.profile = profile


def precision_changes(cfg: SpecRLConfig, overrides: Sequence[str], role: Role) -> dict[str, str]:
    """The settings moved to fp32 for ``role`` on a device without fast bf16: key -> new value
    (empty when bf16 is not in use or the user named the setting on the command line)."""
    changes: dict[str, str] = {}
    if role == "learner" and cfg.learner.precision != "fp32":
        changes["learner.precision"] = "fp32"
    engine = cfg.engine
    bf16_weights = cfg.learner.publish_dtype == "bfloat16"
    if role == "actor" and engine.name == "torch" and engine.torch_dtype == "auto" and bf16_weights:
        changes["engine.torch_dtype"] = "float32"
    named = named_keys(overrides)
    return {k: v for k, v in changes.items() if k not in named}


def _precision_layer(out: Resolution, facts: Facts, overrides: Sequence[str]) -> None:
    if facts.devices.cuda or facts.bf16_fast:
        return
    changes = precision_changes(out.cfg, overrides, facts.role)
    _record(out, changes, "precision", dict.fromkeys(changes, PRECISION_WHY))


def _memory_layer(out: Resolution, facts: Facts) -> None:
    lcfg = out.cfg.learner
    if facts.role != "learner" or facts.memory is None or lcfg.profile == "off":
        return
    mem = facts.memory
    work = Workload.of(out.cfg, mem.shape, mem.ranks)
    earlier = {c.key.split(".")[1] for c in out.changes if c.key.startswith("learner.")}
    if not (facts.devices.cuda or facts.bf16_fast):
        earlier.add("precision")  # never bf16 where it is emulated, even to fit
    fit = choose(
        mem.shape,
        work,
        lcfg,
        mem.available,
        mem.source,
        mem.model,
        keep=earlier & set(MEMORY_FIELDS),
    )
    estimate = (
        f"estimate {describe(fit.plan)} of {fit.usable / 2**30:.1f} GiB usable per device "
        f"({mem.source})"
    )
    picked = {f"learner.{name}": getattr(fit.profile, name) for name in MEMORY_FIELDS}
    before = len(out.changes)
    _record(
        out, picked, "memory", dict.fromkeys(picked, f"learner.profile={lcfg.profile}: {estimate}")
    )
    settings = ", ".join(f"{k}={_shown(v)}" for k, v in picked.items())
    changed = ", changed to fit" if len(out.changes) > before else ""
    out.notes.append(f"learner memory (profile {lcfg.profile}{changed}): {settings}; {estimate}")


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
