"""Every wire message of specrl, its msgpack codec, its limits and the protocol version.

One module holds the contract between actors and learner (frames, what ``decode`` checks:
docs/design.md §5.1); nothing else encodes or decodes frames, and no pickle is used anywhere.
The value rules of v2 groups (multi-turn episodes) live in ``common.link.episode_checks``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack
import numpy as np

from common.link.episode_checks import episode_refusal, uses_v2

PROTOCOL_VERSION: Final[int] = 1
"""The version of acks, heartbeats and every group that uses no v2 field (single-turn)."""
EPISODE_PROTOCOL_VERSION: Final[int] = 2
"""The version of a group with an episode field (a -1 token version, turn_starts, turn_rewards,
stop), and only of those: single-turn frames, WALs and checkpoints keep their v1 bytes."""

# float32 log-softmax can round a probability-1 token to a tiny positive log-prob; anything
# above this is not a log-probability and means a producer bug.
LOGPROB_TOLERANCE: Final[float] = 1e-4

# Sequence numbers and versions are int64 wherever they are computed on (torch, numpy, Redis).
INT64_MAX: Final[int] = 2**63 - 1

# Wire dtypes are fixed little-endian so actors and learner on different hosts agree.
_TOKEN_DTYPE: Final = np.dtype("<i4")
_LOGPROB_DTYPE: Final = np.dtype("<f4")

MSG_GROUP: Final[str] = "group"
MSG_ACK: Final[str] = "ack"
MSG_HEARTBEAT: Final[str] = "heartbeat"

# Machine-readable ``ProtocolError.reason`` values (counters are keyed by them):
#   oversize        frame, string, array, map or count beyond a DecodeLimits bound, or nesting
#                   deeper than the decoder's stack (a valid frame nests 4 deep)
#   not_msgpack     undecodable, truncated or trailing bytes
#   not_map         the top-level value is not a map
#   wrong_version   ``"v"`` missing or not 1 or 2; 2 on an ack, a heartbeat or a group that
#                   uses no v2 field (each message has one encoding)
#   wrong_type      ``"type"`` missing or unknown
#   bad_field       missing/extra key (a v2 field in a v1 frame), wrong value type, array bytes
#                   not a multiple of the item size, ext types, invalid UTF-8, a group without
#                   completions; v2: a first/last token not sampled, bad turn_starts, an unknown
#                   stop, a group version not its oldest sampled token's (episode_checks)
#   length_mismatch token_ids / behaviour_logprobs / token_versions of one completion disagree,
#                   or (v2) turn_starts / turn_rewards
#   out_of_vocab    a token id outside [0, vocab_size)
#   non_finite      NaN or inf in a log-prob, reward, turn reward, stat or timestamp
#   out_of_range    a seq/version outside [0, INT64_MAX], a token version below 0 (v1) or -1
#                   (v2), a log-prob above LOGPROB_TOLERANCE, or (v2) a not-sampled token's
#                   log-prob other than 0.0
PROTOCOL_ERROR_REASONS: Final[tuple[str, ...]] = (
    "oversize",
    "not_msgpack",
    "not_map",
    "wrong_version",
    "wrong_type",
    "bad_field",
    "length_mismatch",
    "out_of_vocab",
    "non_finite",
    "out_of_range",
)


class ProtocolError(ValueError):
    """A frame that is not a valid message; ``reason`` is one of PROTOCOL_ERROR_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class DecodeLimits:
    """Bounds a frame must respect; they cap the memory one frame can make the decoder allocate."""

    vocab_size: int
    """Token ids must lie in [0, vocab_size)."""
    max_frame_bytes: int = 64 * 1024 * 1024
    """Largest accepted frame, checked before unpacking."""
    max_completions: int = 1024
    max_tokens: int = 65536
    """Most tokens in one sequence (the prompt, or one completion)."""
    max_turns: int = 256
    """Most turns of one episode (v2 ``turn_starts`` / ``turn_rewards`` items)."""
    max_str_len: int = 256
    """Longest string (ids, stat names) in characters; also bounds map keys."""
    max_ack_seqs: int = 4096
    max_stats_entries: int = 256
    socket_frame_bytes: int = 0
    """Largest frame a receiving socket reads (libzmq's MAXMSGSIZE; 0: ``max_frame_bytes``). A
    frame above ``max_frame_bytes`` but within this is read and refused as ``oversize``, so it is
    counted; libzmq closes a connection that announces a larger one, before allocating it."""

    @property
    def socket_bytes(self) -> int:
        """The receiving socket's frame bound: ``socket_frame_bytes``, or ``max_frame_bytes``."""
        return max(self.max_frame_bytes, self.socket_frame_bytes)

    @property
    def max_objects(self) -> int:
        """Most container elements (items + entries, +1 per container) a valid frame holds: a
        group (9 keys, 10 per completion: its array item, map and up to 8 keys (5 in v1), its
        stats), an ack (its seqs, refused seqs included) or a heartbeat. The decoder stops as
        soon as a frame exceeds it: decoding is bounded by what a valid frame holds."""
        return 32 + 10 * self.max_completions + self.max_stats_entries + 2 * self.max_ack_seqs

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        # Field names such as "behaviour_logprobs" are strings too and must survive the bound.
        if self.max_str_len < 32:
            raise ValueError(f"max_str_len must be >= 32, got {self.max_str_len}")
        positive = ("max_frame_bytes", "max_completions", "max_tokens", "max_turns", "max_ack_seqs")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_stats_entries < 0:
            raise ValueError(f"max_stats_entries must be >= 0, got {self.max_stats_entries}")
        if self.socket_frame_bytes < 0:
            raise ValueError(f"socket_frame_bytes must be >= 0, got {self.socket_frame_bytes}")


