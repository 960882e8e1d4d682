"""The rejection sampler: hand-computed cases, determinism, and the output distribution.

The statistical tests use context-independent per-position tables ``p_0..p_K`` and
``q_0..q_{K-1}``, so the target distribution of a length-``K+1`` sequence is the product of the
``p`` tables. Rows that emit fewer than ``K+1`` tokens are completed by plain target sampling at
the remaining positions; if the sampler is exact, the completed sequences follow the product
distribution, which a chi-square test checks over all ``V**(K+1)`` cells. Negative controls run
the same test on deliberately wrong samplers to show it has the power to fail.
"""

from __future__ import annotations

import math

import pytest
import torch

from actors.decoding.sampler import (
    PLACEHOLDER_TOKEN_ID,
    SpecResult,
    acceptance_probs,
    rejection_sample,
    residual_distribution,
    sample_inverse_cdf,
)
from testing.goodness_of_fit import chi_square_pvalue

NEG_INF = -math.inf
NUM_ROWS = 200_000  # sequences per statistical test: expected count >= 50 in every cell used


# ---------------------------------------------------------------------------------------------
# helpers


def log(probs: list[list[float]]) -> torch.Tensor:
    """[T, V] float32 log-probs from a table of probabilities (0 -> -inf)."""
    return torch.tensor(probs, dtype=torch.float64).log().to(torch.float32)


def batch_of(table: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, T, V]: the same per-position table for every row."""
    return table.unsqueeze(0).expand(rows, *table.shape)


def processed(logits: list[list[float]], temperature: float, top_p: float) -> torch.Tensor:
    """[T, V] float32 log-probs after temperature and top-p (nucleus) filtering (-inf outside)."""
    scaled = torch.tensor(logits, dtype=torch.float64) / temperature
    probs = scaled.softmax(dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p  # the smallest prefix whose mass reaches top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return scaled.masked_fill(~keep, NEG_INF).log_softmax(dim=-1).to(torch.float32)


def sample_tables(log_tables: torch.Tensor, rows: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, T] int64: at each position t an independent sample from exp(log_tables[t])."""
    probs = log_tables.to(torch.float64).exp()
    columns = [torch.multinomial(p, rows, replacement=True, generator=generator) for p in probs]
    return torch.stack(columns, dim=1)


