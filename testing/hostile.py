"""Poisoned but well-formed frames: what a hostile or badly broken actor can send that passes (or
nearly passes) the wire codec, each with the learner's expected verdict; and frames far over the
learner's bounds (``oversized_frames``), which its socket must still read and count.

Shared by ``benchmarks/chaos.py`` (fault kind ``poisoned_frames``) and the tests of the learner's
admission (``tests/integration/test_hostile_frames.py``, ``tests/unit/learner/test_admission.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import zmq

from common.link.protocol import Ack, Completion, DecodeLimits, TrajectoryGroup, decode, encode


@dataclass(frozen=True)
class Poison:
    kind: str
    frame: bytes
    verdict: str
    """``refused``: decodes, acked as refused (``Ack.refused[reason]``), never trained;
    ``bad``: does not decode, never acked, counted as a bad frame."""
    reason: str
    """The refusal reason or the bad-frame reason the learner counts it under."""
    seq: int
    """The frame's seq (-1: it has none)."""


SHAPE = {"version": 0, "prompt_len": 4, "completion_len": 4, "reward": None}


def valid_group(actor_id: str, seq: int, group_size: int, **shape: Any) -> TrajectoryGroup:
    """A group the learner trains on: ``group_size`` completions, rewards that differ (so the
    step has a signal), tokens 1..4 (in every vocabulary the project builds). ``shape`` changes
    the keys of ``SHAPE``: the group's ``version``, ``prompt_len``, ``completion_len`` and one
    ``reward`` for every completion."""
    unknown = shape.keys() - SHAPE.keys()
    if unknown:
        raise TypeError(f"valid_group: unknown {sorted(unknown)}")
    version, prompt_len, completion_len, reward = (SHAPE | shape).values()
    rng = np.random.default_rng(seq)
    prompt_ids = rng.integers(1, 5, prompt_len, dtype=np.int32)  # drawn before the completions
    completions = [
        Completion(
            token_ids=rng.integers(1, 5, completion_len, dtype=np.int32),
            behaviour_logprobs=np.full(completion_len, -1.0, dtype=np.float32),
            token_versions=np.full(completion_len, version, dtype=np.int32),
            reward=float(i % 2) if reward is None else reward,
            finished=True,
        )
        for i in range(group_size)
    ]
    return TrajectoryGroup(actor_id, seq, f"hostile-{seq}", prompt_ids, version, completions, {})


def _rewire(group: TrajectoryGroup, **fields) -> bytes:
    """``group``'s wire map with top-level fields replaced (values ``encode`` would refuse)."""
    wire = msgpack.unpackb(encode(group), raw=False)
    wire.update(fields)
    return msgpack.packb(wire, use_bin_type=True)


def poisoned_frames(
    actor_id: str, group_size: int, context: int, latest_version: int, first_seq: int = 0
) -> list[Poison]:
    """One frame of every poisoned kind for a learner with this group size, model context and
    latest version; seqs from ``first_seq`` on, one per frame."""
    seqs = iter(range(first_seq, first_seq + 100))

    def group(**kw) -> tuple[int, TrajectoryGroup]:
        seq = next(seqs)
        return seq, valid_group(actor_id, seq, kw.pop("group_size", group_size), **kw)

    out: list[Poison] = []
    # A finite float64 that overflows float32: inf in the reward tensor, NaN in every weight.
    seq, g = group(reward=1e300)
    out.append(Poison("reward_1e300", encode(g), "refused", "reward_out_of_range", seq))
    seq, g = group(reward=-1e30)
    out.append(Poison("reward_huge", encode(g), "refused", "reward_out_of_range", seq))
    # Versions and seqs beyond int64 (the learner computes staleness in int64).
    seq, g = group()
    out.append(Poison("version_2**64-1", _rewire(g, version=2**64 - 1), "bad", "out_of_range", seq))
    seq, g = group()
    out.append(Poison("seq_2**64-1", _rewire(g, seq=2**64 - 1), "bad", "out_of_range", seq))
    # A version from the future: negative staleness.
    seq, g = group(version=latest_version + 1000)
    out.append(Poison("version_ahead", encode(g), "refused", "version_ahead", seq))
    seq, g = group()
    g.completions[0].token_versions[:] = latest_version + 1000
    out.append(Poison("token_version_ahead", encode(g), "refused", "version_ahead", seq))
    # Longer than the model's context: refused; far longer: does not even decode.
    seq, g = group(prompt_len=context + 1)
    out.append(Poison("longer_than_context", encode(g), "refused", "too_long", seq))
    seq, g = group(group_size=1, prompt_len=4 * context, completion_len=4 * context)
    out.append(Poison("far_longer_than_context", encode(g), "bad", "oversize", seq))
    # Completions that are not the run's group size.
    seq, g = group(group_size=group_size - 1)
    out.append(Poison("group_too_small", encode(g), "refused", "wrong_group_size", seq))
    seq, g = group(group_size=group_size + 1)
    out.append(Poison("group_too_large", encode(g), "refused", "wrong_group_size", seq))
    # Many tiny objects in a small frame: decoding stops at a valid frame's object count.
    seq = next(seqs)
    nested = {"v": 1, "type": "group", "completions": [["ab"] * 1000 for _ in range(32)]}
    out.append(Poison("nested_strings", msgpack.packb(nested), "bad", "oversize", seq))
    return out


