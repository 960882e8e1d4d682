"""Pearson chi-square goodness of fit, used by the statistical tests of lossless sampling and by
the benchmarks that report ``lossless`` (a p-value measured in the same run as the speed)."""

from __future__ import annotations

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
