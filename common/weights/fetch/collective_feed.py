"""An actor's weights versions over the learner's weights group, with Redis while it is not a
member (common/weights/collective.py).

``CollectiveFeed`` is a :class:`~common.weights.fetch.feed.WeightFeed` (its ready version is a
:class:`~common.weights.fetch.feed.ReadySlot`). Two background threads fill it: one joins
the group and receives broadcast versions (each checked against its collective manifest in Redis
before it is offered), the other follows Redis (``VersionWatcher``, ``WeightReader``) whenever the
actor is not a member: before it joins, when it cannot, and after the group is lost or the
learner left; and also while it is a member, once Redis ``latest`` has been ahead of the version
it holds for ``fallback_s`` (a version the sender failed to deliver: counted as
``actor/weight_group_fallbacks``). Joining takes the run's group secret from Redis and proves it
to the sender (common/weights/collective.py). A version that fails its checks is logged and
counted, and the feed keeps what it has. ``CollectiveReceiver`` is one membership of the group.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Self

import redis
import torch
import torch.distributed as dist

from common import metric_names as mn
from common.config import SpecRLConfig
from common.weights.collective import (
    HEARTBEAT_S,
    IDLE_TIMEOUT_S,
    OP_LEAVE,
    OP_NOOP,
    OP_REGROUP,
    OP_VERSION,
    CollectiveError,
    CollectiveLeft,
    WeightsGroup,
    bucket_ranges,
    bucket_sha256,
    check_device,
    check_received,
    gloo_host,
    hash_threads,
    read_manifest,
    slots,
    store_client,
    views,
)
from common.weights.connection import REDIS_DOWN
from common.weights.fetch.feed import ReadySlot, Update
from common.weights.fetch.reader import WeightReader
from common.weights.fetch.watcher import VersionWatcher
from common.weights.format import WeightsCorrupt, WeightsError
from common.weights.group_join import JOINS, await_answer, new_join_proof, read_secret

log = logging.getLogger(__name__)

State = dict[str, torch.Tensor]


class CollectiveReceiver:
    """One actor's membership of the weights group at ``address``: ``join``, then ``receive``
    until it raises ``CollectiveError`` (the group is gone: ``leave`` and join again)."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        address: str,
        *,
        join_timeout_s: float = 10.0,
        timeout_s: float = 60.0,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        device: str | torch.device = "cpu",
    ) -> None:
        self.client, self.run_id, self.address = client, run_id, address
        self.join_timeout_s, self.timeout_s = join_timeout_s, timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.device = torch.device(device)
        check_device(self.device)
        self.store: dist.TCPStore | None = None
        self._secret = ""
        self._bind: str | None = None  # where this member's gloo listens (gloo_host)
        self.group: WeightsGroup | None = None
        self.last_version_s = 0.0
        self.last_op = time.monotonic()
        """When the last operation of the group (a header, a bucket) completed."""
        """Seconds from the last version's header to its verified state."""
        self._hasher = ThreadPoolExecutor(hash_threads(), thread_name_prefix="weights-group-sha256")

    @property
    def epoch(self) -> int:
        return self.group.epoch if self.group is not None else 0

    def join(self) -> None:
        """Take a ticket, prove the run's secret (read from Redis) and build the epoch the
        sender answers with, then prove the secret over it (``CollectiveError`` if no sender
        answers within ``join_timeout_s``, or it refuses the ticket)."""
        self.leave()
        secret = read_secret(self.client, self.run_id)
        store = store_client(self.address, self.join_timeout_s)
        try:
            ticket = store.add(JOINS, 1)
            nonce, proof = new_join_proof(secret, self.run_id, ticket)
            store.set(f"proof/{ticket}", proof)
            # Signed for this nonce: an answer another local process wrote is not acted on.
            answer = await_answer(store, secret, self.run_id, ticket, nonce, self.join_timeout_s)
            epoch, rank, size = int(answer["epoch"]), int(answer["rank"]), int(answer["size"])
        except (RuntimeError, OSError, ValueError, KeyError, TypeError) as e:
            raise CollectiveError(f"could not join the weights group at {self.address}: {e}") from e
        self._bind = gloo_host(self.address, sender=False)
        group = WeightsGroup(store, epoch, rank, size, self.device, self.join_timeout_s, self._bind)
        group.authenticate(secret, self.run_id, self.join_timeout_s)
        self.group, self.store, self._secret = group, store, secret

    def leave(self) -> None:
        """Drop the group (its sockets close: the sender sees this member gone)."""
        self.group = None
        self.store = None

    def close(self) -> None:
        self.leave()
        self._hasher.shutdown(wait=False)

    def receive(self, held: int, on_start: Callable[[int], None] | None = None) -> Update | None:
        """The next operation of the group: a verified version newer than ``held``, or None (a
        heartbeat, a new epoch, a version not newer); ``on_start(version)`` when a newer one
        begins to arrive. ``WeightsError``: a version failed its
        checks (the group goes on); ``CollectiveError``: the group is gone; ``CollectiveLeft``:
        the learner closed it."""
        group = self.group
        if group is None or self.store is None:
            raise CollectiveError("not a member of the weights group")
        op, a, b, c = group.header(None, self.idle_timeout_s)
        self.last_op = time.monotonic()
        if op == OP_NOOP:
            return None
        if op == OP_LEAVE:
            self.leave()
            raise CollectiveLeft("the learner closed the weights group")
        if op == OP_REGROUP:
            self.group = None
            regrouped = WeightsGroup(
                self.store, a, group.rank, b, self.device, self.join_timeout_s, self._bind
            )
            regrouped.authenticate(self._secret, self.run_id, self.join_timeout_s)
            self.group = regrouped
            return None
        if op != OP_VERSION:
            raise CollectiveError(f"weights group: unknown operation {op}")
        return self._version(group, a, b, c, held, on_start)

    def _version(
        self,
        group: WeightsGroup,
        version: int,
        total: int,
        layout_len: int,
        held: int,
        on_start: Callable[[int], None] | None,
    ) -> Update | None:
        started = time.perf_counter()
        raw = torch.empty(layout_len, dtype=torch.uint8, device=self.device)
        group.broadcast(raw, self.timeout_s)
        try:
            layout = json.loads(raw.cpu().numpy().tobytes())
            entries = slots(layout)
            bucket_bytes = int(layout["bucket_bytes"])
        except (ValueError, KeyError, TypeError, WeightsCorrupt) as e:
            # Without the layout the buckets cannot be followed: the group cannot go on.
            raise CollectiveError(f"version {version}: unreadable layout: {e}") from e
        if layout.get("total_bytes") != total or bucket_bytes < 64:
            raise CollectiveError(f"version {version}: layout disagrees with its header")
        payload = torch.empty(total, dtype=torch.uint8, device=self.device)
        wanted = version > held
        if wanted and on_start is not None:
            on_start(version)
        hashing = []
        for start, end in bucket_ranges(total, bucket_bytes):
            bucket = payload[start:end]
            group.broadcast(bucket, self.timeout_s)
            self.last_op = time.monotonic()
            if wanted:
                hashing.append(self._hasher.submit(bucket_sha256, bucket))
        if not wanted:
            return None
        digests = [f.result() for f in hashing]
        manifest = read_manifest(self.client, self.run_id, version, self.timeout_s)
        check_received(self.run_id, version, layout, digests, manifest)
        self.last_version_s = time.perf_counter() - started
        return version, views(payload, entries)


