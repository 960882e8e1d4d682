"""An actor's weight feed: new versions are fetched, verified and decoded in the background while
the engine keeps decoding on the weights it has (docs/design.md §6.4).

The decode loop only takes what a feed already holds in memory; it never waits for the bytes.
A feed has this interface (:class:`WeightFeed`), whatever carries the bytes:

- ``poll() -> (version, state_dict) | None``: the newest version held ready that is newer than
  the last one handed out, at once (no I/O); None when there is none. The tensors follow
  :meth:`common.weights.fetch.reader.WeightReader.fetch`'s contract: verified, never to be modified in
  place.
- ``wait(timeout_s) -> (version, state_dict) | None``: the same, waiting up to ``timeout_s`` for
  one (the synchronous mode's idle wait).
- ``delivering``: True from the moment a version's transfer starts until it is ready (or
  refused); what :class:`StallMeter` measures against.
- ``stats() -> dict[str, float]``: ``common.metric_names`` keys: the last delivery's seconds
  (``actor/weight_fetch_s``), versions that failed (``actor/weight_fetch_failures``), versions
  replaced by a newer one before the engine took them (``actor/weight_superseded``).
- ``close()``: stop; the feed's thread is joined.

An unexpected error in the feed's thread stops it and is raised by every later ``poll`` or
``wait``. A version that fails its checks, has expired or cannot be read while Redis is away is
logged and counted, and the engine keeps its weights: the feed asks for that version (or a newer
one) again. The actor loop calls :func:`take`, which times each call with a :class:`StallMeter`,
and meters the engine's loads of what it took with :func:`meter_loads`.

:class:`ReadySlot` is that interface, for a feed's own threads to fill: the newest ready version
wins, and no version is handed out after a newer one.

:class:`RedisWeightFeed` is the Redis path: a :class:`~common.weights.fetch.watcher.VersionWatcher`
notices versions and a :class:`~common.weights.fetch.reader.WeightReader` fetches them (chunk checksums,
deltas, ``weights_sha256``, the host cache), on one thread that owns both.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol

import torch

from common import metric_names as mn
from common.weights.connection import REDIS_DOWN
from common.weights.fetch.reader import WeightReader
from common.weights.fetch.watcher import VersionWatcher
from common.weights.format import WeightsError

log = logging.getLogger(__name__)

Update = tuple[int, dict[str, torch.Tensor]]
"""A version and its state dict, as the engines' ``load_weights`` and ``weight_source`` take."""


class WeightFeed(Protocol):
    """What the actor loop takes new weights from (see the module docstring)."""

    @property
    def delivering(self) -> bool: ...

    def poll(self) -> Update | None: ...

    def wait(self, timeout_s: float) -> Update | None: ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...


class Fetched(NamedTuple):
    version: int
    state: dict[str, torch.Tensor]
    seconds: float
    """How long the fetch took (read, verify, decode)."""


def fetch_newer(
    store: WeightReader,
    watcher: VersionWatcher,
    current: int,
    timeout_s: float = 0.0,
    on_start: Callable[[int], None] | None = None,
) -> Fetched | None:
    """The newest published version if there is one newer than ``current`` (waiting at most
    ``timeout_s`` for one to be announced), fetched and verified; ``on_start(version)`` is
    called when its fetch begins. None when there is none, and when it cannot be loaded."""
    version = watcher.poll(timeout_s=timeout_s)
    if version is None or version <= current:
        return None
    if on_start is not None:
        on_start(version)
    started = time.perf_counter()
    try:
        got_version, state = store.fetch(version)
    except (WeightsError, *REDIS_DOWN) as e:
        # Refused (checksum/shape), expired or Redis away: keep the weights we have, and let the
        # watcher report this version (or a newer one) again on its next check of `latest`.
        log.warning("actor: cannot load version %d (%s); keeping version %d", version, e, current)
        watcher.last_seen = current
        return None
    return Fetched(got_version, state, time.perf_counter() - started)


