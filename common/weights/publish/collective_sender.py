"""The learner's side of the collective weights path (common/weights/collective.py): rank 0 of the
weights group, broadcasting each version to the actors that joined it while Redis keeps the
manifests.

In the learner, ``take(snapshot)`` queues the publisher's snapshot of a version
(common/weights/publish/publisher.py): published in bfloat16 on a CPU group, its buffer already is the payload
and is broadcast as it is, held (the publisher does not refill it) until a newer version is
sent; otherwise the sender's thread packs it and releases it at once. ``send(version, state)``
packs a state dict itself (floats cast to bfloat16), for use without a publisher. A thread of its
own admits joiners, broadcasts the newest queued version in buckets, writes its collective
manifest to Redis, and sends heartbeats while idle. Only joiners that prove they know the run's
group secret (kept in Redis by the sender, common/weights/collective.py) are admitted, and every
epoch checks each rank's proof again over the group before a version is sent. Versions not yet
started when a newer one comes are skipped (a member only wants the newest); after a new epoch forms, the newest version
is sent again, so a joiner gets it at once. A member that fails an operation ends the epoch; the
next forms from whoever asks again. Versions still go to Redis through the publisher for actors
outside the group, and for members the sender fails (they fall back to Redis when Redis is ahead
of them for long: common/weights/fetch/collective_feed.py). ``metrics()`` exports the sender's counters and its
errors as ``learner/weights_group_*`` (metrics.jsonl, Prometheus).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Mapping
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
import torch

from common import metric_names as mn
from common.config.learner import LearnerConfig
from common.weights.collective import (
    COLLECTIVE_FORMAT,
    DEFAULT_BUCKET_BYTES,
    HEARTBEAT_S,
    MANIFEST_TTL_S,
    OP_LEAVE,
    OP_NOOP,
    OP_REGROUP,
    OP_VERSION,
    WIRE_DTYPE,
    CollectiveError,
    WeightsGroup,
    bucket_ranges,
    bucket_sha256,
    check_device,
    collective_manifest_key,
    gloo_host,
    hash_threads,
    new_manifest,
    pack,
    slots,
    store_server,
    views,
    wire_layout,
)
from common.weights.format import WeightsError, WeightsNonFinite, check_finite
from common.weights.group_join import (
    JOINS,
    MAX_PROOFS,
    SECRET_TTL_S,
    group_secret_key,
    new_secret,
    proven_nonce,
    signed_answer,
)

if TYPE_CHECKING:
    from common.weights.publish.upload import Snapshot

log = logging.getLogger(__name__)

_PROOF_KEY = re.compile(r"proof/([0-9]{1,18})")


@dataclass
class _Version:
    """A version to broadcast: its payload once packed (``state`` until then)."""

    version: int
    layout: dict[str, Any]
    state: Mapping[str, torch.Tensor] | None = None
    payload: torch.Tensor | None = None
    lease: Snapshot | None = None  # the publisher's snapshot behind ``state`` or ``payload``
    digests: list[str] = field(default_factory=list)
    checked: bool = False  # its floats are finite
    manifest_written: bool = False


class CollectiveSender:
    """Rank 0 of a run's weights group, hosting its store at ``address`` (``host:port``)."""

    def __init__(
        self,
        client: redis.Redis,
        run_id: str,
        address: str,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        heartbeat_s: float = HEARTBEAT_S,
        device: str | torch.device = "cpu",
        allow_remote: bool = False,
    ) -> None:
        """``timeout_s`` bounds one broadcast, ``connect_timeout_s`` the forming of an epoch;
        ``allow_remote``: the store may listen on a host that is not loopback."""
        if bucket_bytes < 64:
            raise ValueError(f"bucket_bytes must be >= 64, got {bucket_bytes}")
        self.client, self.run_id, self.address = client, run_id, address
        self.bucket_bytes = int(bucket_bytes)
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.heartbeat_s = heartbeat_s
        self.device = torch.device(device)
        check_device(self.device)
        self.store = store_server(address, max(timeout_s, connect_timeout_s), allow_remote)
        self.store.add(JOINS, 0)
        # The run's group secret: joiners read it from Redis and prove they know it.
        self.secret = new_secret()
        self._secret_due = 0.0
        self._refresh_secret()
        self._group: WeightsGroup | None = None
        self._epoch = 0
        self._pending: _Version | None = None
        self._last: _Version | None = None  # the newest version sent: sent again to a new epoch
        self._queued_version = -1
        self._busy = False
        self._closing = False
        self._cond = threading.Condition()
        self._hasher = ThreadPoolExecutor(hash_threads(), thread_name_prefix="weights-group-sha256")
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="weights-group-finite")
        self.versions_sent = 0
        self.skipped = 0
        self.refused = 0
        self.group_losses = 0
        self.last_send_s = 0.0
        self.sent_version = -1
        self.joins_refused = 0
        self.errors = 0
        self.error_version = -1  # the version being sent when the last error came (-1: none)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="weights-group-sender", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(
        cls, cfg: LearnerConfig, client: redis.Redis, run_id: str, device: str | torch.device
    ) -> CollectiveSender:
        """The sender of ``learner.weights_group*`` (``device``: the learner's; the actors'
        must be of the same kind: CUDA for NCCL, CPU for gloo)."""
        return cls(
            client,
            run_id,
            cfg.weights_group_address,
            bucket_bytes=cfg.weights_group_bucket_mb * 2**20,
            timeout_s=cfg.weights_group_timeout_s,
            device=device,
            allow_remote=cfg.weights_group_allow_remote,
        )

    # ----------------------------------------------------------------------------- the caller

    def send(self, version: int, state: Mapping[str, torch.Tensor], copy: bool = True) -> None:
        """Queue ``version`` for the group. ``copy``: pack it now, on the caller's thread (a
        snapshot: the caller may change ``state`` afterwards); False: the caller hands ``state``
        over unchanged and the sender's thread packs it. Raises ``WeightsError`` unless versions
        grow."""
        self._claim(version)
        item = _Version(version, wire_layout(state, self.bucket_bytes))
        if copy:
            item.payload = pack(state, item.layout, self.device)
        else:
            item.state = state
        self._queue(item)

    def take(self, snapshot: Snapshot) -> bool:
        """Queue the publisher's ``snapshot`` of its version, without a copy on the caller's
        thread; the sender calls ``snapshot.release()`` once it no longer reads it. The version
        already queued again (the publisher republishing it) is released and ignored: False.
        Raises ``WeightsError`` (the snapshot released) if the version is older."""
        try:
            with self._cond:
                if snapshot.version == self._queued_version:
                    snapshot.release()
                    return False
            self._claim(snapshot.version)
            item = _Version(snapshot.version, wire_layout(snapshot.tensors, self.bucket_bytes))
        except BaseException:
            snapshot.release()
            raise
        item.lease = snapshot
        item.payload = self._as_payload(snapshot, item.layout)
        if item.payload is None:
            item.state = snapshot.tensors  # packed (cast, or copied to the device) on the thread
        self._queue(item)
        return True

    def _as_payload(self, snapshot: Snapshot, layout: dict[str, Any]) -> torch.Tensor | None:
        """The snapshot's buffer, if it already is the payload of ``layout`` on this device (same
        dtypes, same offsets; the publisher zeroes the padding), else None."""
        payload, total = snapshot.payload, int(layout["total_bytes"])
        if self.device.type != "cpu" or payload.device.type != "cpu":
            return None
        if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() < total:
            return None
        base = payload.data_ptr()
        for name, spec in layout["tensors"].items():
            t = snapshot.tensors[name]
            if t.is_floating_point() and t.dtype != WIRE_DTYPE:
                return None
            if t.data_ptr() - base != spec["offset"] or not t.is_contiguous():
                return None
        return payload[:total]

    def _claim(self, version: int) -> None:
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise WeightsError(f"version must be a non-negative int, got {version!r}")
        with self._cond:
            if version <= self._queued_version:
                raise WeightsError(
                    f"weights group: version {version} after {self._queued_version}; versions "
                    "only grow"
                )
            self._queued_version = version

    def _queue(self, item: _Version) -> None:
        with self._cond:
            replaced, self._pending = self._pending, item
            if replaced is not None:
                self.skipped += 1
            self._cond.notify_all()
        _release(replaced)

    def flush(self, timeout_s: float = 600.0) -> bool:
        """Wait until the queued version has been sent (or given up on); False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._pending is None and not self._busy, timeout=timeout_s
            )

    @property
    def members(self) -> int:
        """Actors in the current epoch (0: no group)."""
        group = self._group
        return group.size - 1 if group is not None else 0

    def stats(self) -> dict[str, float]:
        return {
            "members": self.members,
            "epoch": self._epoch,
            "versions_sent": self.versions_sent,
            "sent_version": self.sent_version,
            "skipped": self.skipped,
            "refused": self.refused,
            "group_losses": self.group_losses,
            "last_send_s": self.last_send_s,
            "joins_refused": self.joins_refused,
            "errors": self.errors,
            "error_version": self.error_version,
        }

    def metrics(self) -> dict[str, float]:
        """:meth:`stats` under the learner's metric names (metrics.jsonl and Prometheus)."""
        stats = self.stats()
        return {name: stats[key] for key, name in _METRICS.items()}

    def close(self) -> None:
        """Tell the members the learner leaves, then stop (members fall back to Redis)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=self.timeout_s + 10)
        self._hasher.shutdown(wait=True)
        self._checker.shutdown(wait=True)
        if not self._thread.is_alive():
            with self._cond:
                held, self._pending, self._last = [self._pending, self._last], None, None
            for item in held:
                _release(item)

    def __enter__(self) -> CollectiveSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- the thread

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._pending is None and not self._closing:
                    self._cond.wait(timeout=self.heartbeat_s)
                item, self._pending = self._pending, None
                closing = self._closing
                self._busy = item is not None
                # The newest version replaces the last at once: the sender holds two at most.
                last = self._last
                if item is not None:
                    self._last = item
            if item is not None:
                _release(last)
            try:
                if closing:
                    self._leave()
                    return
                self._step(item)
            except Exception as e:  # noqa: BLE001 - the thread must outlive one bad version
                # Counted and exported (metrics()); members the version did not reach fetch it
                # from Redis once Redis has been ahead of them for long (collective_feed.py).
                log.exception("weights group: sender error")
                self.errors += 1
                self.error_version = item.version if item is not None else -1
                self.error = e
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _refresh_secret(self) -> None:
        """Put the group secret in Redis again (its time to live renewed; back after a Redis
        restart), at most once per heartbeat."""
        now = time.monotonic()
        if now < self._secret_due:
            return
        try:
            self.client.set(group_secret_key(self.run_id), self.secret, ex=SECRET_TTL_S)
            self._secret_due = now + min(self.heartbeat_s, SECRET_TTL_S / 4)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            log.warning("weights group: secret not written to Redis (%s); joins wait", e)
            self._secret_due = now + 1.0

    def _step(self, item: _Version | None) -> None:
        self._refresh_secret()
        regrouped = self._admit()
        if item is not None:
            if item.payload is None:  # handed over uncopied: packed here
                assert item.state is not None
                try:
                    item.payload = pack(item.state, item.layout, self.device)
                except BaseException:
                    self._drop(item)
                    raise
                item.state = None
                _release(item)  # the payload is the sender's own
        elif regrouped and self._last is not None:
            item = self._last  # the joiners want the newest version now
        if self._group is None:
            return  # kept as the newest: sent once a group forms
        if item is not None:
            self._broadcast(item)
        else:
            self._header([OP_NOOP, 0, 0, 0])

    def _proven(self) -> list[tuple[int, str]]:
        """``(ticket, nonce)`` of the joiners whose proof of the secret came since the last
        call; a wrong proof is refused (answered so, never admitted). Proofs are found by their
        keys, never by counting tickets: tickets taken without one (a flood of ``joins``) cost
        nothing and push no joiner out. At most ``MAX_PROOFS`` are read a round, the lowest
        tickets first; each key is deleted once read."""
        tickets = sorted(
            int(m.group(1)) for k in self.store.list_keys() if (m := _PROOF_KEY.fullmatch(k))
        )
        proven = []
        for ticket in tickets[:MAX_PROOFS]:
            key = f"proof/{ticket}"
            nonce = proven_nonce(self.secret, self.run_id, ticket, self.store.get(key))
            self.store.delete_key(key)
            if nonce is not None:
                proven.append((ticket, nonce))
                continue
            self.joins_refused += 1
            self.store.set(f"ticket/{ticket}", json.dumps({"refused": "wrong proof"}))
            if self.joins_refused & (self.joins_refused - 1) == 0:  # 1, 2, 4, ...: bounded logs
                log.warning(
                    "weights group: ticket %d refused: wrong proof of the run's secret (%d so far)",
                    ticket,
                    self.joins_refused,
                )
        return proven

    def _admit(self) -> bool:
        """Form a new epoch for actors that took a ticket (and proved the secret) since the last;
        True if one formed."""
        tickets = self._proven()
        if not tickets:
            return False
        epoch = self._epoch + 1
        first = self._group.size if self._group is not None else 1
        if self._group is not None:
            try:
                self._group.header([OP_REGROUP, epoch, first + len(tickets), 0], self.timeout_s)
            except CollectiveError as e:
                # Members that got the header wait for an epoch that never forms, then rejoin.
                log.warning("weights group: %s; the next epoch has the joiners only", e)
                self.group_losses += 1
                epoch, first = epoch + 1, 1
        size = first + len(tickets)
        for i, (ticket, nonce) in enumerate(tickets):
            answer = {"epoch": epoch, "rank": first + i, "size": size}
            signed = signed_answer(self.secret, self.run_id, ticket, nonce, answer)
            self.store.set(f"ticket/{ticket}", signed)
        self._group = None  # the old epoch's sockets close; its members moved on or failed
        self._epoch = epoch
        try:
            group = WeightsGroup(
                self.store,
                epoch,
                0,
                size,
                self.device,
                self.connect_timeout_s,
                gloo_host(self.address, sender=True),
            )
            group.authenticate(self.secret, self.run_id, self.connect_timeout_s)
        except CollectiveError as e:
            self.group_losses += 1
            log.warning("weights group: %s", e)
            return False
        self._group = group
        log.info("weights group: epoch %d formed with %d actor(s)", epoch, size - 1)
        return True

    def _header(self, values: list[int]) -> bool:
        assert self._group is not None
        try:
            self._group.header(values, self.timeout_s)
            return True
        except CollectiveError as e:
            self._lost(e)
            return False

    def _lost(self, error: CollectiveError) -> None:
        self.group_losses += 1
        log.warning("weights group: epoch %d lost (%s); members join again", self._epoch, error)
        self._group = None

    def _broadcast(self, item: _Version) -> None:
        """Header, layout, then the buckets (hashed on a helper thread as they go), then the
        collective manifest to Redis."""
        group = self._group
        assert group is not None and item.payload is not None
        started = time.perf_counter()
        layout = json.dumps(item.layout).encode()
        total = int(item.layout["total_bytes"])
        hashing = []
        # The finite check runs beside the broadcast: the manifest, written after both, decides.
        finite = None
        if not item.checked:
            tensors = views(item.payload, slots(item.layout))
            finite = self._checker.submit(check_finite, item.version, tensors)
        try:
            group.header([OP_VERSION, item.version, total, len(layout)], self.timeout_s)
            raw = torch.frombuffer(bytearray(layout), dtype=torch.uint8).to(self.device)
            group.broadcast(raw, self.timeout_s)
            for a, b in bucket_ranges(total, self.bucket_bytes):
                bucket = item.payload[a:b]
                if not item.digests:
                    hashing.append(self._hasher.submit(bucket_sha256, bucket))
                group.broadcast(bucket, self.timeout_s)
        except CollectiveError as e:
            self._lost(e)
        except BaseException:
            # Nothing reads the payload once this returns: it may go back to the publisher.
            futures.wait([*hashing, *([finite] if finite is not None else [])])
            raise
        if not item.digests:
            done = len(hashing)
            hashing += [
                self._hasher.submit(bucket_sha256, item.payload[a:b])
                for a, b in bucket_ranges(total, self.bucket_bytes)[done:]
            ]
            item.digests = [f.result() for f in hashing]
        if finite is not None:
            try:
                finite.result()
                item.checked = True
            except WeightsNonFinite as e:
                self._refuse(item, e)
                return
        self._write_manifest(item)
        if self._group is group:
            self.versions_sent += 1
            self.sent_version = item.version
            self.last_send_s = time.perf_counter() - started

    def _refuse(self, item: _Version, error: WeightsNonFinite) -> None:
        """A version with a non-finite float: its manifest says so, receivers refuse it."""
        self.refused += 1
        log.error("weights group: version %d refused: %s", item.version, error)
        refused = {"format": COLLECTIVE_FORMAT, "run_id": self.run_id, "version": item.version}
        self._set_manifest(item.version, refused | {"refused": str(error)})
        self._drop(item)

    def _drop(self, item: _Version) -> None:
        """``item`` is not sent again to a new epoch: released now."""
        with self._cond:
            if self._last is item:
                self._last = None
        _release(item)

    def _write_manifest(self, item: _Version) -> None:
        if not item.manifest_written:
            manifest = self._manifest(item.version, item.layout, item.digests)
            item.manifest_written = self._set_manifest(item.version, manifest)

    def _manifest(self, version: int, layout: dict[str, Any], digests: list[str]) -> dict[str, Any]:
        """The collective manifest of a version (what receivers check the bytes against)."""
        return new_manifest(self.run_id, version, layout, digests)

    def _set_manifest(self, version: int, manifest: dict[str, Any]) -> bool:
        try:
            self.client.set(
                collective_manifest_key(self.run_id, version),
                json.dumps(manifest),
                ex=MANIFEST_TTL_S,
            )
            return True
        except (redis.ConnectionError, redis.TimeoutError) as e:
            log.error("weights group: manifest of version %d not written: %s", version, e)
            return False

    def _leave(self) -> None:
        if self._group is not None:
            try:
                self._group.header([OP_LEAVE, 0, 0, 0], min(self.timeout_s, 5.0))
            except CollectiveError as e:
                log.info("weights group: members already gone at close (%s)", e)
            self._group = None
        log.info("weights group: closed at epoch %d", self._epoch)


_METRICS = {
    "members": mn.LEARNER_WEIGHTS_GROUP_MEMBERS,
    "epoch": mn.LEARNER_WEIGHTS_GROUP_EPOCH,
    "versions_sent": mn.LEARNER_WEIGHTS_GROUP_VERSIONS_SENT,
    "sent_version": mn.LEARNER_WEIGHTS_GROUP_SENT_VERSION,
    "skipped": mn.LEARNER_WEIGHTS_GROUP_SKIPPED,
    "refused": mn.LEARNER_WEIGHTS_GROUP_REFUSED,
    "group_losses": mn.LEARNER_WEIGHTS_GROUP_LOSSES,
    "last_send_s": mn.LEARNER_WEIGHTS_GROUP_SEND_S,
    "joins_refused": mn.LEARNER_WEIGHTS_GROUP_JOINS_REFUSED,
    "errors": mn.LEARNER_WEIGHTS_GROUP_ERRORS,
    "error_version": mn.LEARNER_WEIGHTS_GROUP_ERROR_VERSION,
}
"""``stats()`` key -> learner metric name."""


def _release(item: _Version | None) -> None:
    """Give ``item``'s snapshot back to the publisher (no-op without one, or a second time)."""
    if item is not None and item.lease is not None:
        lease, item.lease = item.lease, None
        lease.release()