# encode() checks the limit-independent invariants (types, lengths, finiteness, signs) so a
# malformed message fails in the producer instead of being rejected, unacked and resent forever.
_ENCODE_LIMITS: Final = DecodeLimits(
    vocab_size=2**31 - 1,
    max_frame_bytes=2**62,
    max_completions=2**31,
    max_tokens=2**31,
    max_turns=2**31,
    max_str_len=2**31,
    max_ack_seqs=2**31,
    max_stats_entries=2**31,
)


@dataclass(eq=False)
class Completion:
    """One continuation of a prompt, or a multi-turn episode (v2: ``common.link.episode_checks``);
    arrays compare by content in tests, not ``==``."""

    token_ids: np.ndarray  # [T] int32, everything after the prompt (prompt excluded)
    behaviour_logprobs: np.ndarray  # [T] float32, log-prob under the processed sampling dist.
    token_versions: np.ndarray  # [T] int32, policy version of each token; -1: not sampled (v2)
    reward: float
    finished: bool  # True: ended with EOS (v2: stop eos/env_done); False: hit a limit
    turn_starts: np.ndarray | None = None  # [S] int32 (v2): first token of each model turn
    turn_rewards: np.ndarray | None = None  # [S] float32 (v2): env reward after each turn
    stop: str | None = None  # v2: why the episode ended, one of episode_checks.STOP_REASONS


@dataclass(eq=False)
class TrajectoryGroup:
    """All G completions of one prompt, the unit the actor sends and the learner consumes."""

    actor_id: str
    seq: int  # per-actor sequence number; (actor_id, seq) is the dedupe key
    prompt_id: str
    prompt_ids: np.ndarray  # [P] int32
    version: int  # policy version the group counts as (min over its sampled tokens' versions)
    completions: list[Completion]
    stats: dict[str, float] = field(default_factory=dict)  # actor-side numbers, free-form


@dataclass
class Ack:
    """Learner -> actor: these seqs of ``actor_id`` were received (the actor may drop them).

    ``refused`` maps a reason to seqs the learner received and will never train (docs/design.md
    §5.2 "Refused"); they are not in ``seqs``, and the key is omitted on the wire when empty.
    """

    actor_id: str
    seqs: list[int]
    refused: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class Heartbeat:
    """Actor -> learner liveness and status; ``sent_at`` is the actor's ``time.time()``."""

    actor_id: str
    version: int
    stats: dict[str, float]
    sent_at: float


Message = TrajectoryGroup | Ack | Heartbeat

_GROUP_KEYS: Final = frozenset(
    {"v", "type", "actor_id", "seq", "prompt_id", "prompt_ids", "version", "completions", "stats"}
)
_COMPLETION_KEYS: Final = frozenset(
    {"token_ids", "behaviour_logprobs", "token_versions", "reward", "finished"}
)
_EPISODE_KEYS: Final = frozenset({"turn_starts", "turn_rewards", "stop"})  # v2, each optional
_ACK_KEYS: Final = frozenset({"v", "type", "actor_id", "seqs"})
_ACK_KEYS_REFUSED: Final = _ACK_KEYS | {"refused"}
_HEARTBEAT_KEYS: Final = frozenset({"v", "type", "actor_id", "version", "stats", "sent_at"})