class ReadySlot:
    """What every :class:`WeightFeed` holds between its threads and the decode loop: the newest
    ready version, ``poll``, ``wait``, ``delivering``, ``stats`` and ``close``.

    A feed's threads call :meth:`_start` when a version's transfer begins, then :meth:`_offer`
    with the verified state or :meth:`_failed`, and :meth:`_stopped` with an unexpected error
    (every later ``poll`` raises it). An offer no newer than the newest version ready or handed
    out is dropped; a newer one replaces a ready one the loop has not taken (counted as
    superseded). ``poll`` only takes the lock, which a thread holds for a few assignments, so the
    decode loop never waits on a transfer. ``current`` is the version the engine holds (-1:
    none); :meth:`_spawn` starts the feed's threads, which stop once ``_closing`` is set.
    """

    JOIN_TIMEOUT_S = 120.0
    """How long :meth:`close` waits for each thread."""

    def __init__(self, current: int) -> None:
        # Reentrant: a feed may count an offer under the same lock (CollectiveFeed's sources).
        self._cond = threading.Condition(threading.RLock())
        self._taken = current  # the newest version handed out
        self._ready: Update | None = None
        self._error: BaseException | None = None
        self._delivering = False
        self._closing = threading.Event()
        self._threads: list[threading.Thread] = []
        self.failures = 0
        self.superseded = 0
        self.last_fetch_s = 0.0

    @property
    def delivering(self) -> bool:
        """A version is on its way (its transfer started, not yet ready or refused)."""
        return self._delivering

    def poll(self) -> Update | None:
        """The newest ready version newer than the last handed out, at once; None if none."""
        with self._cond:
            if self._error is not None:
                raise self._error  # the thread has stopped: every later call raises too
            ready, self._ready = self._ready, None
            if ready is not None:
                self._taken = ready[0]
            return ready

    def wait(self, timeout_s: float) -> Update | None:
        """:meth:`poll`, waiting up to ``timeout_s`` for a version."""
        with self._cond:
            self._cond.wait_for(self._settled, timeout=timeout_s)
        return self.poll()

    def _settled(self) -> bool:
        """A version is ready, a thread failed, or the feed is closing (``wait`` returns)."""
        return self._ready is not None or self._error is not None or self._closing.is_set()

    def stats(self) -> dict[str, float]:
        return {
            mn.ACTOR_WEIGHT_FETCH_S: self.last_fetch_s,
            mn.ACTOR_WEIGHT_FETCH_FAILURES: self.failures,
            mn.ACTOR_WEIGHT_SUPERSEDED: self.superseded,
        }

    def close(self) -> None:
        """Stop the threads after the transfers in progress, and join them (each for at most
        ``JOIN_TIMEOUT_S``)."""
        self._closing.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=self.JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.warning(
                    "actor: %s did not stop within %.0f s", thread.name, self.JOIN_TIMEOUT_S
                )

    # ------------------------------------------------------------------ for the feed's threads

    def _spawn(self, *threads: tuple[str, Callable[[], None]]) -> None:
        """Start one daemon thread per ``(name, target)``."""
        for name, target in threads:
            thread = threading.Thread(target=target, name=name, daemon=True)
            self._threads.append(thread)
            thread.start()

    def _newest(self) -> int:
        """The newest version ready or handed out: a feed fetches only newer ones."""
        with self._cond:
            return self._ready[0] if self._ready is not None else self._taken

    def _start(self, version: int) -> None:
        self._delivering = True

    def _offer(self, version: int, state: dict[str, torch.Tensor], seconds: float) -> bool:
        """Hold ``version`` ready (fetched in ``seconds``) unless it is no newer than
        :meth:`_newest`; whether it was taken. Ends the delivery either way."""
        with self._cond:
            self._delivering = False
            if version <= self._newest():
                return False
            if self._ready is not None:
                self.superseded += 1
            self._ready = (version, state)
            self.last_fetch_s = seconds
            self._cond.notify_all()
            return True

    def _failed(self) -> None:
        """The delivery in progress, if any, failed: count it and end it."""
        with self._cond:
            if self._delivering:
                self.failures += 1
            self._delivering = False

    def _stopped(self, error: BaseException, what: str) -> None:
        """A thread stopped on ``error``: log it, and raise it from every later ``poll``."""
        log.exception("actor: %s stopped", what)
        with self._cond:
            self._error = error
            self._delivering = False
            self._cond.notify_all()


class RedisWeightFeed(ReadySlot):
    """The Redis path of :class:`WeightFeed`: a thread watches the run's versions and fetches
    each new one as it is announced; a version fetched before the engine took the previous one
    replaces it. ``current`` is the version the engine holds when the feed starts; the feed
    owns ``store`` and ``watcher`` until :meth:`close`."""

    def __init__(
        self, store: WeightReader, watcher: VersionWatcher, current: int, poll_s: float = 0.2
    ) -> None:
        super().__init__(current)
        self.store, self.watcher, self.poll_s = store, watcher, poll_s
        self._spawn(("weight-feed", self._run))

    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                got = fetch_newer(
                    self.store, self.watcher, self._newest(), self.poll_s, on_start=self._start
                )
                if got is not None:
                    self._offer(got.version, got.state, got.seconds)
                else:
                    self._failed()
        except Exception as e:  # noqa: BLE001 - raised on the decode loop's thread by poll()
            self._stopped(e, "the weight feed")