def complete_with_target(
    result: SpecResult, target_log: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """[B, K+1]: the emitted tokens, then plain target samples at the positions not emitted."""
    rows, length = result.tokens.shape
    fill = sample_tables(target_log, rows, generator)
    positions = torch.arange(length).unsqueeze(0)
    return torch.where(positions < result.num_emitted.unsqueeze(1), result.tokens, fill)


def joint_pvalue(sequences: torch.Tensor, target_log: torch.Tensor) -> float:
    """Chi-square p-value of complete sequences [B, L] against the product of L target tables."""
    length, vocab = target_log.shape
    assert sequences.shape[1] == length
    cell = torch.zeros(sequences.shape[0], dtype=torch.int64)
    joint = torch.ones(1, dtype=torch.float64)
    for t in range(length):  # row-major: position 0 is the most significant digit
        cell = cell * vocab + sequences[:, t]
        joint = (joint.unsqueeze(1) * target_log[t].to(torch.float64).exp().unsqueeze(0)).flatten()
    counts = torch.bincount(cell, minlength=vocab**length)
    return chi_square_pvalue(counts, joint)


def first_token_pvalue(tokens: torch.Tensor, target_log: torch.Tensor) -> float:
    """Chi-square p-value of the first emitted token against p_0."""
    vocab = target_log.shape[1]
    counts = torch.bincount(tokens[:, 0], minlength=vocab)
    return chi_square_pvalue(counts, target_log[0].to(torch.float64).exp())


def accepted_pvalue(
    accepted: torch.Tensor, num_drafts: int, acceptance_rates: torch.Tensor
) -> float:
    """Chi-square p-value of the accepted counts against P(m >= i) = prod_{t<i} beta_t.

    With context-independent tables the acceptance events are independent across positions,
    each with rate ``beta_t`` (= sum_x min(p_t(x), q_t(x)), or sum_x r_t(x) p_t(x) for one-hot
    drafts drawn from r_t).
    """
    survival = torch.cat([torch.ones(1, dtype=torch.float64), acceptance_rates.cumprod(0)])
    probs = survival[:-1] - survival[1:]
    probs = torch.cat([probs, survival[-1:]])  # [num_drafts + 1]: P(m = 0..num_drafts)
    counts = torch.bincount(accepted, minlength=num_drafts + 1)
    return chi_square_pvalue(counts, probs)


# ---------------------------------------------------------------------------------------------
# table-driven cases


@pytest.mark.parametrize(
    ("p", "q", "expected"),
    [
        (0.3, 0.3, 1.0),  # p = q
        (0.6, 0.3, 1.0),  # p > q: capped at 1
        (0.1, 0.4, 0.25),  # p < q: the ratio
        (0.0, 0.4, 0.0),  # p(d) = 0: always reject
        (0.5, 0.0, 1.0),  # q(d) = 0 < p(d): the limit of min(1, p/q)
        (0.0, 0.0, 0.0),  # both zero: p(d) = 0 wins, reject
        (0.2, 1.0, 0.2),  # one-hot q: accept with p(d)
    ],
)
def test_acceptance_probs_hand_computed(p: float, q: float, expected: float) -> None:
    log_p = torch.tensor([p], dtype=torch.float64).log()
    log_q = torch.tensor([q], dtype=torch.float64).log()
    got = acceptance_probs(log_p, log_q)
    assert got.dtype == torch.float64
    assert not got.isnan().any()
    torch.testing.assert_close(got, torch.tensor([expected], dtype=torch.float64))


@pytest.mark.parametrize(
    ("p", "q", "expected"),
    [
        ([0.5, 0.3, 0.2, 0.0], [0.2, 0.3, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]),
        ([0.4, 0.4, 0.2, 0.0], [0.1, 0.1, 0.2, 0.6], [0.5, 0.5, 0.0, 0.0]),
        ([0.2, 0.3, 0.5, 0.0], [0.0, 1.0, 0.0, 0.0], [0.2 / 0.7, 0.0, 0.5 / 0.7, 0.0]),  # one-hot
        ([0.2, 0.3, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0], [0.2, 0.3, 0.5, 0.0]),  # q = 0: bonus
        ([0.2, 0.3, 0.5, 0.0], [0.2, 0.3, 0.5, 0.0], [0.2, 0.3, 0.5, 0.0]),  # no mass: fall back
    ],
)
def test_residual_distribution_hand_computed(
    p: list[float], q: list[float], expected: list[float]
) -> None:
    got = residual_distribution(torch.tensor([p]), torch.tensor([q]))
    torch.testing.assert_close(got, torch.tensor([expected], dtype=torch.float64))


def test_sample_inverse_cdf_never_returns_zero_mass_tokens() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4, dtype=torch.float64)
    largest_below_one = 1.0 - 2.0**-53
    uniforms = torch.tensor([0.0, 0.49, 0.5, largest_below_one], dtype=torch.float64)
    assert sample_inverse_cdf(probs, uniforms).tolist() == [1, 1, 3, 3]