# ----------------------------------------- encode -------------------------------------------


def _pack_array(values: np.ndarray, dtype: np.dtype, name: str) -> bytes:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ProtocolError("bad_field", f"{name} must be 1-D, got shape {array.shape}")
    return array.astype(dtype, copy=False).tobytes()


def _stats_to_wire(stats: dict[str, float]) -> dict[str, float]:
    # Sorted keys make the encoding canonical (stored fixtures, byte-equal re-encodes).
    return {k: float(stats[k]) for k in sorted(stats)}


def _envelope(kind: str, actor_id: str, version: int = PROTOCOL_VERSION) -> dict[str, Any]:
    """The keys every frame starts with."""
    return {"v": version, "type": kind, "actor_id": actor_id}


def _completion_to_wire(c: Completion) -> dict[str, Any]:
    """A completion's map: the v1 keys, then each episode field that is set, in a fixed order
    (canonical bytes)."""
    wire: dict[str, Any] = {
        "token_ids": _pack_array(c.token_ids, _TOKEN_DTYPE, "token_ids"),
        "behaviour_logprobs": _pack_array(
            c.behaviour_logprobs, _LOGPROB_DTYPE, "behaviour_logprobs"
        ),
        "token_versions": _pack_array(c.token_versions, _TOKEN_DTYPE, "token_versions"),
        "reward": float(c.reward),
        "finished": bool(c.finished),
    }
    if c.turn_starts is not None:
        wire["turn_starts"] = _pack_array(c.turn_starts, _TOKEN_DTYPE, "turn_starts")
    if c.turn_rewards is not None:
        wire["turn_rewards"] = _pack_array(c.turn_rewards, _LOGPROB_DTYPE, "turn_rewards")
    if c.stop is not None:
        wire["stop"] = c.stop
    return wire


def _to_wire(msg: Message) -> dict[str, Any]:
    if isinstance(msg, TrajectoryGroup):
        episode = any(uses_v2(c) for c in msg.completions)
        version = EPISODE_PROTOCOL_VERSION if episode else PROTOCOL_VERSION
        return {
            **_envelope(MSG_GROUP, msg.actor_id, version),
            "seq": int(msg.seq),
            "prompt_id": msg.prompt_id,
            "prompt_ids": _pack_array(msg.prompt_ids, _TOKEN_DTYPE, "prompt_ids"),
            "version": int(msg.version),
            "completions": [_completion_to_wire(c) for c in msg.completions],
            "stats": _stats_to_wire(msg.stats),
        }
    if isinstance(msg, Ack):
        wire = {**_envelope(MSG_ACK, msg.actor_id), "seqs": [int(s) for s in msg.seqs]}
        if msg.refused:
            wire["refused"] = {
                reason: [int(s) for s in msg.refused[reason]] for reason in sorted(msg.refused)
            }
        return wire
    if isinstance(msg, Heartbeat):
        return {
            **_envelope(MSG_HEARTBEAT, msg.actor_id),
            "version": int(msg.version),
            "stats": _stats_to_wire(msg.stats),
            "sent_at": float(msg.sent_at),
        }
    raise TypeError(f"not a wire message: {type(msg).__name__}")


def encode(msg: Message, limits: DecodeLimits | None = None) -> bytes:
    """One frame for ``msg``; raises ProtocolError if ``msg`` could never pass ``decode``.

    Without ``limits``, vocabulary and size limits are left to the receiver (the producer may
    not know them); with the receiver's limits, the frame is checked exactly as ``decode`` will
    check it (the frame-size bound included), in one validation pass.
    """
    wire = _to_wire(msg)
    _from_wire(wire, limits or _ENCODE_LIMITS)
    frame = msgpack.packb(wire, use_bin_type=True)
    if limits is not None and len(frame) > limits.max_frame_bytes:
        raise ProtocolError("oversize", f"{len(frame)} > {limits.max_frame_bytes} bytes")
    return frame


# ----------------------------------------- decode -------------------------------------------


def _reject_ext(code: int, data: bytes) -> Any:
    raise ProtocolError("bad_field", f"msgpack ext type {code} is not part of the protocol")


class _ObjectBudget:
    """Counts container elements as the C unpacker completes each array and map, and stops the
    decode (``oversize``) once a frame holds more than a valid one can. Hooks run bottom-up, so
    what is allocated before the stop is bounded by the budget plus one container's elements."""

    __slots__ = ("left",)

    def __init__(self, limit: int) -> None:
        self.left = limit

    def spend(self, obj: dict | list) -> dict | list:
        """The hook for maps and arrays alike: ``obj``, once its elements are counted."""
        self.left -= len(obj) + 1
        if self.left < 0:
            raise ProtocolError("oversize", "more arrays/maps entries than a valid frame holds")
        return obj


