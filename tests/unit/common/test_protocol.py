"""Wire protocol: round trips, stored byte fixtures, every rejection reason, fuzzing.

Regenerate the stored fixtures (only after a deliberate, versioned format change):
    SPECRL_REGEN_FIXTURES=1 .venv/bin/python -m pytest tests/unit/common/test_protocol.py
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.link.protocol import (
    PROTOCOL_ERROR_REASONS,
    PROTOCOL_VERSION,
    Ack,
    Completion,
    DecodeLimits,
    Heartbeat,
    Message,
    ProtocolError,
    TrajectoryGroup,
    decode,
    encode,
)

FIXTURES = Path(__file__).parent / "fixtures"
VOCAB = 100
LIMITS = DecodeLimits(vocab_size=VOCAB)


def make_group(seq: int = 7, actor_id: str = "actor-0") -> TrajectoryGroup:
    """A fixed group: every value is a constant so its encoding is byte-stable."""
    return TrajectoryGroup(
        actor_id=actor_id,
        seq=seq,
        prompt_id="gsm8k/42",
        prompt_ids=np.array([1, 2, 3, 99], dtype=np.int32),
        version=3,
        completions=[
            Completion(
                token_ids=np.array([10, 11, 12], dtype=np.int32),
                behaviour_logprobs=np.array([-0.5, -1.25, -0.0], dtype=np.float32),
                token_versions=np.array([3, 3, 4], dtype=np.int32),
                reward=1.0,
                finished=True,
            ),
            Completion(
                token_ids=np.array([0, 98], dtype=np.int32),
                behaviour_logprobs=np.array([-2.0, -3.5], dtype=np.float32),
                token_versions=np.array([4, 4], dtype=np.int32),
                reward=-0.5,
                finished=False,
            ),
        ],
        stats={"actor/gen_s": 0.25, "actor/accept_rate": 0.75},
    )


def make_ack() -> Ack:
    return Ack(actor_id="actor-0", seqs=[0, 1, 5, 300])


def make_heartbeat() -> Heartbeat:
    return Heartbeat(
        actor_id="actor-0", version=12, stats={"actor/tokens_per_s": 1234.5}, sent_at=1700000000.5
    )


def assert_same(a: Message, b: Message) -> None:
    assert type(a) is type(b)
    if isinstance(a, TrajectoryGroup):
        assert isinstance(b, TrajectoryGroup)
        assert (a.actor_id, a.seq, a.prompt_id, a.version, a.stats) == (
            b.actor_id,
            b.seq,
            b.prompt_id,
            b.version,
            b.stats,
        )
        np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
        assert len(a.completions) == len(b.completions)
        for ca, cb in zip(a.completions, b.completions, strict=True):
            np.testing.assert_array_equal(ca.token_ids, cb.token_ids)
            np.testing.assert_array_equal(ca.behaviour_logprobs, cb.behaviour_logprobs)
            np.testing.assert_array_equal(ca.token_versions, cb.token_versions)
            assert (ca.reward, ca.finished) == (cb.reward, cb.finished)
    else:
        assert a == b


# ------------------------------------------------------------------ round trips and fixtures


@pytest.mark.parametrize("make", [make_group, make_ack, make_heartbeat])
def test_round_trip(make: Any) -> None:
    msg = make()
    frame = encode(msg)
    decoded = decode(frame, LIMITS)
    assert_same(msg, decoded)
    assert encode(decoded) == frame  # canonical: re-encoding is byte-identical


def test_decoded_arrays_are_native_writable_copies() -> None:
    group = decode(encode(make_group()), LIMITS)
    assert isinstance(group, TrajectoryGroup)
    c = group.completions[0]
    assert c.token_ids.dtype == np.int32 and c.token_versions.dtype == np.int32
    assert c.behaviour_logprobs.dtype == np.float32 and group.prompt_ids.dtype == np.int32
    assert c.token_ids.flags.writeable and c.token_ids.flags.owndata


def test_arrays_travel_as_packed_bytes() -> None:
    wire = msgpack.unpackb(encode(make_group()), raw=False)
    assert wire["v"] == PROTOCOL_VERSION and wire["type"] == "group"
    assert wire["prompt_ids"] == np.array([1, 2, 3, 99], dtype="<i4").tobytes()
    assert isinstance(wire["completions"][0]["behaviour_logprobs"], bytes)


def test_encode_accepts_other_numeric_dtypes() -> None:
    group = make_group()
    group.completions[0].token_ids = np.array([10, 11, 12], dtype=np.int64)
    group.completions[0].behaviour_logprobs = np.array([-0.5, -1.25, -0.0], dtype=np.float64)
    assert encode(group) == encode(make_group())


@pytest.mark.parametrize(
    ("name", "make"), [("group", make_group), ("ack", make_ack), ("heartbeat", make_heartbeat)]
)
def test_stored_fixture(name: str, make: Any) -> None:
    path = FIXTURES / f"{name}_v{PROTOCOL_VERSION}.bin"
    frame = encode(make())
    if os.environ.get("SPECRL_REGEN_FIXTURES") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(frame)
    stored = path.read_bytes()
    # Both directions: today's encoder writes the stored bytes, today's decoder reads them.
    assert frame == stored, f"wire format of {name} changed; bump PROTOCOL_VERSION"
    assert_same(make(), decode(stored, LIMITS))


# ------------------------------------------------------------------ rejections


def wire_group() -> dict[str, Any]:
    return msgpack.unpackb(encode(make_group()), raw=False)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def with_field(**changes: Any) -> bytes:
    wire = wire_group()
    wire.update(changes)
    return pack(wire)


def with_completion_field(**changes: Any) -> bytes:
    wire = wire_group()
    wire["completions"][0].update(changes)
    return pack(wire)


def without(key: str) -> bytes:
    wire = wire_group()
    del wire[key]
    return pack(wire)


def i32(*values: int) -> bytes:
    return np.array(values, dtype="<i4").tobytes()


def f32(*values: float) -> bytes:
    return np.array(values, dtype="<f4").tobytes()


def ack_wire(**changes: Any) -> bytes:
    wire = msgpack.unpackb(encode(make_ack()), raw=False)
    wire.update(changes)
    return pack(wire)


def heartbeat_wire(**changes: Any) -> bytes:
    wire = msgpack.unpackb(encode(make_heartbeat()), raw=False)
    wire.update(changes)
    return pack(wire)


GOOD = encode(make_group())
BAD_FRAMES: list[tuple[str, bytes, DecodeLimits, str]] = [
    # (case, frame, limits, expected reason)
    ("frame too big", GOOD, DecodeLimits(vocab_size=VOCAB, max_frame_bytes=64), "oversize"),
    ("string too long", with_field(actor_id="a" * 300), LIMITS, "oversize"),
    (
        "too many completions",
        GOOD,
        DecodeLimits(vocab_size=VOCAB, max_completions=1),
        "oversize",
    ),
    ("too many tokens", GOOD, DecodeLimits(vocab_size=VOCAB, max_tokens=3), "oversize"),
    ("too many stats", GOOD, DecodeLimits(vocab_size=VOCAB, max_stats_entries=1), "oversize"),
    ("too many ack seqs", encode(make_ack()), DecodeLimits(vocab_size=1, max_ack_seqs=2), "oversize"),
    ("empty", b"", LIMITS, "not_msgpack"),
    ("reserved byte", b"\xc1", LIMITS, "not_msgpack"),
    ("truncated", GOOD[:-5], LIMITS, "not_msgpack"),
    ("trailing bytes", GOOD + b"\x00", LIMITS, "not_msgpack"),
    ("deep nesting", b"\x91" * 5000 + b"\x00", LIMITS, "oversize"),
    ("array at top", pack([1, 2]), LIMITS, "not_map"),
    ("int at top", pack(5), LIMITS, "not_map"),
    ("version 2", with_field(v=2), LIMITS, "wrong_version"),
    ("version missing", without("v"), LIMITS, "wrong_version"),
    ("version as str", with_field(v="1"), LIMITS, "wrong_version"),
    ("version as bool", with_field(v=True), LIMITS, "wrong_version"),
    ("unknown type", with_field(type="rollout"), LIMITS, "wrong_type"),
    ("type missing", without("type"), LIMITS, "wrong_type"),
    ("type as bytes", with_field(type=b"group"), LIMITS, "wrong_type"),
    ("field missing", without("prompt_id"), LIMITS, "bad_field"),
    ("extra field", with_field(extra=1), LIMITS, "bad_field"),
    ("seq as str", with_field(seq="7"), LIMITS, "bad_field"),
    ("seq as bool", with_field(seq=True), LIMITS, "bad_field"),
    ("seq as float", with_field(seq=7.0), LIMITS, "bad_field"),
    ("actor_id as bytes", with_field(actor_id=b"actor-0"), LIMITS, "bad_field"),
    ("prompt_ids as list", with_field(prompt_ids=[1, 2, 3]), LIMITS, "bad_field"),
    ("completions as map", with_field(completions={}), LIMITS, "bad_field"),
    ("no completions", with_field(completions=[]), LIMITS, "bad_field"),
    ("empty prompt", with_field(prompt_ids=b""), LIMITS, "bad_field"),
    ("completion as list", with_field(completions=[[1]]), LIMITS, "bad_field"),
    ("stats as list", with_field(stats=[1.0]), LIMITS, "bad_field"),
    ("stat as str", with_field(stats={"a": "x"}), LIMITS, "bad_field"),
    ("stat as int", with_field(stats={"a": 1}), LIMITS, "bad_field"),
    ("reward as int", with_completion_field(reward=1), LIMITS, "bad_field"),
    ("finished as int", with_completion_field(finished=1), LIMITS, "bad_field"),
    ("token_ids ragged bytes", with_completion_field(token_ids=b"\x01" * 13), LIMITS, "bad_field"),
    ("logprobs ragged bytes", with_completion_field(behaviour_logprobs=b"\x00" * 6), LIMITS, "bad_field"),
    ("ext type", with_field(stats=msgpack.ExtType(5, b"xyz")), LIMITS, "bad_field"),
    ("timestamp ext", pack({"v": 1, "type": "ack", "actor_id": "a", "seqs": [msgpack.Timestamp(1)]}), LIMITS, "bad_field"),
    ("int map key", pack({1: 2, "v": 1}), LIMITS, "bad_field"),
    ("invalid utf-8", GOOD.replace(b"gsm8k/42", b"gsm8k\xff42"), LIMITS, "bad_field"),
    ("ack seq as str", ack_wire(seqs=["1"]), LIMITS, "bad_field"),
    ("heartbeat sent_at as int", heartbeat_wire(sent_at=5), LIMITS, "bad_field"),
    ("logprobs short", with_completion_field(behaviour_logprobs=f32(-1.0, -1.0)), LIMITS, "length_mismatch"),
    ("versions long", with_completion_field(token_versions=i32(3, 3, 3, 3)), LIMITS, "length_mismatch"),
    ("token id == vocab", with_completion_field(token_ids=i32(1, VOCAB, 2)), LIMITS, "out_of_vocab"),
    ("token id negative", with_completion_field(token_ids=i32(1, -1, 2)), LIMITS, "out_of_vocab"),
    ("prompt id too big", with_field(prompt_ids=i32(5, 10**6)), LIMITS, "out_of_vocab"),
    ("logprob NaN", with_completion_field(behaviour_logprobs=f32(-1.0, float("nan"), -1.0)), LIMITS, "non_finite"),
    ("logprob -inf", with_completion_field(behaviour_logprobs=f32(-1.0, -float("inf"), -1.0)), LIMITS, "non_finite"),
    ("reward NaN", with_completion_field(reward=float("nan")), LIMITS, "non_finite"),
    ("reward inf", with_completion_field(reward=float("inf")), LIMITS, "non_finite"),
    ("stat NaN", with_field(stats={"a": float("nan")}), LIMITS, "non_finite"),
    ("sent_at inf", heartbeat_wire(sent_at=float("inf")), LIMITS, "non_finite"),
    ("logprob positive", with_completion_field(behaviour_logprobs=f32(-1.0, 0.5, -1.0)), LIMITS, "out_of_range"),
    ("seq negative", with_field(seq=-1), LIMITS, "out_of_range"),
    ("version negative", with_field(version=-3), LIMITS, "out_of_range"),
    ("token version negative", with_completion_field(token_versions=i32(3, -1, 3)), LIMITS, "out_of_range"),
    ("ack seq negative", ack_wire(seqs=[1, -2]), LIMITS, "out_of_range"),
    ("heartbeat version negative", heartbeat_wire(version=-1), LIMITS, "out_of_range"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("frame", "limits", "reason"),
    [pytest.param(f, lim, r, id=case) for case, f, lim, r in BAD_FRAMES],
)
def test_bad_frame_rejected_with_reason(frame: bytes, limits: DecodeLimits, reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode(frame, limits)
    assert info.value.reason == reason, str(info.value)
    assert isinstance(info.value, ValueError)


def test_every_reason_is_exercised() -> None:
    assert {r for _, _, _, r in BAD_FRAMES} == set(PROTOCOL_ERROR_REASONS)


def test_tiny_positive_logprob_is_tolerated() -> None:
    frame = with_completion_field(behaviour_logprobs=f32(-1.0, 1e-6, -1.0))
    assert isinstance(decode(frame, LIMITS), TrajectoryGroup)


def test_limits_are_inclusive() -> None:
    group = make_group()
    exact = DecodeLimits(
        vocab_size=VOCAB,
        max_frame_bytes=len(encode(group)),
        max_completions=2,
        max_tokens=4,
        max_str_len=32,
        max_stats_entries=2,
    )
    assert_same(group, decode(encode(group), exact))


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda g: setattr(g.completions[0], "reward", float("nan")), "non_finite"),
        (lambda g: setattr(g, "seq", -1), "out_of_range"),
        (
            lambda g: setattr(g.completions[1], "token_ids", np.zeros(5, np.int32)),
            "length_mismatch",
        ),
        (lambda g: setattr(g, "prompt_ids", np.zeros((2, 2), np.int32)), "bad_field"),
        (lambda g: setattr(g, "completions", []), "bad_field"),
    ],
)
def test_encode_refuses_messages_decode_would_reject(mutate: Any, reason: str) -> None:
    group = make_group()
    mutate(group)
    with pytest.raises(ProtocolError) as info:
        encode(group)
    assert info.value.reason == reason


def test_decode_limits_validated() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        DecodeLimits(vocab_size=0)
    with pytest.raises(ValueError, match="max_str_len"):
        DecodeLimits(vocab_size=10, max_str_len=4)
    with pytest.raises(ValueError, match="socket_frame_bytes"):
        DecodeLimits(vocab_size=10, socket_frame_bytes=-1)


def test_the_socket_bound_is_never_below_the_frame_bound() -> None:
    assert DecodeLimits(vocab_size=10, max_frame_bytes=8192).socket_bytes == 8192
    wide = DecodeLimits(vocab_size=10, max_frame_bytes=8192, socket_frame_bytes=1 << 20)
    assert wide.socket_bytes == 1 << 20
    narrow = DecodeLimits(vocab_size=10, max_frame_bytes=8192, socket_frame_bytes=4096)
    assert narrow.socket_bytes == 8192


# ------------------------------------------------------------------ fuzzing

# database=None: no .hypothesis/ example store in the working tree.
FUZZ = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
VALID_FRAMES = [encode(make_group()), encode(make_ack()), encode(make_heartbeat())]
SMALL_LIMITS = DecodeLimits(vocab_size=VOCAB, max_frame_bytes=4096, max_tokens=16)


def _decode_or_protocol_error(frame: bytes, limits: DecodeLimits) -> None:
    try:
        decode(frame, limits)
    except ProtocolError as e:
        assert e.reason in PROTOCOL_ERROR_REASONS


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_only_raise_protocol_error(frame: bytes) -> None:
    _decode_or_protocol_error(frame, LIMITS)


@FUZZ
@given(
    st.sampled_from(VALID_FRAMES),
    st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8),
    st.integers(0, 10**6),
    st.binary(max_size=8),
)
def test_mutated_frames_only_raise_protocol_error(
    frame: bytes, flips: list[tuple[int, int]], cut: int, insert: bytes
) -> None:
    data = bytearray(frame)
    for pos, value in flips:
        data[pos % len(data)] = value
    pos = cut % (len(data) + 1)
    _decode_or_protocol_error(bytes(data), LIMITS)
    _decode_or_protocol_error(bytes(data[:pos]), LIMITS)
    _decode_or_protocol_error(bytes(data[:pos]) + insert + bytes(data[pos:]), SMALL_LIMITS)


MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=20), inner, max_size=4)
    ),
    max_leaves=12,
)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


@FUZZ
@given(st.sampled_from(VALID_FRAMES), st.data(), MSGPACK_VALUES)
def test_field_replacements_only_raise_protocol_error(frame: bytes, data: Any, value: Any) -> None:
    wire = msgpack.unpackb(frame, raw=False)
    path = data.draw(st.sampled_from(_paths(wire)[1:]))
    target = wire
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    _decode_or_protocol_error(pack(wire), LIMITS)


@pytest.mark.parametrize("field", ["seq", "version"])
@pytest.mark.parametrize(("value", "ok"), [(2**63 - 1, True), (2**63, False), (2**64 - 1, False)])
def test_seqs_and_versions_are_bounded_to_int64(field: str, value: int, ok: bool) -> None:
    frame = with_field(**{field: value})
    if ok:
        assert getattr(decode(frame, LIMITS), field) == value
    else:
        with pytest.raises(ProtocolError) as info:
            decode(frame, LIMITS)
        assert info.value.reason == "out_of_range"


def test_ack_with_refused_seqs_round_trips_and_is_omitted_when_empty() -> None:
    ack = Ack(actor_id="a", seqs=[1, 2], refused={"too_long": [3], "version_ahead": [4, 5]})
    assert decode(encode(ack), LIMITS) == ack
    plain = Ack(actor_id="a", seqs=[1])
    assert b"refused" not in encode(plain)
    assert decode(encode(plain), LIMITS) == plain
    wire = msgpack.unpackb(encode(ack), raw=False)
    for bad in ({}, {"x": [-1]}, {"x": "3"}, {"x": [2**63]}):
        with pytest.raises(ProtocolError):
            decode(pack({**wire, "refused": bad}), LIMITS)
