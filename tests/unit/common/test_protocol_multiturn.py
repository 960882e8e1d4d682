"""Protocol v2: multi-turn episodes on the wire (common/link/protocol.py, episode_checks.py).

An episode is one token stream after the prompt; tokens the policy did not sample carry version
-1 and log-prob 0.0, with optional ``turn_starts``, ``turn_rewards`` and ``stop``. Frames that
use any of it are v2; everything else keeps its v1 bytes.

Regenerate ``fixtures/group_v2.bin`` (only after a deliberate, versioned format change):
    SPECRL_REGEN_FIXTURES=1 .venv/bin/python -m pytest tests/unit/common/test_protocol_multiturn.py
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.link.episode_checks import FINISHED_STOPS, STOP_REASONS, uses_v2
from common.link.protocol import (
    EPISODE_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Ack,
    Completion,
    DecodeLimits,
    ProtocolError,
    TrajectoryGroup,
    decode,
    encode,
)
from common.link.receive.admission import Admission, wire_limits

ROOT = Path(__file__).resolve().parents[3]
LIMITS = DecodeLimits(vocab_size=100)
VOCAB = LIMITS.vocab_size
FIXTURES = Path(__file__).with_name("fixtures")
V1_DECODER_COMMIT = "9c78a74"
"""A commit whose protocol.py speaks v1 only: the learner an actor of this code may meet."""


def make_episode_group() -> TrajectoryGroup:
    """A fixed two-episode group: constants only, so its encoding is byte-stable."""
    return TrajectoryGroup(
        actor_id="actor-0",
        seq=11,
        prompt_id="lookup/7",
        prompt_ids=np.array([1, 2, 3], dtype=np.int32),
        version=3,
        completions=[
            Completion(  # turn 1 (v3), an observation of 3 tokens, turn 2 (v4); env ended it
                token_ids=np.array([10, 11, 50, 51, 52, 12, 13], dtype=np.int32),
                behaviour_logprobs=np.array(
                    [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0, -2.0], dtype=np.float32
                ),
                token_versions=np.array([3, 3, -1, -1, -1, 4, 4], dtype=np.int32),
                reward=1.0,
                finished=True,
                turn_starts=np.array([0, 5], dtype=np.int32),
                turn_rewards=np.array([0.0, 1.0], dtype=np.float32),
                stop="env_done",
            ),
            Completion(  # two one-token turns around one env token, cut by the turn limit
                token_ids=np.array([20, 60, 21], dtype=np.int32),
                behaviour_logprobs=np.array([-0.125, 0.0, -0.75], dtype=np.float32),
                token_versions=np.array([3, -1, 3], dtype=np.int32),
                reward=-0.5,
                finished=False,
                turn_starts=np.array([0, 2], dtype=np.int32),
                turn_rewards=np.array([0.5, -0.5], dtype=np.float32),
                stop="max_turns",
            ),
        ],
        stats={"actor/gen_s": 0.5},
    )


def make_single_turn_group() -> TrajectoryGroup:
    """A v1 group (every token sampled, no episode field)."""
    return TrajectoryGroup(
        actor_id="actor-0",
        seq=2,
        prompt_id="gsm8k/1",
        prompt_ids=np.array([1, 2], dtype=np.int32),
        version=0,
        completions=[
            Completion(
                token_ids=np.array([5, 6], dtype=np.int32),
                behaviour_logprobs=np.array([-1.0, -0.5], dtype=np.float32),
                token_versions=np.array([0, 1], dtype=np.int32),
                reward=0.0,
                finished=True,
            )
        ],
    )


def assert_same_episodes(a: TrajectoryGroup, b: TrajectoryGroup) -> None:
    assert (a.actor_id, a.seq, a.prompt_id, a.version, a.stats) == (
        b.actor_id,
        b.seq,
        b.prompt_id,
        b.version,
        b.stats,
    )
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    for ca, cb in zip(a.completions, b.completions, strict=True):
        for name in ("token_ids", "behaviour_logprobs", "token_versions"):
            np.testing.assert_array_equal(getattr(ca, name), getattr(cb, name))
        for name in ("turn_starts", "turn_rewards"):
            x, y = getattr(ca, name), getattr(cb, name)
            assert (x is None) == (y is None), name
            if x is not None:
                np.testing.assert_array_equal(x, y)
        assert (ca.reward, ca.finished, ca.stop) == (cb.reward, cb.finished, cb.stop)


def wire_of(frame: bytes) -> dict[str, Any]:
    return msgpack.unpackb(frame, raw=False)


def pack(wire: dict[str, Any]) -> bytes:
    return msgpack.packb(wire, use_bin_type=True)


# ------------------------------------------------------------------ round trips and fixtures


def test_round_trip_and_canonical_bytes() -> None:
    frame = encode(make_episode_group())
    wire = wire_of(frame)
    assert wire["v"] == EPISODE_PROTOCOL_VERSION == 2
    assert list(wire["completions"][0])[-3:] == ["turn_starts", "turn_rewards", "stop"]
    decoded = decode(frame, LIMITS)
    assert isinstance(decoded, TrajectoryGroup)
    assert_same_episodes(make_episode_group(), decoded)
    assert decoded.completions[0].turn_starts.dtype == np.int32
    assert decoded.completions[0].turn_rewards.dtype == np.float32
    # One encoding per message: decoding and encoding again gives the same bytes.
    assert encode(decoded) == frame


def test_stored_v2_fixture() -> None:
    path = FIXTURES / "group_v2.bin"
    frame = encode(make_episode_group())
    if os.environ.get("SPECRL_REGEN_FIXTURES") == "1":
        path.write_bytes(frame)
    stored = path.read_bytes()
    assert frame == stored, "wire format of v2 groups changed; bump the protocol version"
    decoded = decode(stored, LIMITS)
    assert isinstance(decoded, TrajectoryGroup)
    assert_same_episodes(make_episode_group(), decoded)
    assert encode(decoded) == stored


def test_v1_fixture_still_decodes_and_re_encodes_byte_identically() -> None:
    stored = (FIXTURES / "group_v1.bin").read_bytes()
    assert wire_of(stored)["v"] == PROTOCOL_VERSION == 1
    decoded = decode(stored, LIMITS)
    assert isinstance(decoded, TrajectoryGroup)
    assert all(
        (c.turn_starts, c.turn_rewards, c.stop) == (None, None, None) for c in decoded.completions
    )
    assert encode(decoded) == stored


@pytest.mark.parametrize(
    ("change", "v"),
    [
        (lambda c: None, 1),
        (lambda c: setattr(c, "stop", "eos"), 2),
        (lambda c: c.token_versions.__setitem__(slice(None), [0, -1, 0]), 2),
        (
            lambda c: (
                setattr(c, "turn_starts", np.array([0], np.int32)),
                setattr(c, "turn_rewards", np.array([0.5], np.float32)),
            ),
            2,
        ),
    ],
    ids=["single_turn", "stop_only", "env_token_only", "turns_only"],
)
def test_v2_is_written_only_for_an_episode_field(change: Callable, v: int) -> None:
    group = make_single_turn_group()
    c = group.completions[0]
    c.token_ids = np.array([5, 7, 6], np.int32)
    c.behaviour_logprobs = np.array([-1.0, 0.0, -0.5], np.float32)
    c.token_versions = np.array([0, 0, 0], np.int32)
    change(c)
    frame = encode(group)
    assert wire_of(frame)["v"] == v
    assert uses_v2(c) is (v == 2)
    decoded = decode(frame, LIMITS)
    assert isinstance(decoded, TrajectoryGroup)
    assert_same_episodes(group, decoded)
    assert encode(decoded) == frame


def test_acks_stay_v1() -> None:
    assert wire_of(encode(Ack(actor_id="a", seqs=[1])))["v"] == 1


# ------------------------------------------------------------------ refusals


def _completion(wire: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return wire["completions"][i]


def _set_array(i: int, key: str, values: list, dtype: str) -> Callable[[dict], None]:
    def mutate(wire: dict[str, Any]) -> None:
        _completion(wire, i)[key] = np.array(values, dtype=dtype).tobytes()

    return mutate


def _set(i: int, key: str, value: Any) -> Callable[[dict], None]:
    return lambda wire: _completion(wire, i).__setitem__(key, value)


def _drop(i: int, key: str) -> Callable[[dict], None]:
    return lambda wire: _completion(wire, i).pop(key)


def _both(*mutations: Callable[[dict], None]) -> Callable[[dict], None]:
    def mutate(wire: dict[str, Any]) -> None:
        for m in mutations:
            m(wire)

    return mutate


def _v1_wire() -> dict[str, Any]:
    return wire_of(encode(make_single_turn_group()))


V2_CASES = [
    # (id, mutation of the valid v2 wire, reason, a word of the detail)
    ("env_logprob_nonzero", _set_array(0, "behaviour_logprobs", [-0.5, -0.25, -0.5, 0, 0, -1, -2], "<f4"), "out_of_range", "log-prob 0.0"),
    ("version_minus_2", _set_array(1, "token_versions", [3, -2, 3], "<i4"), "out_of_range", ">= -1"),
    ("env_token_first", _both(
        _set_array(1, "token_versions", [-1, 3, 3], "<i4"),
        _set_array(1, "behaviour_logprobs", [0.0, -0.125, -0.75], "<f4"),
        _drop(1, "turn_starts"), _drop(1, "turn_rewards"),
    ), "bad_field", "starts and ends"),
    ("env_token_last", _both(
        _set_array(0, "token_versions", [3, 3, -1, -1, -1, 4, -1], "<i4"),
        _set_array(0, "behaviour_logprobs", [-0.5, -0.25, 0, 0, 0, -1, 0], "<f4"),
    ), "bad_field", "starts and ends"),
    ("turn_starts_not_increasing", _set_array(0, "turn_starts", [0, 0], "<i4"), "bad_field", "increasing"),
    ("turn_starts_decreasing", _both(
        _set_array(0, "turn_starts", [0, 5, 1], "<i4"),
        _set_array(0, "turn_rewards", [0, 0, 1], "<f4"),
    ), "bad_field", "increasing"),
    ("turn_starts_not_from_0", _set_array(0, "turn_starts", [1, 5], "<i4"), "bad_field", "starts at 0"),
    ("turn_start_at_env_token", _set_array(0, "turn_starts", [0, 3], "<i4"), "bad_field", "not sampled"),
    ("turn_start_beyond_the_end", _set_array(0, "turn_starts", [0, 7], "<i4"), "bad_field", "beyond"),
    ("no_turn_in_an_episode", _both(
        _set_array(0, "turn_starts", [], "<i4"), _set_array(0, "turn_rewards", [], "<f4"),
    ), "bad_field", "at least one turn"),
    ("turn_starts_without_rewards", _drop(0, "turn_rewards"), "bad_field", "together"),
    ("turn_rewards_length", _set_array(0, "turn_rewards", [1.0], "<f4"), "length_mismatch", "turn_rewards 1"),
    ("turn_reward_nan", _set_array(0, "turn_rewards", [0.0, np.nan], "<f4"), "non_finite", "turn_rewards"),
    ("turn_reward_inf", _set_array(1, "turn_rewards", [np.inf, 0.0], "<f4"), "non_finite", "turn_rewards"),
    ("unknown_stop", _set(0, "stop", "timeout"), "bad_field", "not one of"),
    ("stop_disagrees_with_finished", _set(1, "stop", "eos"), "bad_field", "disagrees"),
    ("stop_not_a_string", _set(0, "stop", 3), "bad_field", "stop must be str"),
    ("turn_starts_not_bin", _set(0, "turn_starts", [0, 5]), "bad_field", "turn_starts must be bin"),
    ("unknown_episode_key", _set(0, "turn_versions", b""), "bad_field", "turn_versions"),
    ("group_version_above_oldest_sampled", lambda w: w.__setitem__("version", 4), "bad_field", "oldest sampled"),
    ("group_version_below_oldest_sampled", lambda w: w.__setitem__("version", 2), "bad_field", "oldest sampled"),
]  # fmt: skip

V1_CASES = [
    ("v1_with_env_version", _both(
        _set_array(0, "token_versions", [0, -1], "<i4"),
        _set_array(0, "behaviour_logprobs", [-1.0, 0.0], "<f4"),
    ), "out_of_range", ">= 0"),
    ("v1_with_stop", _set(0, "stop", "eos"), "bad_field", "extra ['stop']"),
    ("v1_with_turns", _both(
        _set_array(0, "turn_starts", [0], "<i4"), _set_array(0, "turn_rewards", [0.0], "<f4"),
    ), "bad_field", "turn_"),
    ("v2_without_an_episode_field", lambda w: w.__setitem__("v", 2), "wrong_version", "is v1"),
    ("v3", lambda w: w.__setitem__("v", 3), "wrong_version", "expected"),
]  # fmt: skip


def _refused(wire: dict[str, Any], limits: DecodeLimits = LIMITS) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(pack(wire), limits)
    return info.value


@pytest.mark.parametrize(
    ("mutate", "reason", "word"), [c[1:] for c in V2_CASES], ids=[c[0] for c in V2_CASES]
)
def test_bad_v2_frames_are_refused_with_their_reason(mutate: Callable, reason: str, word: str) -> None:  # fmt: skip
    wire = wire_of(encode(make_episode_group()))
    decode(pack(wire), LIMITS)  # the unmutated frame is valid
    mutate(wire)
    error = _refused(wire)
    assert (error.reason, word in error.detail) == (reason, True), error


@pytest.mark.parametrize(
    ("mutate", "reason", "word"), [c[1:] for c in V1_CASES], ids=[c[0] for c in V1_CASES]
)
def test_v1_frames_keep_the_v1_rules(mutate: Callable, reason: str, word: str) -> None:  # fmt: skip
    wire = _v1_wire()
    decode(pack(wire), LIMITS)
    mutate(wire)
    error = _refused(wire)
    assert (error.reason, word in error.detail) == (reason, True), error


def test_acks_and_heartbeats_are_v1_only() -> None:
    wire = wire_of(encode(Ack(actor_id="a", seqs=[1])))
    wire["v"] = 2
    assert _refused(wire).reason == "wrong_version"


def test_turns_beyond_max_turns_are_oversize() -> None:
    wire = wire_of(encode(make_episode_group()))
    assert decode(pack(wire), DecodeLimits(vocab_size=VOCAB, max_turns=2))
    assert _refused(wire, DecodeLimits(vocab_size=VOCAB, max_turns=1)).reason == "oversize"


def test_encode_refuses_an_invalid_episode() -> None:
    group = make_episode_group()
    group.completions[0].behaviour_logprobs[2] = -0.5  # an env token with a log-prob
    with pytest.raises(ProtocolError) as info:
        encode(group)
    assert info.value.reason == "out_of_range"
    group = make_episode_group()
    group.version = 4  # not the oldest sampled token's version
    with pytest.raises(ProtocolError) as info:
        encode(group)
    assert info.value.reason == "bad_field"


# ------------------------------------------------------------------ limits


def _maximal_episode(tokens: int, turns: int, stop: str) -> Completion:
    """``tokens`` tokens, ``turns`` one-token model turns first, then tokens alternating env and
    sampled (ending sampled)."""
    versions = np.zeros(tokens, np.int32)
    versions[turns:][::2] = -1
    versions[-1] = 0
    logprobs = np.where(versions < 0, 0.0, -1.5).astype(np.float32)
    return Completion(
        token_ids=np.full(tokens, 2**15 - 1, np.int32),
        behaviour_logprobs=logprobs,
        token_versions=versions,
        reward=-1.2345678901234567e300,
        finished=stop in FINISHED_STOPS,
        turn_starts=np.arange(turns, dtype=np.int32),
        turn_rewards=np.full(turns, np.float32(-3.3e38)),
        stop=stop,
    )


def _maximal_group(limits: DecodeLimits, turns: int) -> TrajectoryGroup:
    longest_stop = max(STOP_REASONS, key=len)
    name = "x" * limits.max_str_len
    return TrajectoryGroup(
        actor_id=name,
        seq=2**63 - 1,
        prompt_id=name,
        prompt_ids=np.full(limits.max_tokens, 2**15 - 1, np.int32),
        version=0,
        completions=[
            _maximal_episode(limits.max_tokens, turns, longest_stop)
            for _ in range(limits.max_completions)
        ],
        stats={f"{i:04d}".ljust(limits.max_str_len, "s"): -1e300 for i in range(limits.max_stats_entries)},
    )  # fmt: skip


def test_a_maximal_v2_group_fits_the_object_budget() -> None:
    # With few ack seqs the budget has no slack to hide a per-completion undercount in: a
    # completion costs 10 objects (its array item, its map, 8 keys).
    limits = DecodeLimits(
        vocab_size=2**15, max_completions=64, max_tokens=8, max_ack_seqs=1, max_stats_entries=0
    )
    decoded = decode(encode(_maximal_group(limits, turns=4), limits), limits)
    assert isinstance(decoded, TrajectoryGroup) and len(decoded.completions) == 64


@pytest.mark.parametrize("max_turns", [0, 16])
def test_a_maximal_v2_group_fits_the_learners_wire_limits(max_turns: int) -> None:
    admission = Admission(group_size=4, max_seq_tokens=64, max_abs_reward=100.0)
    limits, _ = wire_limits(2**15, admission, 64 << 20, max_turns=max_turns)
    # As many turns as the limits and the tokens allow: every token its own turn.
    turns = min(limits.max_turns, limits.max_tokens)
    group = _maximal_group(limits, turns)
    frame = encode(group)
    assert len(frame) <= limits.max_frame_bytes
    assert len(decode(frame, limits).completions) == limits.max_completions


# ------------------------------------------------------------------ an independent oracle


def _valid_by_hand(versions: list[int], logprobs: list[float], starts: list[int] | None,
                   n_rewards: int, rewards_finite: bool, stop: str | None, finished: bool,
                   group_version: int) -> str | None:  # fmt: skip
    """The v2 rules of docs/design.md §5.1 for a one-completion group, written as plain loops
    (the codec's are vectorised): the reason, or None when valid."""
    if any(v < -1 for v in versions):
        return "out_of_range"
    if any(v == -1 and lp != 0.0 for v, lp in zip(versions, logprobs, strict=True)):
        return "out_of_range"
    sampled = [v for v in versions if v >= 0]
    if sampled and min(sampled) != group_version:
        return "bad_field"
    if versions and (versions[0] == -1 or versions[-1] == -1):
        return "bad_field"
    if stop is not None and (stop not in STOP_REASONS or finished != (stop in FINISHED_STOPS)):
        return "bad_field"
    if starts is not None:
        if n_rewards != len(starts):
            return "length_mismatch"
        if not rewards_finite:
            return "non_finite"
        if versions and (not starts or starts[0] != 0):
            return "bad_field"
        if starts and starts[0] != 0:
            return "bad_field"
        if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
            return "bad_field"
        if any(s >= len(versions) or versions[s] == -1 for s in starts):
            return "bad_field"
    if starts is None and stop is None and all(v >= 0 for v in versions):
        return "wrong_version"
    return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    versions=st.lists(st.integers(-2, 2), max_size=6),
    zero_env_logprobs=st.booleans(),
    starts=st.none() | st.lists(st.integers(-1, 6), max_size=4),
    extra_reward=st.booleans(),
    nan_reward=st.booleans(),
    stop=st.none() | st.sampled_from([*STOP_REASONS, "nope", ""]),
    finished=st.booleans(),
    group_version=st.integers(0, 2),
)
def test_decode_agrees_with_a_hand_written_oracle(
    versions: list[int],
    zero_env_logprobs: bool,
    starts: list[int] | None,
    extra_reward: bool,
    nan_reward: bool,
    stop: str | None,
    finished: bool,
    group_version: int,
) -> None:
    logprobs = [0.0 if (v == -1 and zero_env_logprobs) else -0.5 for v in versions]
    rewards = None if starts is None else [0.25] * (len(starts) + int(extra_reward))
    if rewards and nan_reward:
        rewards[-1] = float("nan")
    completion: dict[str, Any] = {
        "token_ids": np.full(len(versions), 4, "<i4").tobytes(),
        "behaviour_logprobs": np.array(logprobs, "<f4").tobytes(),
        "token_versions": np.array(versions, "<i4").tobytes(),
        "reward": 1.0,
        "finished": finished,
    }
    if starts is not None and rewards is not None:
        completion["turn_starts"] = np.array(starts, "<i4").tobytes()
        completion["turn_rewards"] = np.array(rewards, "<f4").tobytes()
    if stop is not None:
        completion["stop"] = stop
    wire = wire_of(encode(make_episode_group()))
    wire["version"] = group_version
    wire["completions"] = [completion]
    expected = _valid_by_hand(
        versions,
        logprobs,
        starts,
        len(rewards or []),
        not (rewards and nan_reward),
        stop,
        finished,
        group_version,
    )
    try:
        decoded = decode(pack(wire), LIMITS)
    except ProtocolError as e:
        assert e.reason == expected, e
    else:
        assert expected is None
        assert encode(decoded) == pack(wire)  # every accepted frame is canonical


# ------------------------------------------------------------------ mixed deployments


def _load_v1_protocol() -> Any:
    """``common/link/protocol.py`` as of V1_DECODER_COMMIT (a v1-only learner), from git."""
    try:
        source = subprocess.run(
            ["git", "show", f"{V1_DECODER_COMMIT}:common/link/protocol.py"],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip(f"commit {V1_DECODER_COMMIT} is not in this checkout's history")
    spec = importlib.util.spec_from_loader("protocol_v1_only", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being made
    try:
        exec(compile(source, "protocol_v1_only.py", "exec"), module.__dict__)
    finally:
        del sys.modules[spec.name]
    return module


def test_a_v1_only_learner_refuses_v2_loudly_and_still_reads_v1() -> None:
    old = _load_v1_protocol()
    limits = old.DecodeLimits(vocab_size=VOCAB)
    assert old.PROTOCOL_VERSION == 1
    with pytest.raises(old.ProtocolError) as info:
        old.decode(encode(make_episode_group()), limits)
    assert info.value.reason == "wrong_version"
    # What this code writes for single-turn groups is exactly what the old decoder reads.
    group = copy.deepcopy(make_single_turn_group())
    assert old.encode(old.decode(encode(group), limits)) == encode(group)
