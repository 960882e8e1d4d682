"""How an actor notices new weights versions: a pub/sub subscription to the run's channel, with
polling of ``latest`` as a fallback (a missed message or a Redis restart must not leave an actor
behind)."""

from __future__ import annotations

import logging
import time

import redis

from common.weights.connection import REDIS_DOWN
from common.weights.keys import weights_channel, weights_latest_key
from common.weights.store import WeightStore

logger = logging.getLogger(__name__)


class VersionWatcher:
    """Reports versions of one run newer than the last it reported (``last_seen``)."""

    _MAX_BACKOFF_S = 5.0

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        last_seen: int | None = None,
        poll_interval_s: float = 1.0,
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.last_seen = last_seen
        self.poll_interval_s = poll_interval_s
        self._pubsub: redis.client.PubSub | None = None
        self._next_check = 0.0  # monotonic time of the next GET of `latest`
        self._backoff_s = 0.1

    @classmethod
    def of_store(
        cls, store: WeightStore, last_seen: int | None = None, poll_interval_s: float = 1.0
    ) -> VersionWatcher:
        """A watcher of ``store``'s run on its Redis, reporting versions newer than
        ``last_seen`` (None: any version)."""
        return cls(store.client, store.run_id, last_seen, poll_interval_s)

    def _is_new(self, version: int | None) -> bool:
        return version is not None and (self.last_seen is None or version > self.last_seen)

    def _subscribe(self) -> redis.client.PubSub:
        if self._pubsub is None:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(weights_channel(self.run_id))
            self._pubsub = pubsub
            # Check `latest` right after subscribing: a version announced before the
            # subscription took effect is then found by the GET, anything later by the message.
            self._next_check = 0.0
        return self._pubsub

    def _latest(self) -> int | None:
        raw = self.client.get(weights_latest_key(self.run_id))
        return int(raw) if raw is not None else None

    def poll(self, timeout_s: float) -> int | None:
        """The newest version > last seen (and remember it), or None after ``timeout_s``.

        Never raises on a lost connection: it logs, backs off and returns None, so the actor keeps
        generating with its current weights; the next call resubscribes.
        """
        deadline = time.monotonic() + timeout_s
        try:
            pubsub = self._subscribe()
            while True:
                now = time.monotonic()
                if now >= self._next_check:
                    self._next_check = now + self.poll_interval_s
                    latest = self._latest()
                    if self._is_new(latest):
                        return self._advance(latest)
                wait_s = min(deadline, self._next_check) - time.monotonic()
                message = pubsub.get_message(timeout=max(0.0, wait_s))
                if message is not None and message["type"] == "message":
                    # The message only wakes us; `latest` is the truth and may be newer still.
                    announced = int(message["data"])
                    latest = self._latest()
                    newest = max(announced, latest) if latest is not None else announced
                    if self._is_new(newest):
                        return self._advance(newest)
                if time.monotonic() >= deadline:
                    self._backoff_s = 0.1  # Redis answered: the next outage starts from scratch
                    return None
        except REDIS_DOWN as e:
            logger.warning(
                "weights watcher for run %r lost Redis (%s); retrying in %.1f s",
                self.run_id,
                e,
                self._backoff_s,
            )
            self._drop_subscription()
            time.sleep(max(0.0, min(self._backoff_s, deadline - time.monotonic())))
            self._backoff_s = min(self._backoff_s * 2, self._MAX_BACKOFF_S)
            return None

    def _advance(self, version: int) -> int:
        self.last_seen = version
        self._backoff_s = 0.1
        return version

    def _drop_subscription(self) -> None:
        if self._pubsub is not None:
            pubsub, self._pubsub = self._pubsub, None
            try:
                pubsub.close()
            except REDIS_DOWN as e:  # already broken; nothing else to release
                logger.debug("closing a broken pubsub: %s", e)

    def close(self) -> None:
        self._drop_subscription()

    def __enter__(self) -> VersionWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