def _unpack(frame: bytes, limits: DecodeLimits) -> Any:
    budget = _ObjectBudget(limits.max_objects)
    try:
        return msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            use_list=True,
            object_hook=budget.spend,
            list_hook=budget.spend,
            ext_hook=_reject_ext,
            max_bin_len=limits.max_tokens * _TOKEN_DTYPE.itemsize,
            max_str_len=limits.max_str_len,
            max_array_len=max(limits.max_completions, limits.max_ack_seqs),
            max_map_len=max(limits.max_stats_entries, len(_GROUP_KEYS)),
        )
    except ProtocolError:
        raise
    except msgpack.StackError as e:
        raise ProtocolError("oversize", "nested deeper than the decoder's stack") from e
    except UnicodeDecodeError as e:
        raise ProtocolError("bad_field", f"invalid UTF-8 string: {e.reason}") from e
    except ValueError as e:
        # msgpack reports every problem as a ValueError subclass; the limit and map-key
        # violations are told apart only by their message text.
        text = str(e)
        if "exceeds max" in text:
            raise ProtocolError("oversize", text) from e
        if "map key" in text:
            raise ProtocolError("bad_field", text) from e
        raise ProtocolError("not_msgpack", f"{type(e).__name__}: {text}") from e


def _check_keys(
    obj: dict[str, Any], expected: frozenset[str], what: str, optional: frozenset[str] = frozenset()
) -> None:
    """``obj`` has every key of ``expected``, and others only from ``optional``."""
    keys = obj.keys()
    if keys != expected and not (keys >= expected and keys - expected <= optional):
        missing = sorted(expected - keys)
        extra = sorted(str(k) for k in keys - expected - optional)
        raise ProtocolError("bad_field", f"{what}: missing {missing}, extra {extra}")


def _get_typed(obj: dict[str, Any], key: str, kind: type) -> Any:
    value = obj[key]
    # ``type is`` rejects bool where an int is due (Python treats bool as an int subclass).
    if type(value) is not kind:
        raise ProtocolError(
            "bad_field", f"{key} must be {kind.__name__}, got {type(value).__name__}"
        )
    return value


def _get_str(obj: dict[str, Any], key: str, limits: DecodeLimits) -> str:
    value = _get_typed(obj, key, str)
    if len(value) > limits.max_str_len:
        raise ProtocolError("oversize", f"{key} has {len(value)} > {limits.max_str_len} chars")
    return value


def _get_nonneg_int(obj: dict[str, Any], key: str) -> int:
    value = _get_typed(obj, key, int)
    if not 0 <= value <= INT64_MAX:
        raise ProtocolError("out_of_range", f"{key} must be in [0, 2**63-1], got {value}")
    return value


def _get_finite_float(obj: dict[str, Any], key: str) -> float:
    value = _get_typed(obj, key, float)
    if not math.isfinite(value):
        raise ProtocolError("non_finite", f"{key} is {value}")
    return value


_NATIVE = {dt: dt.newbyteorder("=") for dt in (_TOKEN_DTYPE, _LOGPROB_DTYPE)}


def _get_array(
    obj: dict[str, Any], key: str, dtype: np.dtype, limits: DecodeLimits, max_items: int = 0
) -> np.ndarray:
    """The array in bin ``key``, of at most ``max_items`` (0: ``limits.max_tokens``) items."""
    value = obj[key]
    if type(value) is not bytes:
        raise ProtocolError("bad_field", f"{key} must be bin, got {type(value).__name__}")
    if len(value) % dtype.itemsize:
        raise ProtocolError(
            "bad_field", f"{key} has {len(value)} bytes, not a multiple of {dtype.itemsize}"
        )
    count = len(value) // dtype.itemsize
    bound = max_items or limits.max_tokens
    if count > bound:
        raise ProtocolError("oversize", f"{key} has {count} > {bound} items")
    # A copy: a writable, native-order array (frombuffer alone is a read-only view).
    return np.frombuffer(value, dtype=dtype).astype(_NATIVE[dtype])


