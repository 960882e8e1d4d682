"""FSDP2 tests on several ranks, real processes (gloo on the CPU): spawning the ranks, and the
process group each one joins."""

from __future__ import annotations

import contextlib
import faulthandler
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.multiprocessing as mp

from learner.distributed import DistContext, init_from_env, local_rank_env, shutdown
from ops.redis_server import find_free_port


def spawn_ranks(worker: Callable[..., None], *args: Any, world: int = 2) -> None:
    """``worker(rank, world, port, *args)`` in ``world`` fresh processes, ``port`` a free one for
    their group's rendezvous; returns when all have exited (raises if one failed)."""
    mp.spawn(worker, args=(world, find_free_port(), *args), nprocs=world)


@contextlib.contextmanager
def group_rank(rank: int, world: int, port: int) -> Iterator[DistContext]:
    """Within: this process is ``rank`` of a ``world``-rank group on ``port`` (one CPU thread);
    the group is shut down on the way out. A rank that aborts (a C++ ``std::terminate``) prints
    its Python stack to stderr first, as pytest's own process does."""
    faulthandler.enable()
    os.environ.update(local_rank_env(rank, world, port))
    torch.set_num_threads(1)
    ctx = init_from_env(timeout_s=120)
    try:
        assert ctx is not None, f"no process group for rank {rank} of {world}"
        yield ctx
    finally:
        shutdown()