def test_p_equals_q_always_accepts_and_bonus_samples_last_position() -> None:
    rows = 64
    shared = log([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    target = batch_of(torch.cat([shared, log([[0.0, 0.0, 1.0, 0.0]])]), rows)  # p_2 one-hot at 2
    gen = torch.Generator().manual_seed(0)
    drafts = sample_tables(shared, rows, gen)
    result = rejection_sample(target, drafts, batch_of(shared, rows), generator=gen)
    assert result.accepted.tolist() == [2] * rows
    assert result.num_emitted.tolist() == [3] * rows
    assert torch.equal(result.tokens[:, :2], drafts)
    assert result.tokens[:, 2].tolist() == [2] * rows


def test_zero_target_mass_always_rejects_and_residual_excludes_draft() -> None:
    rows = 256
    target = batch_of(log([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]), rows)
    draft_log = batch_of(log([[0.7, 0.1, 0.1, 0.1]]), rows)
    drafts = torch.zeros(rows, 1, dtype=torch.int64)  # d_1 = 0, p_0(0) = 0
    result = rejection_sample(target, drafts, draft_log, generator=torch.Generator().manual_seed(1))
    assert result.accepted.tolist() == [0] * rows
    assert result.num_emitted.tolist() == [1] * rows
    first = result.tokens[:, 0]
    assert set(first.tolist()) == {1, 2}  # the residual has mass only where p_0 has
    assert result.tokens[:, 1].tolist() == [PLACEHOLDER_TOKEN_ID] * rows


def test_zero_draft_mass_with_target_mass_always_accepts() -> None:
    rows = 128
    target = batch_of(log([[0.1, 0.9], [0.5, 0.5]]), rows)
    draft_log = batch_of(log([[1.0, 0.0]]), rows)  # q_0(1) = 0 but d_1 = 1 came from elsewhere
    drafts = torch.ones(rows, 1, dtype=torch.int64)
    result = rejection_sample(target, drafts, draft_log, generator=torch.Generator().manual_seed(2))
    assert result.accepted.tolist() == [1] * rows


def test_one_hot_drafts_greedy_target_matches_plain_greedy_decoding() -> None:
    # A greedy target (temperature -> 0) is one-hot at its argmax; with one-hot drafts the
    # output must be exactly what plain greedy decoding gives: drafts up to the first mismatch,
    # then the target's argmax there.
    greedy = log([[0, 0, 1, 0], [0, 0, 0, 1], [1, 0, 0, 0], [0, 1, 0, 0]])  # argmax 2, 3, 0, 1
    target = batch_of(greedy, 4)
    drafts = torch.tensor([[2, 3, 0], [2, 1, 0], [1, 3, 0], [2, 3, 3]])
    result = rejection_sample(target, drafts, None, generator=torch.Generator().manual_seed(3))
    assert result.accepted.tolist() == [3, 1, 0, 2]
    assert result.tokens.tolist() == [[2, 3, 0, 1], [2, 3, -1, -1], [2, -1, -1, -1], [2, 3, 0, -1]]
    assert result.num_emitted.tolist() == [4, 2, 1, 3]
    assert result.logprobs.tolist() == [[0.0] * 4] * 4  # log 1 where emitted, 0 after


def test_one_hot_drafts_accept_with_target_probability() -> None:
    # One-hot q: accept d with probability p(d) = 0.25; a rejection emits from p minus d.
    rows = 20_000
    target = batch_of(log([[0.25, 0.25, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]]), rows)
    drafts = torch.zeros(rows, 1, dtype=torch.int64)
    result = rejection_sample(target, drafts, None, generator=torch.Generator().manual_seed(4))
    rate = result.accepted.double().mean().item()
    assert abs(rate - 0.25) < 5 * math.sqrt(0.25 * 0.75 / rows)
    rejected = result.accepted == 0
    assert set(result.tokens[rejected, 0].tolist()) == {1, 2}  # d = 0 removed from the residual
    assert set(result.tokens[~rejected, 1].tolist()) == {0}  # bonus from p_1


def test_num_drafts_masks_padding_including_nan_targets() -> None:
    # Row 0 has 2 drafts, row 1 has 0 (plain sampling), row 2 has 1. Padded draft ids are -1 and
    # padded target positions are NaN: none of it may be read.
    nan = math.nan
    one_hot = [[0.0, NEG_INF, NEG_INF], [NEG_INF, 0.0, NEG_INF], [NEG_INF, NEG_INF, 0.0]]
    target = torch.tensor(
        [
            [one_hot[1], one_hot[2], one_hot[0]],
            [one_hot[2], [nan] * 3, [nan] * 3],
            [one_hot[0], one_hot[1], [nan] * 3],
        ]
    )
    drafts = torch.tensor([[1, 2], [-1, -1], [0, -1]])
    num_drafts = torch.tensor([2, 0, 1])
    result = rejection_sample(
        target, drafts, None, num_drafts, generator=torch.Generator().manual_seed(5)
    )
    assert result.accepted.tolist() == [2, 0, 1]
    assert result.tokens.tolist() == [[1, 2, 0], [2, -1, -1], [0, 1, -1]]
    assert result.num_emitted.tolist() == [3, 1, 2]
    assert not result.logprobs.isnan().any()
    assert result.logprobs.tolist() == [[0.0] * 3] * 3


def test_k_zero_is_plain_sampling_from_first_position() -> None:
    rows = 512
    target = batch_of(log([[0.0, 0.5, 0.0, 0.5]]), rows)
    result = rejection_sample(
        target,
        torch.zeros(rows, 0, dtype=torch.int64),
        torch.zeros(rows, 0, 4),
        generator=torch.Generator().manual_seed(6),
    )
    assert result.tokens.shape == (rows, 1)
    assert result.accepted.tolist() == [0] * rows
    assert result.num_emitted.tolist() == [1] * rows
    assert set(result.tokens[:, 0].tolist()) == {1, 3}
    no_bonus = rejection_sample(target, torch.zeros(rows, 0, dtype=torch.int64), None, bonus=False)
    assert no_bonus.num_emitted.tolist() == [0] * rows
    assert no_bonus.tokens.tolist() == [[PLACEHOLDER_TOKEN_ID]] * rows


def test_bonus_false_emits_nothing_extra_only_when_all_accepted() -> None:
    greedy = log([[0, 1, 0], [0, 0, 1], [1, 0, 0]])  # argmax 1, 2, 0
    target = batch_of(greedy, 2)
    drafts = torch.tensor([[1, 2], [1, 0]])  # row 0 all accepted, row 1 rejected at d_2
    result = rejection_sample(target, drafts, None, bonus=False)
    assert result.accepted.tolist() == [2, 1]
    assert result.num_emitted.tolist() == [2, 2]
    assert result.tokens.tolist() == [[1, 2, -1], [1, 2, -1]]  # row 1 still gets its residual


def test_bonus_flag_does_not_change_the_random_stream() -> None:
    rows = 2_000
    target_log = log([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.3, 0.3, 0.2, 0.2]])
    draft_log = log([[0.4, 0.4, 0.1, 0.1], [0.1, 0.1, 0.4, 0.4]])
    drafts = sample_tables(draft_log, rows, torch.Generator().manual_seed(7))
    args = (batch_of(target_log, rows), drafts, batch_of(draft_log, rows))
    with_bonus = rejection_sample(*args, generator=torch.Generator().manual_seed(8))
    without = rejection_sample(*args, generator=torch.Generator().manual_seed(8), bonus=False)
    assert torch.equal(with_bonus.accepted, without.accepted)
    rejected = with_bonus.accepted < 2
    assert torch.equal(with_bonus.tokens[rejected], without.tokens[rejected])


def test_logprobs_are_target_logprobs_of_emitted_tokens() -> None:
    rows = 1_000
    target_log = processed([[1.0, 2.0, 0.5, -1.0, 0.0]] * 4, temperature=0.7, top_p=0.9)
    draft_log = processed([[0.0, 0.5, 2.0, 1.0, 0.0]] * 3, temperature=1.3, top_p=1.0)
    gen = torch.Generator().manual_seed(9)
    drafts = sample_tables(draft_log, rows, gen)
    target = batch_of(target_log, rows)
    result = rejection_sample(target, drafts, batch_of(draft_log, rows), generator=gen)
    assert result.logprobs.dtype == torch.float32
    assert result.tokens.dtype == result.accepted.dtype == result.num_emitted.dtype == torch.int64
    emitted = torch.arange(4).unsqueeze(0) < result.num_emitted.unsqueeze(1)
    assert torch.equal(emitted, result.tokens != PLACEHOLDER_TOKEN_ID)
    expected = target.gather(-1, result.tokens.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    assert torch.equal(result.logprobs[emitted], expected[emitted])
    assert torch.isfinite(result.logprobs).all()  # never emits a -inf (filtered) token
    assert (result.logprobs[~emitted] == 0).all()


def test_rejects_mismatched_shapes() -> None:
    target = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="draft_tokens"):
        rejection_sample(target, torch.zeros(2, 3, dtype=torch.int64), None)
    with pytest.raises(ValueError, match="draft_logprobs"):
        rejection_sample(target, torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, 5))
    with pytest.raises(ValueError, match="num_drafts"):
        rejection_sample(target, torch.zeros(2, 2, dtype=torch.int64), None, torch.ones(3))
    with pytest.raises(ValueError, match="integer"):
        rejection_sample(target, torch.zeros(2, 2), None)


