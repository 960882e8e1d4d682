"""The one interface every rollout engine (torch, vLLM) implements (:class:`RolloutEngine`), and
the base both engines build on (:class:`EngineBase`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias

import numpy as np
import torch

from actors.engines.turns import TurnCallback, TurnSource


@dataclass
class Rollout:
    """One completion of one prompt."""

    token_ids: np.ndarray  # [T] int32, generated tokens only (EOS included when it ended the row)
    behaviour_logprobs: np.ndarray  # [T] float32, processed log-prob each token was sampled with
    token_versions: np.ndarray  # [T] int32, policy version that produced each token
    finished: bool
    """True when the completion ended with EOS, False when it hit the length budget."""


class StaleDraftError(RuntimeError):
    """A draft whose weights are not the target's version (or a version without the draft the
    engine drafts with): refused, never used."""


WeightSource: TypeAlias = Callable[[], tuple[int, Mapping[str, torch.Tensor]] | None]
"""Polled by ``generate`` while rollouts are in flight: ``(version, state_dict)`` when newer
weights are published, else None."""
GroupCallback: TypeAlias = Callable[[int, list[Rollout]], None]
"""``on_group(i, rollouts)``: the ``n`` completions of prompt ``i``, once they are all done."""


def prompt_key(prompt: Sequence[int]) -> str:
    """The key a prompt's rows and earlier completions are found under (n-gram drafting)."""
    return ",".join(map(str, prompt))


class RolloutEngine(Protocol):
    """The interface of a rollout engine (torch, vLLM)."""

    version: int
    """Policy version of the weights currently loaded."""

    def load_weights(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Swap in a new weights version (HF parameter names)."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        max_new_tokens: int,
        weight_source: WeightSource | None = None,
        on_group: GroupCallback | None = None,
    ) -> list[list[Rollout]]:
        """``n`` sampled completions for each prompt; result[i][j] is completion j of prompt i.

        ``weight_source`` is polled for new weights while rollouts are in flight.
        ``on_group(i, result[i])`` is called once per prompt, when its ``n`` completions are
        done: as soon as they are (continuous batching), or at the latest before returning."""
        ...

    def serve(
        self,
        source: TurnSource,
        weight_source: WeightSource | None = None,
        on_turn: TurnCallback | None = None,
    ) -> None:
        """Answer the turn requests of multi-turn episodes (:mod:`actors.engines.turns`) until
        ``source`` is closed and every turn taken is done, on the calling thread (the decode
        thread). Requests join the batch between decoding steps; ``on_turn(result)`` is called
        once per request, when its turn is final (verified, if weights changed while it was in
        flight), and must not block. ``weight_source`` is polled between steps, and while no
        turn is in flight (every episode waiting on its environment). The torch engine
        implements it; the vLLM engine raises ``NotImplementedError`` (a later issue)."""
        ...

    def stats(self, reset: bool = True) -> dict[str, float]:
        """Counters since the last reset (namespaced, e.g. ``actor/tokens_per_s``); resets them
        unless ``reset`` is False (a mid-call read, e.g. from ``on_group``)."""
        ...

    def greedy(self) -> AbstractContextManager[None]:
        """Inside the block ``generate`` decodes greedily (temperature 0: the argmax, through
        the same sampling and speculative paths); the run's sampling settings after it."""
        ...


class EngineBase:
    """What the engines share: the multi-turn refusal and greedy decoding. Each engine's own
    ``generate`` has :meth:`RolloutEngine.generate`'s signature."""

    def serve(self, *_args: Any, **_kwargs: Any) -> None:
        """See :meth:`RolloutEngine.serve`; an engine without a turn-request stream refuses."""
        raise NotImplementedError(
            f"{type(self).__name__} has no turn-request stream (serve) yet: multi-turn episodes "
            f"run on the torch engine (engine.name=torch)"
        )

    @contextmanager
    def greedy(self) -> Iterator[None]:
        """See :meth:`RolloutEngine.greedy`."""
        owner = self._sampling_owner()
        saved = owner.temperature
        owner.temperature = 0.0
        try:
            yield
        finally:
            owner.temperature = saved

    def _sampling_owner(self) -> Any:
        """The object whose ``temperature`` every draw of this engine reads."""
        return self
