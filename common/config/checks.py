"""Validation helpers of the config sections: each failure is a ValueError quoting the value."""

from __future__ import annotations

from collections.abc import Collection


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
