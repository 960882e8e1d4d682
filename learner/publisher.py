"""Publishes the learner's policy as a new weights version in Redis, off the critical path
(docs/design.md §6.6): ``publish(version)`` takes a snapshot, and the upload runs in a child
process (``upload="process"``), on a thread (``"thread"``), or on the caller's thread
(``max_inflight=0``) while the next step trains; versions go out in order.

Given the ``optimizer``, the snapshot is taken on a publisher thread during the next step's
forward and backward: a pre-hook on ``optimizer.step`` waits until it is taken, so no update can
reach a version being copied. The learner otherwise waits only when ``max_inflight`` versions are
queued or uploading; with ``latest_wins`` it never does: a version published while that many are
in flight waits in one more snapshot (slot), and a newer one replaces it before its upload starts
(counted in ``skipped``). A delta's base is always a version that was uploaded (the uploader's
own last one). A non-finite version is refused by the store, logged and counted in
``refused``. Redis outages are retried where the upload runs, until ``should_stop``; any other
failure, and the death of the upload process, is raised at the next ``publish``/``flush``.
"""

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
from typing import Any

import torch
import torch.multiprocessing

import common.weights.format as weights_module
from common.model import Transformer
from common.policy_meta import policy_meta
from common.tokenizer import Tokenizer
from common.weights.connection import retry_redis
from common.weights.format import WeightsError, WeightsNonFinite
from learner.weight_writer import WeightWriter

log = logging.getLogger(__name__)

PUBLISH_NICENESS = 10
"""Nice value of the upload thread or process: a lower priority than the learner's threads."""


_ALIGN = 64  # bytes: each tensor of a shared-memory slot starts on a cache line


def publish_dtype(model: torch.nn.Module, name: str = "") -> torch.dtype:
    """The dtype versions are published in: ``name``, or else the training dtype (that of the
    first floating parameter)."""
    if name:
        return getattr(torch, name)  # learner.publish_dtype: validated by the config
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


