"""Random trajectory groups for tests of the learner's batching and training step."""

from __future__ import annotations

import numpy as np

from common.link.protocol import Completion, TrajectoryGroup


def make_groups(vocab: int, n: int = 3, g: int = 4, version: int = 0) -> list[TrajectoryGroup]:
    """``n`` groups of ``g`` completions each (1 to 5 tokens, prompts of 2 to 4), tokens in
    3..``vocab``-1, every token of ``version``, rewards alternating 0 and 1; the same groups on
    every call (seed 0)."""
    rng = np.random.default_rng(0)
    groups = []
    for i in range(n):
        completions = []
        for j in range(g):
            t = int(rng.integers(1, 6))
            completions.append(
                Completion(
                    token_ids=rng.integers(3, vocab, t).astype(np.int32),
                    behaviour_logprobs=(-rng.random(t) * 3).astype(np.float32),
                    token_versions=np.full(t, version, np.int32),
                    reward=float(j % 2),
                    finished=bool(j % 2),
                )
            )
        groups.append(group_of(rng, i, completions, vocab, version))
    return groups


def group_of(
    rng: np.random.Generator, i: int, completions: list[Completion], vocab: int, version: int
) -> TrajectoryGroup:
    """Group ``i`` of actor ``a`` holding ``completions``, with a random prompt of 2 to 4
    tokens in 3..``vocab``-1."""
    return TrajectoryGroup(
        actor_id="a",
        seq=i,
        prompt_id=f"p{i}",
        prompt_ids=rng.integers(3, vocab, int(rng.integers(2, 5))).astype(np.int32),
        version=version,
        completions=completions,
    )