# ---------------------------------------------------------------------------------------------
# determinism


def _stochastic_batch(rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    target_log = log([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25] * 4, [0.7, 0.1, 0.1, 0.1]])
    draft_log = log([[0.4, 0.4, 0.1, 0.1], [0.1, 0.1, 0.4, 0.4], [0.6, 0.1, 0.2, 0.1]])
    drafts = sample_tables(draft_log, rows, torch.Generator().manual_seed(10))
    return batch_of(target_log, rows), drafts, batch_of(draft_log, rows)


def test_same_seed_same_output_different_seed_different_output() -> None:
    args = _stochastic_batch(1_000)
    first = rejection_sample(*args, generator=torch.Generator().manual_seed(11))
    again = rejection_sample(*args, generator=torch.Generator().manual_seed(11))
    other = rejection_sample(*args, generator=torch.Generator().manual_seed(12))
    for name in ("accepted", "tokens", "logprobs", "num_emitted"):
        assert torch.equal(getattr(first, name), getattr(again, name)), name
    assert not torch.equal(first.tokens, other.tokens)


def test_consumes_one_uniform_block_of_shape_b_by_k_plus_one() -> None:
    # The documented stream: exactly one rand((B, K+1), float64) draw.
    target, drafts, draft_log = _stochastic_batch(100)
    gen = torch.Generator().manual_seed(13)
    rejection_sample(target, drafts, draft_log, generator=gen)
    reference = torch.Generator().manual_seed(13)
    torch.rand((100, 4), generator=reference, dtype=torch.float64)
    assert torch.equal(torch.rand(5, generator=gen), torch.rand(5, generator=reference))