def take(feed: WeightFeed, meter: StallMeter, timeout_s: float = 0.0) -> Update | None:
    """What the decode loop calls for new weights: the feed's ready version, if any (waiting up
    to ``timeout_s``), the time spent here metered by ``meter``."""
    with meter.blocked(feed):
        return feed.wait(timeout_s) if timeout_s > 0 else feed.poll()


SWAP_METHODS = ("load_weights", "_swap")
"""Where an engine takes in a version on the decode thread: ``load_weights`` (between
``generate`` calls), and ``_swap``, which both engines (``actors/engines/torch/engine.py``,
handing the work to ``WeightSwapper.swap``; ``actors/engines/vllm/engine.py``) call when their weight source hands them a version mid-call:
the load, then the rows in flight aborted or verified against the new weights (delayed
verification's forward runs there)."""


def meter_loads(engine: object, meter: StallMeter, feed: WeightFeed) -> None:
    """Count ``engine``'s weight loads (:data:`SWAP_METHODS`) in ``meter`` as time the decode
    loop is blocked on weights (:meth:`StallMeter.loading`). Wrapped on the instance, so the
    engines need not know the meter; an engine without those methods is refused (its loads would
    go uncounted)."""
    missing = [name for name in SWAP_METHODS if not callable(getattr(engine, name, None))]
    if missing:
        raise TypeError(f"{type(engine).__name__} has no {', '.join(missing)}: cannot meter it")
    for name in SWAP_METHODS:
        method = getattr(engine, name)

        @functools.wraps(method)
        def metered(*args, _method=method, **kwargs):
            with meter.loading(feed):
                return _method(*args, **kwargs)

        setattr(engine, name, metered)


class StallMeter:
    """How long the decode loop is blocked on weights while a version is being delivered.

    Measured from inside the loop: :meth:`running` spans the loop, :meth:`blocked` each call
    that takes weights from the feed, :meth:`loading` each time the engine takes one in (its
    load, and the rows in flight verified or aborted: :func:`meter_loads`). At each of those
    points the meter reads the feed's ``delivering``; a stretch of the loop between two points
    belongs to a delivery when the feed was delivering at either end, and a load always does
    (for the loop a delivery ends when the engine holds the version). ``stall_s`` sums the
    blocked stretches of deliveries (taking and loading), ``loop_s`` all their stretches;
    ``stall_s / loop_s`` is the stall fraction (0 before any delivery). ``load_s`` sums every
    load's seconds, also those outside the loop (the first version, the synchronous mode's idle
    wait).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.stall_s = 0.0
        self.loop_s = 0.0
        self.load_s = 0.0
        self._mark: float | None = None  # the last point, while the loop runs
        self._delivering = False  # the feed's state at the last point
        self._blocked = False
        self._loading = False

    def _point(self, feed: WeightFeed) -> float:
        now, delivering = self.clock(), feed.delivering
        if self._mark is not None:
            if delivering or self._delivering or self._loading:
                self.loop_s += now - self._mark
                if self._blocked:
                    self.stall_s += now - self._mark
            self._mark = now
        self._delivering = delivering
        return now

    @contextlib.contextmanager
    def running(self, feed: WeightFeed) -> Iterator[None]:
        """The decode loop runs inside this block (outside it nothing is counted)."""
        self._mark, self._delivering = self.clock(), feed.delivering
        try:
            yield
        finally:
            self._point(feed)
            self._mark = None

    @contextlib.contextmanager
    def blocked(self, feed: WeightFeed, loading: bool = False) -> Iterator[None]:
        """The loop waits on ``feed`` inside this block (``loading``: the engine takes in a
        version, see :meth:`loading`). A block inside another counts as part of the outer one."""
        if self._blocked:
            yield
            return
        started = self._point(feed)
        self._blocked, self._loading = True, loading
        try:
            yield
        finally:
            ended = self._point(feed)
            if loading:
                self.load_s += ended - started
            self._blocked = self._loading = False

    def loading(self, feed: WeightFeed) -> contextlib.AbstractContextManager[None]:
        """The engine takes in a version inside this block: blocked, and part of a delivery
        whatever the feed is doing."""
        return self.blocked(feed, loading=True)

    @property
    def frac(self) -> float:
        return self.stall_s / self.loop_s if self.loop_s > 0 else 0.0

    def figures(self) -> dict[str, float]:
        return {
            mn.ACTOR_DECODE_STALL_S: self.stall_s,
            mn.ACTOR_DECODE_S_DURING_DELIVERY: self.loop_s,
            mn.ACTOR_DECODE_STALL_FRAC: self.frac,
            mn.ACTOR_WEIGHT_LOAD_S: self.load_s,
        }
