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

Given ``on_snapshot``, each snapshot is also lent to it as a :class:`Snapshot` (the learner's
weights group broadcasts it, common/weights/publish/collective_sender.py): one copy of the weights serves both
paths. A lent snapshot's buffer is never refilled until its borrower releases it; the upload
process gets ``LENT_SLOTS`` more shared-memory slots for that, so neither side waits for the other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

import torch
import torch.multiprocessing

from common.model_args import Layout, without_tied_head
from common.policy_meta import policy_meta
from common.tokenizer import Tokenizer
from common.weights.connection import retry_redis
from common.weights.format import WeightsNonFinite
from common.weights.publish.upload import (
    PUBLISH_NICENESS,
    Snapshot,
    UploadProcess,
    new_slot,
    shm_free_bytes,
    slot_layout,
    slot_views,
)
from common.weights.publish.writer import WeightWriter

log = logging.getLogger(__name__)

LENT_SLOTS = 2
"""Shared-memory slots added for ``on_snapshot``: its borrower holds at most two snapshots (the
one it sends or sent last, and a newer one queued)."""


class PublishedPolicy(Protocol):
    """What the publisher reads of the policy: its layout (the manifest's meta), its state dict
    (each version) and its parameters (the default dtype). A ``Transformer``, or the learner's
    ``PolicyView`` over a sharded one (learner/versions.py)."""

    args: Layout

    def state_dict(self) -> Mapping[str, torch.Tensor]: ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...


def publish_dtype(model: PublishedPolicy, name: str = "") -> torch.dtype:
    """The dtype versions are published in: ``name``, or else the training dtype (that of the
    first floating parameter)."""
    if name:
        return getattr(torch, name)  # learner.publish_dtype: validated by the config
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


class Publisher:
    def __init__(
        self,
        store: WeightWriter,
        model: PublishedPolicy,
        tokenizer: Tokenizer,
        dtype: torch.dtype | None = None,
        max_inflight: int = 1,
        should_stop: Callable[[], bool] = lambda: False,
        on_published: Callable[[int], None] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        upload: str = "process",
        latest_wins: bool = False,
        on_snapshot: Callable[[Snapshot], None] | None = None,
    ) -> None:
        """``on_snapshot``: called with each snapshot, lent (see :class:`Snapshot`), on the thread
        that took it, before its upload; it must not block."""
        self.store = store
        self.model = model
        self.meta = policy_meta(model.args, tokenizer)
        self.dtype = dtype or publish_dtype(model)
        self.max_inflight = max_inflight
        self.should_stop = should_stop
        self.on_published = on_published
        self.on_snapshot = on_snapshot
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
        self._layout, self._slot_bytes = slot_layout(self._state(), self.dtype)
        self._child = self._upload_process(store, max_inflight, on_snapshot is not None)
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

    def _upload_process(
        self, store: WeightWriter, max_inflight: int, lends: bool
    ) -> UploadProcess | None:
        """The upload child for ``upload="process"``, its shared-memory slots sized for the
        versions in flight (+ the waiting one with ``latest_wins``, + ``LENT_SLOTS`` for a
        borrower); None otherwise, or on a thread instead when /dev/shm cannot hold them."""
        if self.upload != "process":
            return None
        slots = max_inflight + (1 if self.latest_wins else 0) + (LENT_SLOTS if lends else 0)
        need = slots * self._slot_bytes
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
            return None
        return UploadProcess(self, store, self._layout, self._slot_bytes, slots)

    @property
    def upload_pid(self) -> int | None:
        """The upload process's pid (``upload="process"``), else None."""
        return self._child.pid if self._child is not None else None

    def _state(self) -> dict[str, torch.Tensor]:
        """The policy's tensors as a version publishes them (a tied LM head left out)."""
        return without_tied_head(self.model.state_dict(), self.model.args)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A private CPU copy of the weights in the publish dtype (floating tensors only are
        cast), so the next optimizer step cannot change what is being uploaded."""
        return self._private().tensors

    def _private(self) -> Snapshot:
        """A snapshot in a buffer of its own, never refilled (its version: -1 until lent)."""
        payload = new_slot(self._layout, self._slot_bytes)
        tensors = slot_views(payload, self._layout)
        with torch.no_grad():
            for name, t in self._state().items():
                tensors[name].copy_(t.detach())
        return Snapshot(-1, payload, tensors)

    def _take(self, slot: int | None = None) -> Any:
        """The snapshot in the form the upload takes: a shared-memory slot's index for the
        upload process (``slot``, or a free one), else a private :class:`Snapshot`."""
        if self._child is None:
            return self._private()
        return self._child.fill(self._state(), slot)

    def _lend(self, version: int, payload: Any) -> None:
        """Hand the snapshot just taken (``_take``'s answer) to ``on_snapshot``. Its failure is
        logged, never the upload's: the Redis path goes on without it."""
        if self.on_snapshot is None:
            return
        if self._child is None:
            snapshot = Snapshot(version, payload.payload, payload.tensors)
        else:
            child, slot = self._child, payload
            child.hold(slot)
            snapshot = Snapshot(
                version, child.slots[slot], child.views[slot], lambda: child.release(slot)
            )
        try:
            self.on_snapshot(snapshot)
        except Exception:  # noqa: BLE001 - the borrower's error; the upload goes on
            log.exception("learner: version %d: on_snapshot failed", version)
            snapshot.release()

    def publish(self, version: int) -> None:
        self._raise_error()
        if self._child is not None:
            self._child.check_alive()
        if self._thread is None:
            snapshot = self._take()
            self._lend(version, snapshot)
            self._upload(version, snapshot)
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
                payload = self._take()
                self._lend(version, payload)
                self._queue.put((version, payload))

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
                    self._lend(version, payload)
                if self._child is not None:
                    self._child.send(version, payload)  # the reply finishes this version
                    handed_over = True
                else:
                    self._upload(version, payload)
            except Exception as e:  # noqa: BLE001 - handed to the learner's thread, raised there
                self._error = e
            finally:
                # Free the snapshot before the version counts as done, not when the next one
                # arrives: held across the next training step, it sat under that step's peak.
                item = payload = None
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
                slot = self._child.reuse(replaced[1])  # the upload process never saw it
            replaced = None  # a private copy is freed before the next one is taken
        try:
            payload = self._take(slot)
        except BaseException:
            if self._child is not None and slot is not None:
                self._child.release(slot)
            raise
        self._lend(version, payload)
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

    def _upload(self, version: int, snapshot: Snapshot) -> None:
        started = time.perf_counter()

        def upload() -> bool:
            self.store.publish(version, snapshot.tensors, meta=self.meta, snapshot=False)
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

    # The upload process's reports (upload.UploadOwner), from its reply thread.

    def upload_finished(self, version: int, outcome: str, detail: Any, nbytes: int) -> None:
        self.last_publish_bytes = nbytes or self.last_publish_bytes
        self._finished(version, outcome, detail)

    def upload_failed(self, error: BaseException) -> None:
        self._error = error

    def upload_done(self) -> None:
        self._done()

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