# ---------------------------------------------------------------------------------------------
# statistical tests of the output distribution

P_TABLES = log([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25] * 4, [0.7, 0.1, 0.1, 0.1]])
Q_TABLES = log([[0.4, 0.4, 0.1, 0.1], [0.1, 0.1, 0.4, 0.4], [0.6, 0.1, 0.2, 0.1]])
# Processed tables with disjoint -inf patterns: the draft puts mass on tokens the target filtered
# out (forced rejections) and misses tokens the target keeps (reachable only via the residual).
P_PROCESSED = processed(
    [
        [2.0, 1.5, 1.0, 0.2, -1.0, -3.0],
        [0.0, 0.3, 2.5, 1.0, 0.5, -2.0],
        [1.0, 1.0, 1.0, 0.0, 2.0, 0],
    ],
    temperature=0.8,
    top_p=0.85,
)
Q_PROCESSED = processed(
    [[-2.0, 1.0, 0.5, 2.0, 1.5, 0.0], [2.0, 1.0, -1.0, 0.5, 0.0, 1.5]],
    temperature=1.5,
    top_p=0.9,
)


def test_processed_tables_exercise_filtered_tokens() -> None:
    # The temperature/top-p case is only meaningful if the supports really differ.
    p_kept = P_PROCESSED[:-1] > NEG_INF  # [K, V]
    q_kept = Q_PROCESSED > NEG_INF
    assert (~p_kept).any() and (~q_kept).any()
    assert (q_kept & ~p_kept).any()  # draft proposes tokens the target filtered out
    assert (p_kept & ~q_kept).any()  # target tokens the draft never proposes


