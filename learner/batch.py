"""Collation of trajectory groups into padded training tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.link.protocol import TrajectoryGroup
from learner.loss import grpo_advantages


@dataclass
class TrainBatch:
    """Prompt + completion rows, right-padded; index t of the ``*_logprobs``/``mask`` tensors is
    the prediction of token t+1 of ``input_ids`` (so the mask covers completion tokens only)."""

    input_ids: torch.Tensor  # [B, S] int64
    targets: torch.Tensor  # [B, S-1] int64, input_ids shifted left
    mask: torch.Tensor  # [B, S-1] float32, 1 where targets is a generated token
    behaviour_logprobs: torch.Tensor  # [B, S-1] float32, 0 where mask is 0
    advantages: torch.Tensor  # [B] float32
    rewards: torch.Tensor  # [N, G] float32
    staleness: torch.Tensor  # [N] int64, learner version - group version

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum().item())


def collate(
    groups: Sequence[TrajectoryGroup], learner_version: int, pad_id: int, device: torch.device
) -> TrainBatch:
    group_sizes = {len(g.completions) for g in groups}
    if len(group_sizes) != 1:
        # GRPO normalises within a group; equal sizes keep the [N, G] reward tensor rectangular.
        raise ValueError(
            f"all groups of a batch need the same size, got sizes {sorted(group_sizes)}"
        )
    rewards = torch.tensor(
        [[c.reward for c in g.completions] for g in groups], dtype=torch.float32
    )  # [N, G]
    advantages = grpo_advantages(rewards).reshape(-1)  # [N*G]

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
        # Token p + k is predicted at index p + k - 1.
        mask[i, p - 1 : p - 1 + t] = 1.0
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
