"""Publishes the learner's policy as a new weights version in Redis, off the critical path.

``publish(version)`` hands the version to a background thread, which snapshots the weights (one
bulk copy to CPU in the publish dtype), then serializes, hashes and uploads it while the next
step trains; versions go out in order. Given the ``optimizer``, the snapshot too runs on that
thread, during the next step's forward and backward: a pre-hook on ``optimizer.step`` waits until
it is taken, so no update can reach a version being copied. Without one, ``publish`` takes the
snapshot on the caller's thread. The learner waits only when ``max_inflight`` versions are
already queued or uploading (a bound on memory and on how far Redis may lag), or, rarely, at
that pre-hook. ``max_inflight=0`` publishes on the caller's thread.

The work on the thread is torch bulk ops (delta encoding), hashlib and socket writes, which all
release the GIL, so it overlaps a training step instead of taking turns with it.

A version with a non-finite weight is refused by the store before anything is written: it is
logged and counted in ``refused``, and never becomes visible to actors. Redis outages are
retried (``retry_redis``) on the thread; any other failure is raised on the learner's thread at
its next ``publish``/``flush``.

Design: docs/design.md §6.6.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import torch

from common.model import Transformer
from common.policy_meta import policy_meta
from common.tokenizer import Tokenizer
from common.weights import WeightsNonFinite, WeightStore, retry_redis

log = logging.getLogger(__name__)

PUBLISH_NICENESS = 10
"""Nice value of the upload thread: a lower scheduling priority than the learner's threads."""


def publish_dtype(model: torch.nn.Module, name: str = "") -> torch.dtype:
    """The dtype versions are published in: ``name``, or else the training dtype (that of the
    first floating parameter)."""
    if name:
        dtype = getattr(torch, name, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"publish dtype must be a floating torch dtype, got {name!r}")
        return dtype
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


class Publisher:
    def __init__(
        self,
        store: WeightStore,
        model: Transformer,
        tokenizer: Tokenizer,
        dtype: torch.dtype | None = None,
        max_inflight: int = 1,
        should_stop: Callable[[], bool] = lambda: False,
        on_published: Callable[[int], None] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        if max_inflight < 0:
            raise ValueError(f"max_inflight must be >= 0, got {max_inflight}")
        self.store = store
        self.model = model
        self.meta = policy_meta(model.args, tokenizer)
        self.dtype = dtype or publish_dtype(model)
        self.max_inflight = max_inflight
        self.should_stop = should_stop
        self.on_published = on_published
        self.last_publish_s = 0.0
        """Duration of the last upload (serialize, hash, write, commit), wherever it ran."""
        self.last_stall_s = 0.0
        """How long the last ``publish`` call held up its caller (snapshot + waiting for room)."""
        self.published_version = -1
        """The newest version whose upload finished (-1: none yet)."""
        self.refused = 0
        """Versions refused for non-finite weights (never published)."""
        self._error: BaseException | None = None
        self._queue: queue.Queue[tuple[int, dict[str, torch.Tensor] | None] | None] = queue.Queue()
        self._snapshot_taken = threading.Event()
        self._snapshot_taken.set()
        self.snapshot_on_thread = optimizer is not None and max_inflight > 0
        if self.snapshot_on_thread:
            assert optimizer is not None
            optimizer.register_step_pre_hook(lambda *_: self.wait_snapshot())
        self._room = threading.Semaphore(max(1, max_inflight))
        self._thread: threading.Thread | None = None
        if max_inflight > 0:
            self._thread = threading.Thread(
                target=self._worker, name="weights-publisher", daemon=True
            )
            self._thread.start()

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A private CPU copy of the weights in the publish dtype (floating tensors only are
        cast), so the next optimizer step cannot change what is being uploaded."""
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, t in self.model.state_dict().items():
                dtype = self.dtype if t.is_floating_point() else t.dtype
                out[name] = t.detach().to(device="cpu", dtype=dtype, copy=True)
        return out

    def publish(self, version: int) -> None:
        started = time.perf_counter()
        self._raise_error()
        if self._thread is None:
            self._upload(version, self.snapshot())
            self._raise_error()
        else:
            self._room.acquire()  # waits only while max_inflight versions are in flight
            self._raise_error_releasing()
            if self.snapshot_on_thread:
                self._snapshot_taken.clear()  # set by the thread once it holds its copy
                self._queue.put((version, None))
            else:
                self._queue.put((version, self.snapshot()))
        self.last_stall_s = time.perf_counter() - started

    def wait_snapshot(self) -> None:
        """Block until the last published version's snapshot is taken (the optimizer's step
        pre-hook: the weights may change after this)."""
        self._snapshot_taken.wait()

    @property
    def inflight(self) -> int:
        """Versions snapshotted whose upload has not finished."""
        return self._queue.unfinished_tasks if self._thread is not None else 0

    def flush(self) -> None:
        """Wait until every queued version is uploaded (or refused)."""
        if self._thread is not None:
            self._queue.join()
        self._raise_error()

    def close(self) -> None:
        """Upload what is queued, then stop the thread."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.join()
            self._queue.put(None)
            self._thread.join()
        self._raise_error()

    # ------------------------------------------------------------------------------ internals

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _raise_error_releasing(self) -> None:
        if self._error is not None:
            self._room.release()
            self._raise_error()

    def _worker(self) -> None:
        # The upload yields to the training step where they share a core: lower this thread's
        # scheduling priority (Linux: a thread id is a process id for setpriority).
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PUBLISH_NICENESS)
        while (item := self._queue.get()) is not None:
            try:
                version, state = item
                if state is None:
                    try:
                        state = self.snapshot()
                    finally:
                        self._snapshot_taken.set()
                self._upload(version, state)
            except Exception as e:  # noqa: BLE001 - handed to the learner's thread, raised there
                self._error = e
            finally:
                self._room.release()
                self._queue.task_done()
        self._queue.task_done()

    def _upload(self, version: int, state: dict[str, torch.Tensor]) -> None:
        started = time.perf_counter()

        def upload() -> bool:
            self.store.publish(version, state, meta=self.meta, snapshot=False)
            return True

        try:
            done = retry_redis("learner", f"publishing version {version}", upload, self.should_stop)
        except WeightsNonFinite as e:
            self.refused += 1
            log.error("learner: version %d NOT published: %s", version, e)
            return
        except Exception as e:  # noqa: BLE001 - handed to the learner's thread, raised there
            self._error = e
            return
        if done is None:
            return  # a stop came while Redis was away
        self.published_version = version
        self.last_publish_s = time.perf_counter() - started
        log.debug("published version %d in %.3fs", version, self.last_publish_s)
        if self.on_published is not None:
            self.on_published(version)
