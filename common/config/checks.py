"""Validation helpers of the config sections: each failure is a ValueError quoting the value."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.config.actor import EngineConfig
    from common.config.env import EnvConfig
    from common.config.learner import LearnerConfig


def require(ok: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``ok``."""
    if not ok:
        raise ValueError(message)


def require_choice(key: str, value: str, choices: Collection[str]) -> None:
    """``value`` of the field ``key`` (``section.field``) is one of ``choices``."""
    require(value in choices, f"{key} must be one of {', '.join(choices)}; got {value!r}")


def require_at_least(section: str, obj: object, **bounds: float) -> None:
    """Each named field of ``obj`` is >= its bound (messages name ``section.field``)."""
    for name, bound in bounds.items():
        value = getattr(obj, name)
        require(value >= bound, f"{section}.{name} must be >= {bound}, got {value}")


def require_positive(section: str, obj: object, *names: str) -> None:
    """Each named field of ``obj`` is > 0."""
    for name in names:
        value = getattr(obj, name)
        require(value > 0, f"{section}.{name} must be > 0, got {value}")


def require_ordered(section: str, obj: object, low: str, high: str) -> None:
    """``1 <= low <= high`` for a pair of fields of ``obj`` (a range's two ends)."""
    lo, hi = getattr(obj, low), getattr(obj, high)
    require(1 <= lo <= hi, f"need 1 <= {section}.{low} <= {section}.{high}, got {lo} and {hi}")


def check_port(name: str, port: int) -> None:
    """A port field: a port number, 0 (any free one) or -1 (off)."""
    require(-1 <= port <= 65535, f"{name} must be a port, 0 (any free one) or -1 (off), got {port}")


def check_env_bounds(env: EnvConfig, learner: LearnerConfig, engine: EngineConfig) -> None:
    """An episode the actor may build is one the learner admits and the engine can hold: with an
    environment, ``env.max_total_tokens`` is at most ``learner.max_seq_tokens`` (when set) and,
    on vLLM, ``engine.vllm_max_model_len``; ``env.failure_reward`` is within
    ``learner.max_abs_reward``."""
    if not env.enabled:
        return
    require(
        not learner.max_seq_tokens or env.max_total_tokens <= learner.max_seq_tokens,
        f"env.max_total_tokens={env.max_total_tokens} must be <= learner.max_seq_tokens="
        f"{learner.max_seq_tokens}: the learner would refuse the longest episode as too_long",
    )
    require(
        engine.name != "vllm" or env.max_total_tokens <= engine.vllm_max_model_len,
        f"env.max_total_tokens={env.max_total_tokens} must be <= engine.vllm_max_model_len="
        f"{engine.vllm_max_model_len}: vLLM could not hold the longest episode",
    )
    require(
        abs(env.failure_reward) <= learner.max_abs_reward,
        f"env.failure_reward={env.failure_reward} must be within learner.max_abs_reward="
        f"{learner.max_abs_reward}: the learner would refuse the failed episode's group",
    )