@dataclass(frozen=True)
class _Entry:
    """Where one tensor of the state dict lies in a shared-memory slot."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _layout(state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype) -> tuple[list[_Entry], int]:
    """Where each tensor goes in a slot (floating ones in ``dtype``), and the slot's size."""
    entries, offset = [], 0
    for name, t in state_dict.items():
        cast = dtype if t.is_floating_point() else t.dtype
        nbytes = t.numel() * cast.itemsize
        entries.append(_Entry(name, cast, tuple(t.shape), offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return entries, max(1, offset)


def shm_free_bytes() -> int | None:
    """Free bytes in ``/dev/shm``, where shared-memory tensors live (None: no such mount)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _views(slot: torch.Tensor, layout: list[_Entry]) -> dict[str, torch.Tensor]:
    """The tensors of a slot (views into its bytes, no copy)."""
    return {
        e.name: slot[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in layout
    }


class Publisher:
    def __init__(
        self,
        store: WeightWriter,
        model: Transformer,
        tokenizer: Tokenizer,
        dtype: torch.dtype | None = None,
        max_inflight: int = 1,
        should_stop: Callable[[], bool] = lambda: False,
        on_published: Callable[[int], None] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        upload: str = "process",
        latest_wins: bool = False,
    ) -> None:
        self.store = store
        self.model = model
        self.meta = policy_meta(model.args, tokenizer)
        self.dtype = dtype or publish_dtype(model)
        self.max_inflight = max_inflight
        self.should_stop = should_stop
        self.on_published = on_published
        self.upload = upload if max_inflight > 0 else "caller"
        """Where uploads run: ``process``, ``thread``, or ``caller`` (``max_inflight=0``)."""
        self.last_publish_s = 0.0
        """Duration of the last upload (serialize, hash, write, commit), wherever it ran."""
        self.last_publish_bytes = 0
        """Bytes the last upload wrote (a delta's, or the full size)."""
        self.published_version = -1
        """The newest version whose upload finished (-1: none yet)."""
        self.refused = 0
        """Versions refused for non-finite weights (never published)."""
        self.latest_wins = latest_wins and max_inflight > 0
        self.skipped = 0
        """Versions replaced by a newer one before their upload started (``latest_wins``)."""
        self._pending: tuple[int, Any] | None = None  # latest_wins: the version waiting for room
        self._pending_lock = threading.Lock()
        self._error: BaseException | None = None
        self._queue: queue.Queue[tuple[int, Any] | None] = queue.Queue()
        self._snapshot_taken = threading.Event()
        self._snapshot_taken.set()
        self.snapshot_on_thread = optimizer is not None and max_inflight > 0
        if self.snapshot_on_thread:
            assert optimizer is not None
            optimizer.register_step_pre_hook(lambda *_: self.wait_snapshot())
        self._room = threading.Semaphore(max(1, max_inflight))
        self._child: _UploadProcess | None = None
        if self.upload == "process":
            layout, slot_bytes = _layout(model.state_dict(), self.dtype)
            slots = max_inflight + (1 if self.latest_wins else 0)  # + the waiting one
            need = slots * slot_bytes
            free = shm_free_bytes()
            if free is not None and need > free:
                log.warning(
                    "learner: uploading on a thread, not a process: %d snapshot slot(s) need "
                    "%.2f GB of shared memory and /dev/shm has %.2f GB free (raise the "
                    "container's shm_size, or set learner.publish_upload=thread)",
                    slots,
                    need / 1e9,
                    free / 1e9,
                )
                self.upload = "thread"
            else:
                self._child = _UploadProcess(self, store, layout, slot_bytes, slots)
        self._thread: threading.Thread | None = None
        if max_inflight > 0:
            self._thread = threading.Thread(
                target=self._worker, name="weights-publisher", daemon=True
            )
            self._thread.start()
        # latest_wins with the optimizer: a thread of its own takes the snapshots, so none waits
        # behind an upload running on the worker thread.
        self._stager: threading.Thread | None = None
        self._to_stage: queue.Queue[int | None] = queue.Queue()
        if self.latest_wins and self.snapshot_on_thread:
            self._stager = threading.Thread(
                target=self._stage_worker, name="weights-snapshot", daemon=True
            )
            self._stager.start()

    @property
    def upload_pid(self) -> int | None:
        """The upload process's pid (``upload="process"``), else None."""
        return self._child.pid if self._child is not None else None

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A private CPU copy of the weights in the publish dtype (floating tensors only are
        cast), so the next optimizer step cannot change what is being uploaded."""
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, t in self.model.state_dict().items():
                dtype = self.dtype if t.is_floating_point() else t.dtype
                out[name] = t.detach().to(device="cpu", dtype=dtype, copy=True)
        return out

    def _take(self, slot: int | None = None) -> Any:
        """The snapshot in the form the upload takes: a shared-memory slot's index for the
        upload process (``slot``, or a free one), else a private copy."""
        if self._child is None:
            return self.snapshot()
        return self._child.fill(self.model.state_dict(), slot)

    def publish(self, version: int) -> None:
        self._raise_error()
        if self._child is not None:
            self._child.check_alive()
        if self._thread is None:
            self._upload(version, self.snapshot())
            self._raise_error()
        elif self.latest_wins:
            if self._stager is not None:
                self._snapshot_taken.clear()  # set by the stager once it holds its copy
                self._to_stage.put(version)
            else:
                self._stage(version)
        else:
            self._room.acquire()  # waits only while max_inflight versions are in flight
            if self._error is not None:
                self._room.release()
                self._raise_error()
            if self.snapshot_on_thread:
                self._snapshot_taken.clear()  # set by the thread once it holds its copy
                self._queue.put((version, None))
            else:
                self._queue.put((version, self._take()))

    def wait_snapshot(self) -> None:
        """The optimizer's step pre-hook: block until the last version's snapshot is taken."""
        self._snapshot_taken.wait()

    @property
    def inflight(self) -> int:
        """Versions snapshotted whose upload has not finished."""
        if self._thread is None:
            return 0
        staging = self._to_stage.unfinished_tasks
        return self._queue.unfinished_tasks + (self._pending is not None) + staging

    def flush(self) -> None:
        """Wait until every queued version is uploaded (or refused)."""
        if self._thread is not None:
            self._to_stage.join()
            self._queue.join()  # a version waiting for room is queued before the last one ends
        self._raise_error()

    def close(self) -> None:
        """Upload what is queued, then stop the threads (and the upload process)."""
        if self._stager is not None and self._stager.is_alive():
            self._to_stage.join()
            self._to_stage.put(None)
            self._stager.join()
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()
            self._queue.put(None)
            self._thread.join()
        if self._child is not None:
            self._child.close()
        self._raise_error()

    # ------------------------------------------------------------------------------ internals

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _worker(self) -> None:
        # The upload yields to the training step where they share a core: lower this thread's
        # scheduling priority (Linux: a thread id is a process id for setpriority).
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PUBLISH_NICENESS)
        while (item := self._queue.get()) is not None:
            version, payload = item
            handed_over = False
            try:
                if payload is None:
                    try:
                        payload = self._take()
                    finally:
                        self._snapshot_taken.set()
                if self._child is not None:
                    self._child.send(version, payload)  # the reply finishes this version
                    handed_over = True
                else:
                    self._upload(version, payload)
            except Exception as e:  # noqa: BLE001 - handed to the learner's thread, raised there
                self._error = e
            finally:
                if not handed_over:
                    self._done()
        self._queue.task_done()

    def _done(self) -> None:
        self._room.release()
        self._dispatch()  # before task_done: a flush never sees nothing queued while one waits
        self._queue.task_done()

    # latest_wins: a version is staged (snapshotted) at once; it is queued for upload when there
    # is room, and until then a newer staged version replaces it.

    def _stage_worker(self) -> None:
        while (version := self._to_stage.get()) is not None:
            try:
                self._stage(version)
            except Exception as e:  # noqa: BLE001 - handed to the learner's thread, raised there
                self._error = e
            self._to_stage.task_done()  # first: a step that goes on sees the version staged
            self._snapshot_taken.set()
        self._to_stage.task_done()

    def _stage(self, version: int) -> None:
        with self._pending_lock:
            replaced, self._pending = self._pending, None
        slot = None
        if replaced is not None:
            self.skipped += 1
            log.info("learner: version %d replaced by %d before its upload", replaced[0], version)
            if self._child is not None:
                slot = replaced[1]  # refilled: the upload process never saw it
            replaced = None  # a private copy is freed before the next one is taken
        try:
            payload = self._take(slot)
        except BaseException:
            if self._child is not None and slot is not None:
                self._child.free.put(slot)
            raise
        with self._pending_lock:
            self._pending = (version, payload)
        self._dispatch()

    def _dispatch(self) -> None:
        """Queue the waiting version for upload if there is room."""
        if not self.latest_wins:
            return
        with self._pending_lock:
            if self._pending is None or not self._room.acquire(blocking=False):
                return
            item, self._pending = self._pending, None
            self._queue.put(item)

    def _upload(self, version: int, state: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()

        def upload() -> bool:
            self.store.publish(version, state, meta=self.meta, snapshot=False)
            return True

        try:
            done = retry_redis("learner", f"publishing version {version}", upload, self.should_stop)
        except WeightsNonFinite as e:
            self._finished(version, "refused", str(e))
            return
        except Exception as e:  # noqa: BLE001 - handed to the learner's thread, raised there
            self._error = e
            return
        if done is not None:
            self.last_publish_bytes = self.store.last_publish_bytes
            self._finished(version, "published", time.perf_counter() - started)

    def _finished(self, version: int, outcome: str, detail: Any) -> None:
        """One version's upload ended: ``published`` (detail: seconds) or ``refused``."""
        if outcome == "refused":
            self.refused += 1
            log.error("learner: version %d NOT published: %s", version, detail)
            return
        self.published_version = version
        self.last_publish_s = detail
        log.debug("published version %d in %.3fs", version, detail)
        if self.on_published is not None:
            self.on_published(version)


class _UploadProcess:
    """The upload side of a ``Publisher`` in a spawned child process.

    Snapshots go through ``max_inflight`` shared-memory slots (one flat byte buffer each, laid
    out once from the state dict); the publisher's thread fills a free slot and sends
    ``(version, slot)`` down a pipe. The child publishes from the slot with its own
    ``WeightWriter`` (so it also keeps the base of the next delta) and answers each version in
    order; a thread here takes the answers, frees the slots and reports to the ``Publisher``.
    """

    def __init__(
        self,
        publisher: Publisher,
        store: WeightWriter,
        layout: list[_Entry],
        slot_bytes: int,
        slots: int,
    ) -> None:
        self.publisher = publisher
        self.slots = [
            torch.empty(slot_bytes, dtype=torch.uint8).share_memory_() for _ in range(slots)
        ]
        self.views = [_views(slot, layout) for slot in self.slots]
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(slots):
            self.free.put(i)
        self.sent: deque[tuple[int, int]] = deque()  # (version, slot) awaiting an answer
        self.lock = threading.Lock()
        ctx = torch.multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(
            target=_upload_main,
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
        """Copy the weights into ``slot``, or into a free one (there is one: the publisher holds
        room for it)."""
        if slot is None:
            slot = self.free.get()
        views = self.views[slot]
        with torch.no_grad():
            for name, t in state_dict.items():
                views[name].copy_(t.detach())
        return slot

    def check_alive(self) -> None:
        if not self.process.is_alive():
            raise RuntimeError(self._died())

    def send(self, version: int, slot: int) -> None:
        with self.lock:
            if not self.process.is_alive():
                self.free.put(slot)
                raise RuntimeError(self._died())
            self.sent.append((version, slot))
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
                self.free.put(slot)
                if outcome == "error":
                    publisher._error = _rebuilt(detail)
                elif outcome != "stopped":
                    publisher.last_publish_bytes = nbytes or publisher.last_publish_bytes
                    publisher._finished(version, outcome, detail)
                publisher._done()
                continue
            if not ready and self.process.is_alive():
                continue
            # The child exited: on close, after its last answer; otherwise it died.
            with self.lock:
                lost = list(self.sent)
                self.sent.clear()
            if not self.closing or lost:
                publisher._error = RuntimeError(self._died())
                log.error("learner: %s", self._died())
            for _, slot in lost:
                self.free.put(slot)
                publisher._done()
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


def _upload_main(conn, recipe, slots, layout, meta, stop) -> None:
    """The upload process: publish each ``(version, slot)`` it is sent, answer in order."""
    with contextlib.suppress(OSError):
        os.nice(PUBLISH_NICENESS)
    torch.set_num_threads(1)
    store = WeightWriter.from_recipe(recipe)
    views = [_views(slot, layout) for slot in slots]
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


def _rebuilt(detail: tuple[str, str]) -> Exception:
    """The upload process's error on the learner's side: the same ``WeightsError`` class where
    it is one, else a RuntimeError that names it."""
    name, message = detail
    cls = getattr(weights_module, name, None)
    if isinstance(cls, type) and issubclass(cls, WeightsError):
        return cls(message)
    return RuntimeError(f"{name}: {message}")
