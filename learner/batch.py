"""Collation of trajectory groups into padded training tensors, with the reward-side algorithm
options: DAPO's overlong handling (``mask``, ``penalty``), Dr.GRPO's advantages without the std
division, and the no-signal test of dynamic sampling.

Only sampled tokens are trained: a multi-turn episode (protocol v2) carries environment and
glue tokens with version -1 in its token stream; they are context (input ids) but never
targets of the loss, and never counted as the completion's length. A single-turn completion's
tokens are all sampled, so for it nothing differs from training every completion token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.config.field_types import OverlongMode
from common.config.learner import LearnerConfig
from common.link.protocol import Completion, TrajectoryGroup
from learner.loss import grpo_advantages


@dataclass
class TrainBatch:
    """Prompt + completion rows, right-padded; index t of the ``*_logprobs``/``mask`` tensors is
    the prediction of token t+1 of ``input_ids`` (so the mask covers completion tokens only)."""

    input_ids: torch.Tensor  # [B, S] int64
    targets: torch.Tensor  # [B, S-1] int64, input_ids shifted left
    mask: torch.Tensor  # [B, S-1] float32, 1 where targets is a sampled token
    behaviour_logprobs: torch.Tensor  # [B, S-1] float32, 0 where mask is 0
    advantages: torch.Tensor  # [B] float32
    rewards: torch.Tensor  # [N, G] float32
    staleness: torch.Tensor  # [N] int64, learner version - group version

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum().item())


@dataclass(frozen=True)
class RewardShaping:
    """What the learner does to rewards and completions before the loss (defaults: nothing)."""

    std_norm: bool = True
    """Divide by the group's reward std (``learner.adv_std_norm``)."""
    overlong: OverlongMode = "none"
    max_new_tokens: int = 0
    """The length limit; ``overlong=penalty`` needs it."""
    buffer: int = 0
    """``learner.overlong_buffer`` (0: a quarter of ``max_new_tokens``)."""
    penalty: float = 1.0

    @staticmethod
    def from_config(cfg: LearnerConfig, max_new_tokens: int = 0) -> RewardShaping:
        return RewardShaping(
            std_norm=cfg.adv_std_norm,
            overlong=cfg.overlong,
            max_new_tokens=max_new_tokens,
            buffer=cfg.overlong_buffer,
            penalty=cfg.overlong_penalty,
        )

    def length_penalty(self, length: int) -> float:
        """DAPO's soft overlong punishment (added to the reward): 0 up to ``L - buffer``, then
        falling linearly to ``-penalty`` at ``L = max_new_tokens``, ``-penalty`` beyond."""
        if self.overlong != "penalty" or self.max_new_tokens <= 0:
            return 0.0
        limit = self.max_new_tokens
        buffer = min(self.buffer or max(limit // 4, 1), limit)
        if length <= limit - buffer:
            return 0.0
        if length > limit:
            return -self.penalty
        return (limit - buffer - length) / buffer * self.penalty


def sampled(completion: Completion) -> np.ndarray:
    """[T] bool: which tokens of ``completion`` the policy sampled (version >= 0), the ones the
    loss trains; the others (version -1) are an episode's environment and glue tokens."""
    return completion.token_versions >= 0


def sampled_count(completion: Completion) -> int:
    """The completion's length as the algorithms count it: its sampled tokens."""
    return int(np.count_nonzero(sampled(completion)))


def shaped_rewards(
    groups: Sequence[TrajectoryGroup], shaping: RewardShaping | None = None
) -> torch.Tensor:
    """Rewards [N, G], float32, with the overlong penalty when ``shaping`` asks for it (on the
    sampled tokens' count: an episode's environment tokens are not the policy's length)."""
    shaping = shaping or RewardShaping()
    rows = [
        [c.reward + shaping.length_penalty(sampled_count(c)) for c in g.completions] for g in groups
    ]
    return torch.tensor(rows, dtype=torch.float32)


def has_signal(group: TrajectoryGroup, shaping: RewardShaping | None = None) -> bool:
    """Whether the group's (shaped) rewards differ: a group whose completions all earn the same
    reward has zero advantages and teaches nothing (dynamic sampling skips it)."""
    rewards = shaped_rewards([group], shaping)
    return bool(np.ptp(rewards.numpy()) > 0)


def collate(
    groups: Sequence[TrajectoryGroup],
    learner_version: int,
    pad_id: int,
    device: torch.device,
    shaping: RewardShaping | None = None,
) -> TrainBatch:
    group_sizes = {len(g.completions) for g in groups}
    if len(group_sizes) != 1:
        # GRPO normalises within a group; equal sizes keep the [N, G] reward tensor rectangular.
        raise ValueError(
            f"all groups of a batch need the same size, got sizes {sorted(group_sizes)}"
        )
    shaping = shaping or RewardShaping()
    rewards = shaped_rewards(groups, shaping)  # [N, G]
    advantages = grpo_advantages(rewards, std_norm=shaping.std_norm).reshape(-1)  # [N*G]

    rows = [(g.prompt_ids, c) for g in groups for c in g.completions]
    seq_len = max(len(p) + len(c.token_ids) for p, c in rows)
    batch = len(rows)
    input_ids = torch.full((batch, seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, seq_len - 1), dtype=torch.float32)
    behaviour = torch.zeros((batch, seq_len - 1), dtype=torch.float32)
    for i, (prompt, completion) in enumerate(rows):
        p, t = len(prompt), len(completion.token_ids)
        input_ids[i, :p] = torch.from_numpy(prompt.astype("int64"))
        input_ids[i, p : p + t] = torch.from_numpy(completion.token_ids.astype("int64"))
        # Token p + k is predicted at index p + k - 1, and trained where it was sampled.
        # overlong=mask: an unfinished completion (it hit a limit) stays out of the loss.
        if shaping.overlong != "mask" or completion.finished:
            mask[i, p - 1 : p - 1 + t] = torch.from_numpy(sampled(completion).astype(np.float32))
        behaviour[i, p - 1 : p - 1 + t] = torch.from_numpy(completion.behaviour_logprobs)
    staleness = torch.tensor([learner_version - g.version for g in groups], dtype=torch.long)
    return TrainBatch(
        input_ids=input_ids.to(device),
        targets=input_ids[:, 1:].to(device),
        mask=mask.to(device),
        behaviour_logprobs=behaviour.to(device),
        advantages=advantages.to(device),
        rewards=rewards,
        staleness=staleness,
    )
