"""What the learner publishes and how its versions stay monotonic: the policy view the Publisher
reads, the version mark kept beside the checkpoints, and the republisher that puts the current
version back when Redis has lost it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from common.entrypoint import StopFlag
from common.model_args import Layout
from common.weights.connection import REDIS_DOWN, retry_redis
from common.weights.format import WeightsError
from common.weights.store import WeightStore
from learner.distributed import DistContext, shards_finite, stream_full_state
from learner.policy import unwrap

log = logging.getLogger(__name__)


class PolicyView:
    """What the Publisher reads of the policy (``args``, ``state_dict()``, ``parameters()``).

    One process: the live model's state dict (the Publisher casts it as it copies). FSDP: the
    full state in the publish ``dtype`` that the last ``refresh`` streamed to rank 0's CPU (a
    collective every rank calls at the same point: each shard cast on its device, then gathered
    one tensor at a time into a buffer kept across versions; no full fp32 state is built), once
    every rank found its shards finite (a version that is not is never gathered). The
    republisher re-sends it without a collective. ``dtype`` None: the training dtype.

    The buffer is refilled only by the next ``refresh``, at the next publish, after the next
    optimizer step: the Publisher's snapshot of a version is taken before that step (its
    pre-hook waits for it)."""

    def __init__(
        self,
        model: nn.Module,
        args: Layout,
        dist: DistContext | None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.args = args
        self.dist = dist
        self.dtype = dtype or next(
            (p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32
        )
        self._full: dict[str, torch.Tensor] = {}
        self.refused = 0
        """Versions refused at ``refresh`` for non-finite shards (never gathered)."""

    def refresh(self) -> bool:
        """Take the new version (a collective under FSDP); False, with nothing gathered, when a
        rank's shards hold a NaN or an infinity (every rank gets the same answer)."""
        if self.dist is None:
            return True
        if not shards_finite(self.model, self.dist.device):
            self.refused += 1
            log.warning("learner: the weights are not finite; this version is not gathered")
            return False
        into = self._full if self.dist.is_main else None
        stream_full_state(self.model, self.dtype, into)
        return True

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._full if self.dist is not None else unwrap(self.model).state_dict()

    def parameters(self):
        if self.dist is None:
            return unwrap(self.model).parameters()
        return iter(self._full.values())


def write_version_mark(path: Path, version: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(version))
    tmp.replace(path)


def next_version(store: WeightStore, checkpointed: int, mark: Path, stop: StopFlag) -> int:
    """The first version this learner publishes. Versions only grow, across restarts too: it
    continues after the newest of the checkpoint's, what Redis holds, and what this run ever
    published (``mark``, kept beside the checkpoints: a private Redis may have lost everything)."""
    latest = retry_redis("learner", "reading the latest version", store.latest_version, stop)
    marked = int(mark.read_text()) if mark.is_file() else -1
    return max(checkpointed, latest if latest is not None else -1, marked) + 1


class Republisher:
    """Puts the current version back when Redis has lost it (restarted without persistence, or
    flushed), so actors that start meanwhile find weights. Checks at most every ``every_s``."""

    def __init__(
        self,
        store: WeightStore,
        publish: Callable[[], None],
        every_s: float = 2.0,
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        self.store = store
        self.publish = publish
        self.every_s = every_s
        self.busy = busy
        """True while a version is still uploading: it is not missing, just not there yet."""
        self.republished = 0
        self._next = time.monotonic() + every_s

    def check(self, version: int) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        try:
            latest = self.store.latest_version()
            if self.busy():
                return
            if latest is None or latest < version:
                log.warning(
                    "learner: Redis holds version %s, not %d (restarted?); republishing",
                    latest,
                    version,
                )
                self.publish()
                self.republished += 1
        except (*REDIS_DOWN, WeightsError) as e:
            log.warning("learner: cannot check or republish weights (%s); will retry", e)