class CollectiveFeed(ReadySlot):
    """A :class:`~common.weights.fetch.feed.WeightFeed` whose versions come from the weights group at
    ``address`` while the actor is a member, else from Redis through ``reader`` (``address``
    None: Redis only). ``current``: the version the engine holds (-1: none); ``rejoin_s``: the
    pause before joining again after a failed join or after the learner left; ``fallback_s``:
    how long Redis ``latest`` may be ahead of a member's newest version before the member
    fetches it from Redis."""

    JOIN_TIMEOUT_S = 5.0
    SILENT_S = 3 * HEARTBEAT_S

    def __init__(
        self,
        reader: WeightReader,
        address: str | None,
        *,
        current: int = -1,
        join_timeout_s: float = 10.0,
        rejoin_s: float = 10.0,
        timeout_s: float = 60.0,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        poll_interval_s: float = 1.0,
        fallback_s: float = 30.0,
        device: str | torch.device = "cpu",
    ) -> None:
        super().__init__(current)
        self.reader = reader
        self.address = address
        self.rejoin_s = rejoin_s
        self.poll_interval_s = poll_interval_s
        self.fallback_s = fallback_s
        self._member = threading.Event()
        self.counts = dict.fromkeys(
            (
                "collective",
                "redis",
                "refused",
                "joins",
                "join_failures",
                "group_losses",
                "fallbacks",
            ),
            0,
        )
        self.receiver = (
            CollectiveReceiver(
                reader.client,
                reader.run_id,
                address,
                join_timeout_s=join_timeout_s,
                timeout_s=timeout_s,
                idle_timeout_s=idle_timeout_s,
                device=device,
            )
            if address
            else None
        )
        self._spawn(("weights-feed-redis", self._redis))
        if self.receiver is not None:
            self._spawn(("weights-feed-group", self._group))

    @classmethod
    def from_config(cls, cfg: SpecRLConfig, reader: WeightReader, current: int = -1) -> Self:
        """The feed of ``actor.weights_group`` (Redis only when it is off)."""
        address = cfg.learner.weights_group_address if cfg.actor.weights_group else None
        return cls(
            reader,
            address,
            current=current,
            join_timeout_s=cfg.actor.weights_group_join_timeout_s,
            rejoin_s=cfg.actor.weights_group_join_timeout_s,
            timeout_s=cfg.learner.weights_group_timeout_s,
            fallback_s=cfg.actor.weights_group_fallback_s,
            device=cfg.actor.device,
        )

    @property
    def member(self) -> bool:
        """Whether the actor is in the weights group now."""
        return self._member.is_set()

    def _group_serves(self) -> bool:
        """A member whose group is live: an operation within ``SILENT_S``. A member whose group
        went silent (a peer gone without the others noticing yet: they wait for their timeout)
        takes versions from Redis meanwhile."""
        receiver = self.receiver
        return (
            self._member.is_set()
            and receiver is not None
            and time.monotonic() - receiver.last_op < self.SILENT_S
        )

    def stats(self) -> dict[str, float]:
        """:meth:`ReadySlot.stats` and the versions held ready by each path."""
        return {
            **super().stats(),
            mn.ACTOR_WEIGHT_VERSIONS_COLLECTIVE: self.counts["collective"],
            mn.ACTOR_WEIGHT_VERSIONS_REDIS: self.counts["redis"],
            mn.ACTOR_WEIGHT_GROUP_FALLBACKS: self.counts["fallbacks"],
        }

    def group_stats(self) -> dict[str, float]:
        """Versions by path (``collective``, ``redis``), ``refused`` by the group's checks,
        ``joins``, ``join_failures``, ``group_losses``, ``fallbacks`` (fetches from Redis as a
        member), ``member`` (0/1), ``epoch`` and the newest ``version`` held."""
        return {
            **self.counts,
            "member": int(self.member),
            "epoch": self.receiver.epoch if self.receiver is not None else 0,
            "version": self._newest(),
        }

    def close(self) -> None:
        """Stop both threads and leave the group. The group's thread stops at the next header
        (a heartbeat comes every few seconds); one still blocked after ``JOIN_TIMEOUT_S`` ends
        with the process."""
        super().close()
        if self.receiver is not None and not self._threads[-1].is_alive():
            self.receiver.close()

    def __enter__(self) -> CollectiveFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------------------- internals

    def _offer_from(self, source: str, version: int, state: State, seconds: float) -> None:
        """:meth:`_offer`, counting a version held ready by its ``source`` (under the same lock,
        so the count is in place when ``wait`` returns it)."""
        with self._cond:
            if self._offer(version, state, seconds):
                self.counts[source] += 1

    def _redis(self) -> None:
        """Follow Redis whenever the actor is not a member of the group; as a member, follow
        Redis ``latest`` too and fetch from Redis once it has been ahead of the newest version
        held for ``fallback_s``."""
        last_seen = self._taken if self._taken >= 0 else None
        latest = -1  # the newest version Redis announced
        behind_since: float | None = None  # since when, as a member, Redis has been ahead
        try:
            with VersionWatcher.of_store(self.reader, last_seen, self.poll_interval_s) as watcher:
                while not self._closing.is_set():
                    version = watcher.poll(timeout_s=0.25)
                    if version is not None:
                        latest = max(latest, version)
                    if latest <= self._newest():
                        behind_since = None
                        continue
                    fallback = False
                    if self._group_serves():
                        now = time.monotonic()
                        if behind_since is None:
                            behind_since = now
                        if now - behind_since < self.fallback_s:
                            continue
                        fallback = True
                        log.warning(
                            "actor: Redis has had version %d for %.1f s and the weights group "
                            "has not brought it; fetching it from Redis",
                            latest,
                            now - behind_since,
                        )
                    behind_since = None
                    if not self._fetch(watcher, latest, fallback):
                        latest = -1  # the watcher reports it again at its next check
        except Exception as e:  # noqa: BLE001 - raised on the decode loop's thread by poll()
            self._stopped(e, "the weight feed's Redis thread")

    def _fetch(self, watcher: VersionWatcher, version: int, fallback: bool = False) -> bool:
        """Fetch ``version`` from Redis unless the actor joined the group meanwhile (the group
        brings versions then; the watcher reports this one again should the actor leave), or,
        ``fallback``, as a member whose group did not bring it in time (counted). Whether it
        was fetched."""
        if not fallback and self._group_serves():
            watcher.last_seen = self._newest()
            return False
        self._start(version)
        started = time.perf_counter()
        try:
            got_version, state = self.reader.fetch(version)
        except (WeightsError, *REDIS_DOWN) as e:
            # Refused, expired or Redis away: keep what we have; the watcher reports it again.
            log.warning("actor: cannot load version %d from Redis (%s)", version, e)
            watcher.last_seen = self._newest()
            self._failed()
            return False
        if fallback:
            self.counts["fallbacks"] += 1
        self._offer_from("redis", got_version, state, time.perf_counter() - started)
        return True

    def _group(self) -> None:
        """Join, receive until the group is lost, join again."""
        receiver = self.receiver
        assert receiver is not None
        while not self._closing.is_set():
            try:
                receiver.join()
            except CollectiveError as e:
                self.counts["join_failures"] += 1
                log.info("actor: %s; taking versions from Redis", e)
                self._closing.wait(self.rejoin_s)
                continue
            self.counts["joins"] += 1
            receiver.last_op = time.monotonic()
            self._member.set()
            log.info("actor: joined the weights group (epoch %d)", receiver.epoch)
            pause = 0.0
            try:
                self._receive(receiver)
            except CollectiveLeft as e:
                log.info("actor: %s; taking versions from Redis", e)
                pause = self.rejoin_s
            except CollectiveError as e:
                self.counts["group_losses"] += 1
                log.warning("actor: weights group lost (%s); joining again", e)
            except Exception:  # noqa: BLE001 - the feed outlives one bad operation
                self.counts["group_losses"] += 1
                log.exception("actor: weights group receiver failed; joining again")
                pause = self.rejoin_s
            finally:
                self._failed()
                self._member.clear()
                receiver.leave()
            self._closing.wait(pause)

    def _receive(self, receiver: CollectiveReceiver) -> None:
        while not self._closing.is_set():
            try:
                got = receiver.receive(self._newest(), on_start=self._start)
            except CollectiveError:
                raise
            except (WeightsError, redis.RedisError) as e:
                self.counts["refused"] += 1
                self._failed()
                log.error("actor: refused a version from the weights group: %s", e)
                continue
            if got is not None:
                self._offer_from("collective", *got, receiver.last_version_s)
