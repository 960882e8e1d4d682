"""The turn-request stream of multi-turn episodes (``RolloutEngine.serve``): one
:class:`TurnRequest` per model turn, whose prompt is the episode's whole token history so far,
answered by one :class:`TurnResult` once the turn is final (verified, when weights changed while
it was in flight). The actor's episode runner owns the turn loop and the environment; the engine
sees only token histories. :class:`TurnQueue` is the thread-safe source the runner feeds and the
engine's decode thread drains between decoding steps; :class:`EpisodeDone` tells the engine an
episode ended (its whole stream becomes an n-gram history source for later episodes of the same
task)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, TypeAlias

import numpy as np

TurnStop: TypeAlias = Literal["stop_id", "length"]
"""Why a turn ended: one of its stop ids (the last token), or its token budget."""


@dataclass(frozen=True)
class TurnRequest:
    """One model turn of an episode."""

    request_id: int
    """The caller's id, echoed in the :class:`TurnResult`."""
    prompt_ids: Sequence[int]
    """The whole history: the task prompt, earlier turns and environment tokens (at least one)."""
    max_new_tokens: int
    """This turn's token budget (at least one)."""
    stop_ids: frozenset[int]
    """The turn ends at the first of these it samples (EOS, the template's end of turn)."""
    draft_key: str
    """The task's id: the rows and earlier episodes n-gram drafts copy from (not the prompt,
    which differs between siblings after their first turn)."""
    group: int
    """The problem's index: first turns of one group share their prompt's KV."""
    first_turn: bool
    """Whether ``prompt_ids`` is the task prompt itself (no turn before it)."""

    def check(self) -> None:
        """Refuse a request the engine cannot answer (a bug in the caller, not bad luck)."""
        if len(self.prompt_ids) < 1:
            raise ValueError(f"turn request {self.request_id}: the prompt needs a token")
        if self.max_new_tokens < 1:
            raise ValueError(
                f"turn request {self.request_id}: max_new_tokens must be >= 1, "
                f"got {self.max_new_tokens}"
            )


@dataclass(frozen=True)
class TurnResult:
    """A finished turn: the tokens sampled, each with the behaviour log-prob it was drawn with
    and the policy version that drew it (after verification, the version that kept it)."""

    request_id: int
    token_ids: np.ndarray  # [T] int32, the stop id included when it ended the turn
    behaviour_logprobs: np.ndarray  # [T] float32
    token_versions: np.ndarray  # [T] int32
    stop: TurnStop


@dataclass(frozen=True)
class EpisodeDone:
    """An episode ended: ``sequence`` (its whole token stream, environment tokens included)
    becomes a history source of n-gram drafts for later episodes of ``draft_key``."""

    draft_key: str
    sequence: Sequence[int]


TurnItem: TypeAlias = TurnRequest | EpisodeDone
TurnCallback: TypeAlias = Callable[[TurnResult], None]
"""``on_turn(result)``: called on the engine's decode thread once a turn is final; must not
block (hand the result to the runner's own thread)."""


class TurnSource(Protocol):
    """What ``serve`` drains: thread-safe, read only by the decode thread."""

    @property
    def closed(self) -> bool:
        """No item will be added any more (those queued are still taken)."""
        ...

    def take(self, limit: int) -> list[TurnItem]:
        """Queued items in order, up to ``limit`` requests (episode ends do not count)."""
        ...

    def wait(self, timeout_s: float) -> None:
        """Return when an item is queued or the source closed, or after ``timeout_s``."""
        ...


class TurnQueue:
    """The :class:`TurnSource` an episode runner feeds from its own thread(s). ``waited_s``:
    the time ``serve`` spent in :meth:`wait`, i.e. with no row to decode (every episode with
    its environment, or none started yet)."""

    def __init__(self) -> None:
        self._items: deque[TurnItem] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self.waited_s = 0.0

    def put(self, item: TurnItem) -> None:
        """Queue a turn request (checked here, on the caller's thread) or an episode's end."""
        self.put_many([item])

    def put_many(self, items: Sequence[TurnItem]) -> None:
        """Queue several items at once: ``serve`` takes none of them before all are queued."""
        for item in items:
            if isinstance(item, TurnRequest):
                item.check()
        with self._ready:
            if self._closed:
                raise RuntimeError("the turn queue is closed: no item may be added")
            self._items.extend(items)
            self._ready.notify_all()

    def close(self) -> None:
        """Nothing more will be put; ``serve`` returns once the queued turns are done."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    @property
    def closed(self) -> bool:
        with self._ready:
            return self._closed

    def take(self, limit: int) -> list[TurnItem]:
        out: list[TurnItem] = []
        requests = 0
        with self._ready:
            while self._items:
                if isinstance(self._items[0], TurnRequest):
                    if requests >= limit:
                        break
                    requests += 1
                out.append(self._items.popleft())
        return out

    def wait(self, timeout_s: float) -> None:
        started = time.perf_counter()
        with self._ready:
            if not self._items and not self._closed:
                self._ready.wait(timeout_s)
        self.waited_s += time.perf_counter() - started

    def __len__(self) -> int:
        with self._ready:
            return len(self._items)
