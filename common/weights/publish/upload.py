"""The upload side of the publisher (common/weights/publish/publisher.py): snapshots laid out
in shared-memory slots, and the child process that publishes them from there with its own
``WeightWriter``, answering each version in order."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.multiprocessing

import common.weights.format as weights_module
from common import heap
from common.weights.connection import retry_redis
from common.weights.format import WeightsError, WeightsNonFinite
from common.weights.publish.writer import WeightWriter

log = logging.getLogger(__name__)


class UploadOwner(Protocol):
    """What the upload process reports to (the ``Publisher``): each version's outcome in order,
    its own failure, and a slot of room freed; it asks whether to stop retrying Redis."""

    meta: dict[str, str]
    should_stop: Callable[[], bool]

    def upload_finished(self, version: int, outcome: str, detail: Any, nbytes: int) -> None: ...

    def upload_failed(self, error: BaseException) -> None: ...

    def upload_done(self) -> None: ...


PUBLISH_NICENESS = 10
"""Nice value of the upload thread or process: a lower priority than the learner's threads."""


_ALIGN = 64  # bytes: each tensor of a snapshot starts on a cache line


@dataclass(frozen=True)
class SlotEntry:
    """Where one tensor of the state dict lies in a shared-memory slot."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def slot_layout(
    state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> tuple[list[SlotEntry], int]:
    """Where each tensor goes in a slot (floating ones in ``dtype``), and the slot's size."""
    entries, offset = [], 0
    for name, t in state_dict.items():
        cast = dtype if t.is_floating_point() else t.dtype
        nbytes = t.numel() * cast.itemsize
        entries.append(SlotEntry(name, cast, tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return entries, max(1, offset)


def shm_free_bytes() -> int | None:
    """Free bytes in ``/dev/shm``, where shared-memory tensors live (None: no such mount)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def slot_views(slot: torch.Tensor, layout: list[SlotEntry]) -> dict[str, torch.Tensor]:
    """The tensors of a slot (views into its bytes, no copy)."""
    return {
        e.name: slot[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in layout
    }


def new_slot(layout: list[SlotEntry], slot_bytes: int) -> torch.Tensor:
    """An unfilled slot whose padding between tensors is zero (so its bytes depend on the tensors
    alone, whoever hashes the whole buffer)."""
    slot = torch.empty(slot_bytes, dtype=torch.uint8)
    ends = [e.offset + e.nbytes for e in layout]
    for end, start in zip(ends, [e.offset for e in layout[1:]] + [slot_bytes], strict=True):
        slot[end:start].zero_()
    return slot


class Snapshot:
    """One version as the publisher copied it: ``tensors``, the state dict in the publish dtype
    (floating tensors cast), are views into one byte buffer, ``payload``, each tensor 64-byte
    aligned and the padding zero. One lent by ``on_snapshot`` stays unchanged until
    :meth:`release`, which its borrower calls once it is done reading."""

    def __init__(
        self,
        version: int,
        payload: torch.Tensor,
        tensors: dict[str, torch.Tensor],
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self.version, self.payload, self.tensors = version, payload, tensors
        self._on_release = on_release
        self._lock = threading.Lock()

    def release(self) -> None:
        """The borrower is done: the publisher may refill the buffer (a second call is a no-op)."""
        with self._lock:
            on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release()


class UploadProcess:
    """The upload side of a ``Publisher`` in a spawned child process.

    Snapshots go through shared-memory slots (one flat byte buffer each, laid out once from the
    state dict); the publisher's thread fills a free slot and sends ``(version, slot)`` down a
    pipe. A slot is free again once its upload and every borrower (``Publisher._lend``) have
    released it. The child publishes from the slot with its own
    ``WeightWriter`` (so it also keeps the base of the next delta) and answers each version in
    order; a thread here takes the answers, frees the slots and reports to the ``Publisher``.
    """

    def __init__(
        self,
        publisher: UploadOwner,
        store: WeightWriter,
        layout: list[SlotEntry],
        slot_bytes: int,
        slots: int,
    ) -> None:
        self.publisher = publisher
        self.slots = [new_slot(layout, slot_bytes).share_memory_() for _ in range(slots)]
        self.views = [slot_views(slot, layout) for slot in self.slots]
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(slots):
            self.free.put(i)
        self.holders = [0] * slots  # the publisher's own hold, and each borrower's
        self.holders_lock = threading.Lock()
        self.sent: deque[tuple[int, int]] = deque()  # (version, slot) awaiting an answer
        self.lock = threading.Lock()
        ctx = torch.multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=upload_main,
            args=(child_conn, store.recipe(), self.slots, layout, publisher.meta, self.stop),
            name="weights-upload",
            daemon=True,
        )
        self.process.start()
        child_conn.close()
        self.pid = self.process.pid
        self.closing = False
        self.replies = threading.Thread(
            target=self._replies, name="weights-publisher-replies", daemon=True
        )
        self.replies.start()

    def fill(self, state_dict: Mapping[str, torch.Tensor], slot: int | None = None) -> int:
        """Copy the weights into ``slot`` (held by the publisher alone), or into a free one
        (there is one: the publisher holds room for it, and ``LENT_SLOTS`` for a borrower)."""
        if slot is None:
            slot = self.free.get()
            with self.holders_lock:
                self.holders[slot] = 1
        views = self.views[slot]
        with torch.no_grad():
            for name, t in state_dict.items():
                views[name].copy_(t.detach())
        return slot

    def hold(self, slot: int) -> None:
        """One more holder of ``slot``: it is not refilled until each has released it."""
        with self.holders_lock:
            self.holders[slot] += 1

    def release(self, slot: int) -> None:
        """One holder of ``slot`` is done; the last one frees it."""
        with self.holders_lock:
            self.holders[slot] -= 1
            freed = self.holders[slot] == 0
        if freed:
            self.free.put(slot)

    def reuse(self, slot: int) -> int | None:
        """``slot`` to refill if the publisher alone holds it, else None (released: a
        borrower still reads it, and a free slot is taken instead)."""
        with self.holders_lock:
            if self.holders[slot] == 1:
                return slot
        self.release(slot)
        return None

    def check_alive(self) -> None:
        if not self.process.is_alive():
            raise RuntimeError(self._died())

    def send(self, version: int, slot: int) -> None:
        with self.lock:
            if not self.process.is_alive():
                self.release(slot)
                raise RuntimeError(self._died())
            self.sent.append((version, slot))
        # A child killed after the check above breaks the pipe: the version is in ``sent``, so the
        # reply thread, which sees the child gone, reports the death and finishes the version
        # (raising here too would finish it twice and hide the death behind a BrokenPipeError).
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self.conn.send((version, slot))

    def _died(self) -> str:
        return (
            f"the weights upload process (pid {self.pid}) died with exit code "
            f"{self.process.exitcode}; versions in flight were not published"
        )

    def _replies(self) -> None:
        publisher = self.publisher
        while True:
            try:
                ready = self.conn.poll(0.2)
                reply = self.conn.recv() if ready else None
            except (EOFError, OSError):
                reply, ready = None, False
                self.process.join(timeout=5)
            if publisher.should_stop():
                self.stop.set()  # the child gives up retrying an unreachable Redis
            if reply is not None:
                version, slot, outcome, detail, nbytes = reply
                with self.lock:
                    self.sent.popleft()
                self.release(slot)
                if outcome == "error":
                    publisher.upload_failed(rebuilt_error(detail))
                elif outcome != "stopped":
                    publisher.upload_finished(version, outcome, detail, nbytes)
                publisher.upload_done()
                continue
            if not ready and self.process.is_alive():
                continue
            # The child exited: on close, after its last answer; otherwise it died.
            with self.lock:
                lost = list(self.sent)
                self.sent.clear()
            if not self.closing or lost:
                publisher.upload_failed(RuntimeError(self._died()))
                log.error("learner: %s", self._died())
            for _, slot in lost:
                self.release(slot)
                publisher.upload_done()
            return

    def close(self) -> None:
        self.closing = True
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.process.join(timeout=30)
            if self.process.is_alive():
                self.process.terminate()
                self.process.join(timeout=5)
        self.replies.join(timeout=5)
        self.conn.close()


def upload_main(conn, recipe, slots, layout, meta, stop) -> None:
    """The upload process: publish each ``(version, slot)`` it is sent, answer in order."""
    with contextlib.suppress(OSError):
        os.nice(PUBLISH_NICENESS)
    torch.set_num_threads(1)
    store = WeightWriter.from_recipe(recipe)
    views = [slot_views(slot, layout) for slot in slots]
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return  # the learner is gone
        if message is None:
            return
        version, slot = message
        started = time.perf_counter()

        def upload(version: int = version, slot: int = slot) -> bool:
            # The store keeps a copy as the next delta's base: the slot is refilled later.
            store.publish(version, views[slot], meta=meta, snapshot=True)
            return True

        try:
            done = retry_redis("learner", f"publishing version {version}", upload, stop.is_set)
            if done is None:
                reply = (version, slot, "stopped", None, 0)
            else:
                seconds = time.perf_counter() - started
                reply = (version, slot, "published", seconds, store.last_publish_bytes)
        except WeightsNonFinite as e:
            reply = (version, slot, "refused", str(e), 0)
        except Exception as e:  # noqa: BLE001 - reported to the learner, raised there
            reply = (version, slot, "error", (type(e).__name__, str(e)), 0)
        conn.send(reply)
        heap.trim()  # the serialised copy of the version back to the OS until the next one


def rebuilt_error(detail: tuple[str, str]) -> Exception:
    """The upload process's error on the learner's side: the same ``WeightsError`` class where
    it is one, else a RuntimeError that names it."""
    name, message = detail
    cls = getattr(weights_module, name, None)
    if isinstance(cls, type) and issubclass(cls, WeightsError):
        return cls(message)
    return RuntimeError(f"{name}: {message}")
