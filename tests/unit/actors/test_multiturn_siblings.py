"""Siblings stay independent across turns (design note §5.2): two-turn episodes of one group,
drafting from each other's tokens (``spec=ngram``, ``ngram_sources=group``) through the torch
engine's turn-request stream, with a token-dependent random environment between the turns.
Episodes 2i and 2i + 1 are a pair; their joint law must be the product of the exact episode
law (``testing/multiturn_check.py``), by a chi-square test over outcome classes. The control
gives each pair one environment random bit (one RNG for two siblings): every episode's own law
stays exact, the pair's does not, and the same test catches it."""

from __future__ import annotations

import torch

from common.config.actor import SpecConfig
from testing import multiturn_check as mc
from testing.goodness_of_fit import chi_square_pvalue, outcome_classes

PAIRS = 4000
CLASS_MIN_PROB = 0.02
"""Outcomes at least this likely are classes of their own; the rest are one class."""
GROUP_NGRAM = SpecConfig(method="ngram", k=2, ngram_max_n=2, ngram_sources="group", adaptive=False)


def pair_pvalues(coupled: bool) -> tuple[float, float, float]:
    """(joint p against the product, first siblings' marginal p, acceptance rate)."""
    engine, _, episodes, (old, _) = mc.serve_episodes(
        "verify_on_swap", "never", 2 * PAIRS, seed=5, spec=GROUP_NGRAM, coupled=coupled
    )
    index, marginal = outcome_classes(mc.exact_episode_logprobs(old, old), CLASS_MIN_PROB)
    c = len(marginal)
    joint = torch.zeros(c * c, dtype=torch.float64)
    first = torch.zeros(c, dtype=torch.float64)
    for a, b in zip(episodes[0::2], episodes[1::2], strict=True):
        i, j = index[a.outcome()], index[b.outcome()]
        joint[i * c + j] += 1
        first[i] += 1
    product = torch.outer(marginal, marginal).flatten()
    acceptance = engine.stats()["spec/acceptance_rate"]
    return chi_square_pvalue(joint, product), chi_square_pvalue(first, marginal), acceptance


def test_siblings_stay_independent_across_turns_with_group_drafts():
    joint, marginal, acceptance = pair_pvalues(coupled=False)
    assert acceptance > 0.05  # drafts from the siblings were proposed and accepted
    assert marginal > 0.01 and joint > 0.01, (marginal, joint)


def test_control_siblings_sharing_an_environment_rng_fail():
    joint, marginal, _ = pair_pvalues(coupled=True)
    assert marginal > 0.01  # each episode alone still follows the law
    assert joint < 0.01, joint
