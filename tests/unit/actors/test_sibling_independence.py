"""The G completions of one prompt stay independent samples under n-gram drafting.

The n-gram drafter couples the rows of a batch: with ``ngram_sources="group"`` a row also drafts
from the tokens its siblings (the other completions of the same prompt) have sampled so far.
Drafts are only proposals; the rejection sampler must still make every sibling an exact sample
of the policy, independent of the others, or GRPO's group-normalised advantages are computed on
correlated samples (docs/design.md §2.3). A shared acceptance uniform, or a draft that reads a
sibling's token of the same step, would break it.

Test: on a model small enough to enumerate every complete output, draw many groups of 2
siblings and compare the joint counts of (sibling A's output, sibling B's output) with the
product of the exact marginals, by a chi-square test. Outputs are classed as themselves when
likely and as "other" otherwise; a function of independent samples is independent, and the
classes keep every cell's expected count usable. A negative control couples the siblings on
purpose (B copies A with probability 0.2, which leaves both marginals exact) and must be caught.
"""

from __future__ import annotations

import pytest
import torch

from actors.engines.torch.engine import TorchEngine
from common.config.actor import SpecConfig
from testing.goodness_of_fit import chi_square_pvalue, outcome_classes
from testing.lossless_check import exact_sequence_logprobs, peaky_model

EOS = 2
PROMPT = [1, 3, 1, 3]  # repeats, so rows draft from their own context as well as the sibling's
MAX_NEW = 6
TEMPERATURE = 1.0
GROUPS = 3000
COPY_PROB = 0.2
CLASS_MIN_PROB = 0.02  # outputs at least this likely are classes of their own
MODEL = peaky_model(vocab=4, seed=1, scale=8.0)


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny generate calls: on shared cores a second torch thread only spins."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def output_classes() -> tuple[dict[tuple[int, ...], int], torch.Tensor]:
    """Class index of every complete output of the test model, and each class's exact
    probability; the last class is "other"."""
    exact = exact_sequence_logprobs(MODEL, PROMPT, MAX_NEW, TEMPERATURE, 1.0, EOS)
    return outcome_classes(exact, CLASS_MIN_PROB)


def joint_pvalue(pairs: list[tuple[int, int]], marginal: torch.Tensor) -> float:
    """Chi-square p-value of the (A, B) class counts against ``marginal`` x ``marginal``."""
    c = len(marginal)
    counts = torch.zeros(c * c, dtype=torch.float64)
    for a, b in pairs:
        counts[a * c + b] += 1
    return chi_square_pvalue(counts, torch.outer(marginal, marginal).flatten())


def sibling_pairs(engine: TorchEngine, index: dict[tuple[int, ...], int]) -> list[tuple[int, int]]:
    """One group of 2 per generate call, so a row's batch is exactly its prompt's group."""
    pairs = []
    for _ in range(GROUPS):
        a, b = engine.generate([PROMPT], 2, MAX_NEW)[0]
        pairs.append((index[tuple(a.token_ids.tolist())], index[tuple(b.token_ids.tolist())]))
    return pairs


def test_siblings_are_independent_under_group_ngram_drafts():
    index, marginal = output_classes()
    assert len(marginal) >= 10 and marginal[-1] < 0.7  # enough classes to see a dependence
    engine = TorchEngine(
        MODEL,
        EOS,
        pad_id=0,
        temperature=TEMPERATURE,
        seed=11,
        spec=SpecConfig(method="ngram", k=4, ngram_max_n=3, ngram_sources="group", adaptive=False),
    )
    pairs = sibling_pairs(engine, index)
    # Drafting really happened and was accepted (about 0.26 of drafts with this model).
    assert engine.stats()["spec/acceptance_rate"] > 0.1
    p_value = joint_pvalue(pairs, marginal)
    assert p_value > 1e-3, f"siblings' joint distribution is not the product: p = {p_value:.2e}"


def test_negative_control_detects_coupled_siblings():
    """B copies A with probability 0.2: each marginal is still exact, only the joint is wrong."""
    index, marginal = output_classes()
    engine = TorchEngine(MODEL, EOS, pad_id=0, temperature=TEMPERATURE, seed=12)
    rng = torch.Generator().manual_seed(0)
    pairs = [
        (a, a if torch.rand((), generator=rng) < COPY_PROB else b)
        for a, b in sibling_pairs(engine, index)
    ]
    b_counts = torch.bincount(torch.tensor([b for _, b in pairs]), minlength=len(marginal))
    assert chi_square_pvalue(b_counts.double(), marginal) > 1e-3  # B alone looks exact
    assert joint_pvalue(pairs, marginal) < 1e-6
