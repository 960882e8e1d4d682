"""Helpers for tests of the actor -> learner link: small groups, waiting on a condition, binding
a port that a just-closed socket may still hold, a started ``GroupReceiver`` and draining it, and a
hand-driven learner ROUTER."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import zmq

from common.link.protocol import (
    Ack,
    Completion,
    DecodeLimits,
    Heartbeat,
    TrajectoryGroup,
    decode,
    encode,
)
from common.link.receive.receiver import GroupReceiver, bind_router, bound_endpoint
from common.link.transport import ready

T = TypeVar("T")

VOCAB = 50
"""The vocabulary of the receivers these helpers start (``LIMITS``) and of ``make_group``."""
LIMITS = DecodeLimits(vocab_size=VOCAB)
ANY_PORT = "tcp://127.0.0.1:*"
"""A free port on the loopback, picked when the socket binds."""


def one_completion_group(
    token_ids: list[int],
    behaviour_logprobs: list[float],
    *,
    prompt_id: str,
    prompt_ids: list[int],
    reward: float,
    actor_id: str = "",
    seq: int = 0,
) -> TrajectoryGroup:
    """A version-0 group of one finished completion (every token of version 0)."""
    completion = Completion(
        token_ids=np.array(token_ids, dtype=np.int32),
        behaviour_logprobs=np.array(behaviour_logprobs, dtype=np.float32),
        token_versions=np.zeros(len(token_ids), dtype=np.int32),
        reward=reward,
        finished=True,
    )
    return TrajectoryGroup(
        actor_id=actor_id,
        seq=seq,
        prompt_id=prompt_id,
        prompt_ids=np.array(prompt_ids, dtype=np.int32),
        version=0,
        completions=[completion],
        stats={},
    )


def make_group(tag: int, actor_id: str = "", seq: int = 0) -> TrajectoryGroup:
    """A one-completion group told apart by ``tag``: prompt id ``prompt-{tag}``, reward ``tag``."""
    return one_completion_group(
        [tag % VOCAB, 4],
        [-0.5, -0.25],
        prompt_id=f"prompt-{tag}",
        prompt_ids=[1, 2, 3],
        reward=float(tag),
        actor_id=actor_id,
        seq=seq,
    )


def wait_until(
    cond: Callable[[], bool],
    timeout_s: float = 5.0,
    between: Callable[[], None] = lambda: time.sleep(0.005),
) -> None:
    """Check ``cond`` until it holds, running ``between`` after each miss; AssertionError after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        between()


def retry_bind(bind: Callable[[], T], timeout_s: float = 5.0) -> T:
    """``bind()``, retried while it fails with a zmq error (a just-closed socket may still hold
    the port) until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return bind()
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def drain(receiver: GroupReceiver, count: int, timeout_s: float = 10.0) -> list[TrajectoryGroup]:
    """Exactly ``count`` groups, failing on a deadline rather than hanging."""
    out: list[TrajectoryGroup] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < count:
        assert time.monotonic() < deadline, f"got {len(out)} of {count} groups"
        group = receiver.intake.get(timeout_s=0.05)
        if group is not None:
            out.append(group)
    return out


def start_receiver(address: str = ANY_PORT, timeout_s: float = 5.0, **kwargs) -> GroupReceiver:
    """Start a receiver, retrying while a just-closed socket still holds the port."""
    return retry_bind(lambda: GroupReceiver(address, LIMITS, **kwargs).start(), timeout_s)


class FakeLearner:
    """A bare ROUTER: records what arrives, acks only when told to."""

    def __init__(self, limits: DecodeLimits, address: str = ANY_PORT) -> None:
        self.limits = limits
        self.sock = bind_router(address)
        self.address = bound_endpoint(self.sock)
        self.groups: list[tuple[bytes, TrajectoryGroup]] = []
        self.heartbeats: list[Heartbeat] = []

    def pump(self, timeout_s: float = 0.05) -> None:
        """Record every message that arrives within ``timeout_s``."""
        if not self.sock.poll(int(timeout_s * 1000)):
            return
        for identity, frame in ready(self.sock.recv_multipart):
            msg = decode(frame, self.limits)
            if isinstance(msg, TrajectoryGroup):
                self.groups.append((identity, msg))
            elif isinstance(msg, Heartbeat):
                self.heartbeats.append(msg)

    def pump_until(self, cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
        wait_until(cond, timeout_s, between=self.pump)

    def ack(self, actor_id: str, seqs: list[int]) -> None:
        self.sock.send_multipart([actor_id.encode(), encode(Ack(actor_id=actor_id, seqs=seqs))])

    def seqs(self) -> list[int]:
        return [g.seq for _, g in self.groups]

    def close(self) -> None:
        self.sock.close(linger=0)