def _get_stats(obj: dict[str, Any], limits: DecodeLimits) -> dict[str, float]:
    value = obj["stats"]
    if type(value) is not dict:
        raise ProtocolError("bad_field", f"stats must be a map, got {type(value).__name__}")
    if len(value) > limits.max_stats_entries:
        raise ProtocolError(
            "oversize", f"stats has {len(value)} > {limits.max_stats_entries} entries"
        )
    stats: dict[str, float] = {}
    for name in value:
        if type(name) is not str:
            raise ProtocolError("bad_field", "stats keys must be str")
        stats[name] = _get_finite_float(value, name)
    return stats


def _check_token_ids(ids: np.ndarray, key: str, limits: DecodeLimits) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= limits.vocab_size):
        raise ProtocolError(
            "out_of_vocab",
            f"{key} spans [{int(ids.min())}, {int(ids.max())}], vocab_size {limits.vocab_size}",
        )


def _completion_from_wire(obj: Any, limits: DecodeLimits, v2: bool) -> Completion:
    """Structure only (types, keys, lengths); the values are checked per group, vectorised, by
    ``_check_completion_values``. The episode fields are accepted in a v2 frame only."""
    if type(obj) is not dict:
        raise ProtocolError("bad_field", f"completion must be a map, got {type(obj).__name__}")
    _check_keys(obj, _COMPLETION_KEYS, "completion", _EPISODE_KEYS if v2 else frozenset())
    token_ids = _get_array(obj, "token_ids", _TOKEN_DTYPE, limits)  # [T]
    logprobs = _get_array(obj, "behaviour_logprobs", _LOGPROB_DTYPE, limits)  # [T]
    token_versions = _get_array(obj, "token_versions", _TOKEN_DTYPE, limits)  # [T]
    if not (len(token_ids) == len(logprobs) == len(token_versions)):
        raise ProtocolError(
            "length_mismatch",
            f"token_ids {len(token_ids)}, behaviour_logprobs {len(logprobs)}, "
            f"token_versions {len(token_versions)}",
        )
    finished = obj["finished"]
    if type(finished) is not bool:
        raise ProtocolError("bad_field", f"finished must be bool, got {type(finished).__name__}")
    turns = {  # the v2 turn arrays present
        key: _get_array(obj, key, dtype, limits, limits.max_turns)
        for key, dtype in (("turn_starts", _TOKEN_DTYPE), ("turn_rewards", _LOGPROB_DTYPE))
        if key in obj
    }
    return Completion(
        token_ids=token_ids,
        behaviour_logprobs=logprobs,
        token_versions=token_versions,
        reward=_get_finite_float(obj, "reward"),
        finished=finished,
        turn_starts=turns.get("turn_starts"),
        turn_rewards=turns.get("turn_rewards"),
        stop=_get_str(obj, "stop", limits) if "stop" in obj else None,
    )


def _check_completion_values(
    completions: list[Completion], limits: DecodeLimits, group_version: int, v2: bool
) -> None:
    """Token ids in the vocabulary, log-probs finite and <= 0, versions >= 0 (v1) or the v2
    rules (``episode_checks.episode_refusal``), for all the completions of a group at once (one
    reduction per check instead of one per completion)."""
    if len(completions) == 1:
        ids, logprobs, versions = (
            completions[0].token_ids,
            completions[0].behaviour_logprobs,
            completions[0].token_versions,
        )
    else:
        ids = np.concatenate([c.token_ids for c in completions])
        logprobs = np.concatenate([c.behaviour_logprobs for c in completions])
        versions = np.concatenate([c.token_versions for c in completions])
    _check_token_ids(ids, "token_ids", limits)
    if not np.isfinite(logprobs).all():
        raise ProtocolError("non_finite", "behaviour_logprobs")
    if logprobs.size and float(logprobs.max()) > LOGPROB_TOLERANCE:
        raise ProtocolError("out_of_range", f"behaviour_logprobs max {float(logprobs.max())} > 0")
    if v2:
        if (refusal := episode_refusal(completions, group_version)) is not None:
            raise ProtocolError(*refusal)
    elif versions.size and int(versions.min()) < 0:
        raise ProtocolError("out_of_range", "token_versions must be >= 0")


