"""The value rules of protocol v2: a group whose completions are multi-turn episodes.

A v2 completion is still one linear token stream after the prompt (model turns, glue and
environment tokens), with per-token behaviour log-probs and policy versions. Tokens the policy
did not sample (environment observations, chat glue) carry version ``ENV_VERSION`` (-1) and
log-prob exactly 0.0: the learner never trains on them (its loss mask is ``version >= 0``) and
the actor never verifies them. Optional per-completion fields: ``turn_starts`` (index of each
model turn's first token), ``turn_rewards`` (the environment's reward after each turn) and
``stop`` (why the episode ended).

``common.link.protocol`` parses the structure (types, keys, array sizes) and calls
:func:`episode_refusal` for the values; it returns the ``ProtocolError`` reason and detail
instead of raising, so this module does not import the codec that imports it. Design:
docs/design.md §5.1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol

import numpy as np


class Completion(Protocol):
    """What these checks read of a ``common.link.protocol.Completion`` (named structurally, so
    this module imports nothing of the codec that calls it)."""

    token_ids: np.ndarray
    behaviour_logprobs: np.ndarray
    token_versions: np.ndarray
    reward: float
    finished: bool
    turn_starts: np.ndarray | None
    turn_rewards: np.ndarray | None
    stop: str | None


ENV_VERSION: Final[int] = -1
"""``token_versions`` value of a token the policy did not sample."""

STOP_REASONS: Final[tuple[str, ...]] = (
    "eos",  # the model ended its last turn, and the episode with it
    "env_done",  # the environment ended the episode (terminated or truncated)
    "length",  # the last turn hit its token budget
    "max_turns",  # the episode reached its turn limit
    "context",  # the next turn would not fit the context / total token budget
    "env_error",  # the environment failed (crash, exception, invalid reply)
    "env_timeout",  # the environment did not answer in time
)
"""The values of a completion's ``stop``."""

FINISHED_STOPS: Final[frozenset[str]] = frozenset({"eos", "env_done"})
"""The stops of a finished episode: ``Completion.finished`` is ``stop in FINISHED_STOPS``, so
``learner.overlong=mask`` leaves every other end out of the loss, as it does a single-turn
completion that hit its length limit."""

WireRefusal = tuple[str, str]
"""(``ProtocolError`` reason, detail)."""


def uses_v2(completion: Completion) -> bool:
    """Whether ``completion`` needs protocol v2: a not-sampled token or an optional field."""
    if (
        completion.turn_starts is not None
        or completion.turn_rewards is not None
        or completion.stop is not None
    ):
        return True
    versions = np.asarray(completion.token_versions)
    return bool(versions.size) and int(versions.min()) < 0


def episode_refusal(completions: Sequence[Completion], group_version: int) -> WireRefusal | None:
    """Why the decoded completions of a v2 group (arrays of the wire dtypes, structure already
    checked) break the v2 value rules, or are not an episode at all, or None. One reduction
    per rule over the whole group, then the per-completion rules."""
    if len(completions) == 1:
        versions, logprobs = completions[0].token_versions, completions[0].behaviour_logprobs
    else:
        versions = np.concatenate([c.token_versions for c in completions])
        logprobs = np.concatenate([c.behaviour_logprobs for c in completions])
    if versions.size and int(versions.min()) < ENV_VERSION:
        return "out_of_range", f"token_versions must be >= {ENV_VERSION}"
    not_sampled = versions == ENV_VERSION
    if (logprobs[not_sampled] != 0.0).any():
        return "out_of_range", "a token of version -1 (not sampled) needs log-prob 0.0"
    sampled = versions[~not_sampled]
    # A group counts as its oldest sampled token's version (staleness is about sampled tokens).
    if sampled.size and int(sampled.min()) != group_version:
        return "bad_field", f"group version {group_version} != oldest sampled {int(sampled.min())}"
    for i, completion in enumerate(completions):
        if (refusal := _completion_refusal(completion)) is not None:
            return refusal[0], f"completion {i}: {refusal[1]}"
    if not any(uses_v2(c) for c in completions):
        # One encoding per message: encode writes v1 for a group without an episode field.
        return "wrong_version", "a v2 group without an episode field is v1"
    return None


def _completion_refusal(c: Completion) -> WireRefusal | None:
    """The per-completion v2 rules: sampled first and last token, ``stop`` and ``finished``
    agree, and the turn arrays."""
    versions = c.token_versions
    if versions.size and (versions[0] == ENV_VERSION or versions[-1] == ENV_VERSION):
        # Nothing can be trained on or scored after the last sampled token, and the first turn
        # starts right after the prompt.
        return "bad_field", "an episode starts and ends with a sampled token"
    if c.stop is not None:
        if c.stop not in STOP_REASONS:
            return "bad_field", f"stop {c.stop!r} is not one of {STOP_REASONS}"
        if c.finished != (c.stop in FINISHED_STOPS):
            return "bad_field", f"finished={c.finished} disagrees with stop={c.stop!r}"
    if (c.turn_starts is None) != (c.turn_rewards is None):
        return "bad_field", "turn_starts and turn_rewards come together"
    if c.turn_starts is None or c.turn_rewards is None:
        return None
    return _turns_refusal(c.turn_starts, c.turn_rewards, versions)


def _turns_refusal(
    starts: np.ndarray, rewards: np.ndarray, versions: np.ndarray
) -> WireRefusal | None:
    """``starts`` strictly increasing from 0, inside the completion, each at a sampled token
    (a non-empty completion has at least one turn); one finite reward per turn."""
    if len(rewards) != len(starts):
        return "length_mismatch", f"turn_starts {len(starts)}, turn_rewards {len(rewards)}"
    if not np.isfinite(rewards).all():
        return "non_finite", "turn_rewards"
    if versions.size and not starts.size:
        return "bad_field", "a non-empty episode has at least one turn"
    if starts.size and int(starts[0]) != 0:
        return "bad_field", f"the first turn starts at 0, not {int(starts[0])}"
    if (np.diff(starts) <= 0).any():
        return "bad_field", "turn_starts must be strictly increasing"
    if starts.size and int(starts[-1]) >= versions.size:
        return "bad_field", f"turn start {int(starts[-1])} beyond {versions.size} tokens"
    if (versions[starts] == ENV_VERSION).any():
        return "bad_field", "a turn starts at a token that was not sampled"
    return None
