"""Pearson chi-square goodness of fit, used by the statistical tests of lossless sampling and by
the benchmarks that report ``lossless`` (a p-value measured in the same run as the speed)."""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value of ``counts`` [C] against ``probs`` [C].

    Zero-probability cells must be empty (an exact sampler never emits them) and are left out;
    cells expecting fewer than 5 counts are pooled. The p-value is the chi-square survival
    function, ``Q(df/2, stat/2)`` = the regularised upper incomplete gamma function.
    """
    counts = counts.to(torch.float64)
    probs = probs.to(torch.float64)
    impossible = probs == 0
    assert counts[impossible].sum() == 0, "sampled a zero-probability outcome"
    counts, probs = counts[~impossible], probs[~impossible] / probs[~impossible].sum()
    expected = probs * counts.sum()
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum().reshape(1)])
        expected = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(len(counts) - 1), dtype=torch.float64)
    return torch.special.gammaincc(dof / 2, stat / 2).item()


def outcome_classes(
    logprobs: Mapping[Hashable, float], min_prob: float
) -> tuple[dict[Hashable, int], torch.Tensor]:
    """Classes of outcomes for a joint test: each outcome at least ``min_prob`` likely is a
    class of its own, the rest one last class ("other"); the class of every outcome and each
    class's exact probability. A function of independent samples is independent, and the
    classes keep every cell's expected count usable."""
    probs = {k: float(torch.tensor(v, dtype=torch.float64).exp()) for k, v in logprobs.items()}
    likely = sorted(k for k, p in probs.items() if p >= min_prob)  # type: ignore[type-var]
    index = {k: len(likely) for k in probs} | {k: i for i, k in enumerate(likely)}
    marginal = torch.zeros(len(likely) + 1, dtype=torch.float64)
    for k, p in probs.items():
        marginal[index[k]] += p
    return index, marginal
