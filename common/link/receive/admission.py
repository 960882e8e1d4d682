"""Admission: what a well-formed group must also be before the learner trains on it.

``common.link.protocol.decode`` checks that a frame *is* a group (types, lengths, ids in the
vocabulary, finite float64 numbers, int64 seqs and versions). Admission checks that this run can
*train* on it, in the units the learner computes in:

- ``wrong_group_size``: its number of completions is the run's group size (GRPO normalises per
  group; a batch is an ``[N, G]`` reward tensor);
- ``too_long``: prompt + completion fits the model's context and the learner's per-sequence
  token budget (the step's cost grows about quadratically with it);
- ``reward_out_of_range``: every reward is finite *as float32* (the dtype it is trained in) and
  within ``max_abs_reward`` (a 1e300 reward is a finite float64, an inf float32, and NaN in every
  weight one step later);
- ``version_ahead``: neither the group's version nor any token's is newer than the learner's
  latest version (a negative staleness is a producer bug or a forgery, never data); an
  episode's not-sampled tokens (version -1, protocol v2) never count as newer.

The same check runs on groups replayed from the write-ahead log and carried in a checkpoint, so
a group that an older learner accepted and this one refuses is skipped and counted instead of
crashing the learner in a loop.

Design: docs/design.md §5.3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np

from common.link.protocol import DecodeLimits, TrajectoryGroup

ADMISSION_REFUSAL_REASONS: Final[tuple[str, ...]] = (
    "wrong_group_size",
    "too_long",
    "reward_out_of_range",
    "version_ahead",
)

_FLOAT32_MAX: Final[float] = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Refusal:
    reason: str  # one of ADMISSION_REFUSAL_REASONS
    detail: str


@dataclass(frozen=True)
class Admission:
    group_size: int
    """Completions per group (``actor.group_size``)."""
    max_seq_tokens: int
    """Longest prompt + completion: the model's context, or a smaller learner budget."""
    max_abs_reward: float
    """Largest |reward| admitted (``learner.max_abs_reward``)."""

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.max_seq_tokens < 2 or not self.max_abs_reward > 0:
            raise ValueError(f"bad admission bounds: {self}")

    def wrong_size(self, group: TrajectoryGroup) -> Refusal | None:
        """The group-size rule (also the staleness buffer's, learner/buffer.py): a group of
        another size than the run's would break GRPO's per-prompt normalisation."""
        if len(group.completions) != self.group_size:
            return Refusal(
                "wrong_group_size",
                f"{len(group.completions)} completions, the run's group size is {self.group_size}",
            )
        return None

    def refusal(self, group: TrajectoryGroup, latest_version: int) -> Refusal | None:
        """Why the learner at ``latest_version`` must not train on ``group``; None if it may."""
        completions = group.completions
        if (wrong := self.wrong_size(group)) is not None:
            return wrong
        longest = len(group.prompt_ids) + max(len(c.token_ids) for c in completions)
        if longest > self.max_seq_tokens:
            return Refusal(
                "too_long", f"prompt + completion of {longest} tokens > {self.max_seq_tokens}"
            )
        bound = min(self.max_abs_reward, _FLOAT32_MAX)
        for c in completions:
            if not abs(c.reward) <= bound:
                return Refusal("reward_out_of_range", f"reward {c.reward!r}, bound {bound:g}")
        newest_token = max(
            (int(c.token_versions.max()) for c in completions if c.token_ids.size), default=-1
        )
        newest = max(group.version, newest_token)
        if newest > latest_version:
            return Refusal(
                "version_ahead",
                f"version {newest} is ahead of the learner's latest version {latest_version}",
            )
        return None


def wire_limits(
    vocab_size: int, admission: Admission, max_frame_bytes: int, max_turns: int = 0
) -> tuple[DecodeLimits, int]:
    """Decode limits for the learner's socket, derived from what a valid group of this run can
    hold, and the largest frame its socket reads (``max_frame_bytes``). ``max_turns``: the most
    turns of a multi-turn episode (protocol v2; 0: ``DecodeLimits``'s default).

    Both the token and the completion bounds are twice the admitted ones, so a group that is a
    little too long or too large (a misconfigured actor) still decodes and is *refused* (acked,
    so its actor stops resending it); anything beyond is an oversize frame. The decode bound on
    a frame's bytes is the smaller of ``max_frame_bytes`` and twice a valid group's size; the
    socket reads frames up to ``max_frame_bytes`` all the same, so one between the two bounds is
    read, refused as ``oversize`` and counted, not dropped unseen with its connection."""
    max_tokens = 2 * admission.max_seq_tokens
    max_completions = 2 * admission.group_size
    base = DecodeLimits(vocab_size=vocab_size)
    max_turns = max_turns or base.max_turns
    # Token ids, behaviour log-probs and token versions are 4 bytes each per token; an episode's
    # turn starts and turn rewards 4 bytes each per turn (a turn starts at a token, so there
    # are at most max_tokens); keys, the reward, the stop reason and msgpack headers are under
    # 256 bytes per completion; stats are bounded by count and string length.
    per_completion = 12 * max_tokens + 8 * min(max_turns, max_tokens) + 256
    stats = base.max_stats_entries * (base.max_str_len + 16)
    valid = 4096 + 4 * max_tokens + max_completions * per_completion + stats
    frame_bytes = max(4096, min(max_frame_bytes, valid))
    limits = DecodeLimits(
        vocab_size=vocab_size,
        max_frame_bytes=frame_bytes,
        max_completions=max_completions,
        max_tokens=max_tokens,
        max_turns=max_turns,
        socket_frame_bytes=max(frame_bytes, max_frame_bytes),
    )
    return limits, limits.socket_bytes