def _min_mass(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """[K] beta_t = sum_x min(p_t(x), q_t(x)): the per-position acceptance rate."""
    return torch.minimum(p_log[:-1].double().exp(), q_log.double().exp()).sum(-1)


@pytest.mark.parametrize(
    ("p_log", "q_log", "ragged"),
    [(P_TABLES, Q_TABLES, False), (P_TABLES, Q_TABLES, True), (P_PROCESSED, Q_PROCESSED, False)],
    ids=["stochastic", "stochastic-ragged-num-drafts", "temperature-top-p"],
)
def test_output_follows_target_with_stochastic_drafts(
    p_log: torch.Tensor, q_log: torch.Tensor, ragged: bool
) -> None:
    gen = torch.Generator().manual_seed(20)
    k = q_log.shape[0]
    drafts = sample_tables(q_log, NUM_ROWS, gen)
    num_drafts = torch.randint(0, k + 1, (NUM_ROWS,), generator=gen) if ragged else None
    result = rejection_sample(
        batch_of(p_log, NUM_ROWS), drafts, batch_of(q_log, NUM_ROWS), num_drafts, generator=gen
    )
    assert first_token_pvalue(result.tokens, p_log) >= 1e-3
    assert joint_pvalue(complete_with_target(result, p_log, gen), p_log) >= 1e-3
    if not ragged:
        assert accepted_pvalue(result.accepted, k, _min_mass(p_log, q_log)) >= 1e-3


@pytest.mark.parametrize(
    ("p_log", "r_log"), [(P_TABLES, Q_TABLES), (P_PROCESSED, Q_PROCESSED)], ids=["plain", "top-p"]
)
def test_output_follows_target_with_one_hot_drafts(
    p_log: torch.Tensor, r_log: torch.Tensor
) -> None:
    # Deterministic proposers: whatever picks the draft tokens (here samples from r_t, as an
    # n-gram table might), q is one-hot at the draft, and the output must still follow p.
    gen = torch.Generator().manual_seed(21)
    k = r_log.shape[0]
    drafts = sample_tables(r_log, NUM_ROWS, gen)
    result = rejection_sample(batch_of(p_log, NUM_ROWS), drafts, None, generator=gen)
    assert first_token_pvalue(result.tokens, p_log) >= 1e-3
    assert joint_pvalue(complete_with_target(result, p_log, gen), p_log) >= 1e-3
    rates = (r_log.double().exp() * p_log[:-1].double().exp()).sum(-1)  # sum_x r_t(x) p_t(x)
    assert accepted_pvalue(result.accepted, k, rates) >= 1e-3


def test_negative_control_always_accept_fails_the_same_test() -> None:
    # Emitting every draft plus a bonus sample gives q_0..q_{K-1} x p_K, not the target.
    gen = torch.Generator().manual_seed(22)
    drafts = sample_tables(Q_TABLES, NUM_ROWS, gen)
    bonus = sample_tables(P_TABLES[-1:], NUM_ROWS, gen)
    wrong = torch.cat([drafts, bonus], dim=1)
    assert first_token_pvalue(wrong, P_TABLES) < 1e-6
    assert joint_pvalue(wrong, P_TABLES) < 1e-6


def test_negative_control_resampling_target_instead_of_residual_fails() -> None:
    # The classic bug: at a rejection, sample p instead of norm(max(0, p - q)).
    gen = torch.Generator().manual_seed(23)
    k = Q_TABLES.shape[0]
    drafts = sample_tables(Q_TABLES, NUM_ROWS, gen)
    result = rejection_sample(
        batch_of(P_TABLES, NUM_ROWS), drafts, batch_of(Q_TABLES, NUM_ROWS), generator=gen
    )
    plain = sample_tables(P_TABLES, NUM_ROWS, gen)  # [B, K+1] fresh target samples
    rows = torch.arange(NUM_ROWS)
    rejected = result.accepted < k
    tokens = result.tokens.clone()
    at = result.accepted[rejected]
    tokens[rows[rejected], at] = plain[rows[rejected], at]
    wrong = SpecResult(result.accepted, tokens, result.logprobs, result.num_emitted)
    assert first_token_pvalue(wrong.tokens, P_TABLES) < 1e-6
    assert joint_pvalue(complete_with_target(wrong, P_TABLES, gen), P_TABLES) < 1e-6