MiB = 1 << 20


def oversized_frames(actor_id: str, first_seq: int = 0) -> list[Poison]:
    """Frames over the learner's decode bounds, every one ``bad`` for ``oversize``: too deep,
    too many map keys, too long an actor id, too many completions, and multi-MiB bombs (each
    within the 64 MiB ``learner.max_frame_bytes``, so the learner's socket reads and counts it;
    over the decode bound of any run whose valid groups are smaller)."""
    seqs = iter(range(first_seq, first_seq + 100))
    envelope = {"v": 1, "type": "group", "actor_id": actor_id}
    out = [Poison("nested_100000_deep", b"\x91" * 100_000 + b"\xc0", "bad", "oversize", -1)]
    keys = {**envelope, **{f"k{i}": 0 for i in range(200_000)}}
    out.append(Poison("200000_map_keys", msgpack.packb(keys), "bad", "oversize", -1))
    seq = next(seqs)
    g = valid_group(actor_id, seq, 1)
    out.append(Poison("1MB_actor_id", _rewire(g, actor_id="a" * MiB), "bad", "oversize", seq))
    seq = next(seqs)
    g = valid_group(actor_id, seq, 1025)
    out.append(Poison("1025_completions", encode(g), "bad", "oversize", seq))
    for mib in (16, 63):
        seq = next(seqs)
        bomb = msgpack.packb({**envelope, "seq": seq, "prompt_ids": bytes(mib * MiB - 64)})
        out.append(Poison(f"{mib}MiB_bomb", bomb, "bad", "oversize", seq))
    return out


def send_when_connected(dealer: zmq.Socket, parts: list[bytes], timeout_s: float = 60.0) -> None:
    """Send ``parts``, waiting for the connection (the DEALER runs with IMMEDIATE, so it refuses
    to queue while none is up) instead of dropping them."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            dealer.send_multipart(parts, zmq.NOBLOCK)
            return
        except zmq.Again:
            if time.monotonic() > deadline:
                raise TimeoutError("the learner did not accept the connection") from None
            time.sleep(0.01)


def replies(dealer: zmq.Socket, until: Callable[[list[Ack]], bool], timeout_s: float) -> list[Ack]:
    """The learner's acks to ``dealer``, until ``until(acks)`` holds or ``timeout_s`` passes."""
    acks: list[Ack] = []
    deadline = time.monotonic() + timeout_s
    while not until(acks) and time.monotonic() < deadline:
        if dealer.poll(100):
            message = decode(dealer.recv(), DecodeLimits(vocab_size=1))
            if not isinstance(message, Ack):
                raise AssertionError(f"the learner sent a {type(message).__name__}, not an ack")
            acks.append(message)
    return acks


def refused_seqs(acks: list[Ack]) -> dict[int, str]:
    """seq -> refusal reason, over ``acks``."""
    return {seq: reason for a in acks for reason, seqs in a.refused.items() for seq in seqs}
