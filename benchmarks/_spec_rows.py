"""What the torch engine's speed tables share (benchmarks/rollout_real.py and the GPU check's
engine rows, benchmarks/gpu_check/engine_stage.py): each row's tokens/s and its ratio to plain
decoding at one batch size, and the draft lengths an adaptive row chose. Imports nothing the GPU
machine lacks (benchmarks/gpu_check/__init__.py, ``ABSENT_ON_DEVICE``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from common import metric_names as mn

Epochs = list[dict[str, float]]
"""A row's stats, one dict per timed epoch (``engine.stats()``)."""
Median = Callable[[Epochs, str], float]
"""A row's figure over its epochs: ``median(epochs, key)``."""


def speeds(
    flat: dict[str, Any], engines: dict, batch: int, prefix: str, median: Median
) -> Iterator[tuple[str, str, Epochs, float, float]]:
    """Each row of ``engines`` (name: (engine, its epochs), ``none`` the plain row) at ``batch``:
    (name, key ``{prefix}_{name}_b{batch}``, epochs, tokens/s, ratio to the plain row's), its
    ``{key}_tokens_per_s`` and ``{key}_ratio`` written into ``flat`` first."""
    base = median(engines["none"][1], mn.ACTOR_TOKENS_PER_S)
    for name, (_, epochs) in engines.items():
        key = f"{prefix}_{name}_b{batch}"
        speed = median(epochs, mn.ACTOR_TOKENS_PER_S)
        flat[f"{key}_tokens_per_s"] = round(speed, 1)
        flat[f"{key}_ratio"] = round(speed / base, 3)
        yield name, key, epochs, speed, speed / base


def draft_lengths(epochs: Epochs) -> dict[str, float]:
    """The draft lengths a row chose, by length (the last epoch's ``spec/draft_len_*`` figures;
    empty for a row with a fixed length)."""
    return {
        k.removeprefix(mn.SPEC_DRAFT_LEN_PREFIX): round(v, 3)
        for k, v in epochs[-1].items()
        if k.startswith(mn.SPEC_DRAFT_LEN_PREFIX)
    }
