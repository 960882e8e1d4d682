"""The learner's publisher as a GPU run wires it, for tests and benchmarks of weight delivery."""

from __future__ import annotations

from typing import Any

import torch

from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer, Tokenizer
from common.weights.publish.publisher import PublishedPolicy, Publisher
from common.weights.publish.writer import WeightWriter


def bf16_publisher(
    store: WeightWriter, model: PublishedPolicy, tokenizer: Tokenizer | None = None, **kwargs: Any
) -> Publisher:
    """``model``'s publisher into ``store``: bf16 versions, one in flight, uploaded from shared
    memory by a process; ``kwargs`` go to :class:`Publisher` (``latest_wins``, callbacks...)."""
    return Publisher(
        store,
        model,
        tokenizer if tokenizer is not None else CharTokenizer(BUILTIN_ALPHABET),
        dtype=torch.bfloat16,
        max_inflight=1,
        upload="process",
        **kwargs,
    )