def _group_from_wire(obj: dict[str, Any], limits: DecodeLimits, v2: bool) -> TrajectoryGroup:
    _check_keys(obj, _GROUP_KEYS, "group")
    prompt_ids = _get_array(obj, "prompt_ids", _TOKEN_DTYPE, limits)  # [P]
    _check_token_ids(prompt_ids, "prompt_ids", limits)
    if len(prompt_ids) == 0:
        # A completion is scored from the prompt's last position; without one it has no context.
        raise ProtocolError("bad_field", "prompt_ids must not be empty")
    completions = obj["completions"]
    if type(completions) is not list:
        raise ProtocolError("bad_field", "completions must be an array")
    if not completions:
        raise ProtocolError("bad_field", "a group needs at least one completion")
    if len(completions) > limits.max_completions:
        raise ProtocolError(
            "oversize", f"{len(completions)} > {limits.max_completions} completions"
        )
    version = _get_nonneg_int(obj, "version")
    parsed = [_completion_from_wire(c, limits, v2) for c in completions]
    _check_completion_values(parsed, limits, version, v2)
    return TrajectoryGroup(
        actor_id=_get_str(obj, "actor_id", limits),
        seq=_get_nonneg_int(obj, "seq"),
        prompt_id=_get_str(obj, "prompt_id", limits),
        prompt_ids=prompt_ids,
        version=version,
        completions=parsed,
        stats=_get_stats(obj, limits),
    )


def _get_seqs(seqs: Any, what: str, limits: DecodeLimits) -> list[int]:
    if type(seqs) is not list:
        raise ProtocolError("bad_field", f"{what} must be an array")
    if len(seqs) > limits.max_ack_seqs:
        raise ProtocolError("oversize", f"{what}: {len(seqs)} > {limits.max_ack_seqs} seqs")
    for seq in seqs:
        if type(seq) is not int:
            raise ProtocolError("bad_field", f"{what} must hold ints")
        if not 0 <= seq <= INT64_MAX:
            raise ProtocolError("out_of_range", f"seq {seq} outside [0, 2**63-1]")
    return seqs


def _ack_from_wire(obj: dict[str, Any], limits: DecodeLimits) -> Ack:
    _check_keys(obj, _ACK_KEYS_REFUSED if "refused" in obj else _ACK_KEYS, "ack")
    seqs = _get_seqs(obj["seqs"], "seqs", limits)
    refused: dict[str, list[int]] = {}
    if "refused" in obj:
        value = obj["refused"]
        if type(value) is not dict or not value:
            raise ProtocolError("bad_field", "refused must be a non-empty map")
        for reason, reason_seqs in value.items():
            if type(reason) is not str:
                raise ProtocolError("bad_field", "refused keys must be str")
            refused[reason] = _get_seqs(reason_seqs, f"refused[{reason!r}]", limits)
    return Ack(actor_id=_get_str(obj, "actor_id", limits), seqs=seqs, refused=refused)


def _heartbeat_from_wire(obj: dict[str, Any], limits: DecodeLimits) -> Heartbeat:
    _check_keys(obj, _HEARTBEAT_KEYS, "heartbeat")
    return Heartbeat(
        actor_id=_get_str(obj, "actor_id", limits),
        version=_get_nonneg_int(obj, "version"),
        stats=_get_stats(obj, limits),
        sent_at=_get_finite_float(obj, "sent_at"),
    )


def _from_wire(obj: Any, limits: DecodeLimits) -> Message:
    if type(obj) is not dict:
        raise ProtocolError("not_map", f"top level is {type(obj).__name__}")
    version = obj.get("v")
    known = (PROTOCOL_VERSION, EPISODE_PROTOCOL_VERSION)
    if type(version) is not int or version not in known:
        raise ProtocolError("wrong_version", f"v={version!r}, expected one of {known}")
    kind = obj.get("type")
    if kind == MSG_GROUP:
        return _group_from_wire(obj, limits, version == EPISODE_PROTOCOL_VERSION)
    if version != PROTOCOL_VERSION and kind in (MSG_ACK, MSG_HEARTBEAT):
        raise ProtocolError("wrong_version", f"{kind} frames are v{PROTOCOL_VERSION}")
    if kind == MSG_ACK:
        return _ack_from_wire(obj, limits)
    if kind == MSG_HEARTBEAT:
        return _heartbeat_from_wire(obj, limits)
    raise ProtocolError("wrong_type", f"type={kind!r}")


def decode(frame: bytes, limits: DecodeLimits) -> Message:
    """The validated message in ``frame``; raises ProtocolError (and nothing else) if invalid."""
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise ProtocolError("bad_field", f"frame must be bytes, got {type(frame).__name__}")
    if len(frame) > limits.max_frame_bytes:
        raise ProtocolError("oversize", f"{len(frame)} > {limits.max_frame_bytes} bytes")
    return _from_wire(_unpack(frame, limits), limits)
