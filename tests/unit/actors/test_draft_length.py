"""Adaptive draft length (actors/decoding/draft_length.py): the controller's decisions on synthetic
acceptance and step times under a fake clock, and the torch engine with it on, still lossless."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from actors.decoding.draft_length import (
    EARLY_EXIT,
    NGRAM,
    PLAIN,
    PLAIN_STEP,
    Choice,
    DraftLength,
    StepOutcome,
    rows_bucket,
)
from actors.engines.torch.engine import TorchEngine
from common import metric_names as mn
from common.config.actor import SpecConfig
from ops.report import render_markdown
from testing.lossless_check import (
    EOS,
    greedy_matches_plain,
    peaky_model,
    sequence_pvalue,
)
from tests.unit.actors.engine_helpers import jittery_clock


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def accepted_counts(rows: int, conditional: list[float]) -> list[int]:
    """Accepted drafts per row, deterministic: ``round(rows * P(first i + 1 accepted))`` rows
    accept position i, for the conditional acceptance by position ``conditional``."""
    at_least, p = [], 1.0
    for c in conditional:
        p *= c
        at_least.append(round(rows * p))
    return [sum(r < n for n in at_least) for r in range(rows)]


def drive(control, steps, rows, seconds, accept, matches=None, step0=0):
    """Run ``steps`` decisions: ``seconds(choice)`` is the step's time on the fake clock,
    ``accept(drafter, step)`` the conditional acceptance of that drafter's drafts (the same at
    every position); every row's n-gram match length is ``matches`` (None: no n-gram).
    Returns the choices and the tokens and seconds they took."""
    clock = control.clock
    choices, tokens, elapsed = [], 0, clock.now
    for step in range(step0, step0 + steps):
        lengths = None if matches is None else [matches] * rows
        choice = control.choose(rows, lengths)
        accepted = proposed = forced = None
        if choice.kind == NGRAM:
            proposed = [min(choice.k, matches)] * rows
            accepted = accepted_counts(rows, [accept(NGRAM, step)] * proposed[0])
        elif choice.kind == EARLY_EXIT:
            prefix = min(choice.k, matches) if choice.ngram_prefix else 0
            conditional = [
                accept(NGRAM if i < prefix else EARLY_EXIT, step) for i in range(choice.k)
            ]
            proposed, accepted = [choice.k] * rows, accepted_counts(rows, conditional)
            forced = [prefix] * rows if choice.ngram_prefix else None
        started = clock()
        clock.now += seconds(choice, step)
        control.learn(StepOutcome(choice, rows, clock() - started, accepted, proposed, forced))
        choices.append(choice)
        tokens += rows + (sum(accepted) if accepted else 0)
    return choices, tokens, clock.now - elapsed


def linear_cost(per_draft: float, exit_pass: float = 0.0, load=None):
    """Seconds of a step: 1 for plain, ``1 + per_draft * k`` to verify k drafts, plus
    ``exit_pass * (k + 1)`` for the early exit's passes; times ``load(step)`` if given."""

    def seconds(choice: Choice, step: int = 0) -> float:
        factor = load(step) if load is not None else 1.0
        if choice.kind == PLAIN:
            return factor
        extra = exit_pass * (choice.k + 1) if choice.kind == EARLY_EXIT else 0.0
        return factor * (1.0 + per_draft * choice.k + extra)

    return seconds


def machine_load(seed: int, steps: int) -> list[float]:
    """A load that comes and goes (1x to about 3x, over tens of steps), with hiccups."""
    rng = random.Random(seed)
    level, out = 0.0, []
    for _ in range(steps):
        level = 0.95 * level + rng.gauss(0.0, 0.1)
        hiccup = 1.0 + 2.0 * rng.random() if rng.random() < 0.05 else 1.0
        out.append(math.exp(abs(level)) * hiccup)
    return out


def best_k(rows: int, c: float, k_max: int, seconds) -> Choice:
    """The choice with the most tokens per second under the true model of :func:`drive`."""
    scores = {PLAIN_STEP: rows / seconds(PLAIN_STEP)}
    for k in range(1, k_max + 1):
        choice = Choice(NGRAM, k)
        scores[choice] = (rows + sum(accepted_counts(rows, [c] * k))) / seconds(choice)
    return max(scores, key=scores.get)


# ---------------------------------------------------------------- decisions


def test_plain_when_verify_steps_cost_more_than_their_tokens():
    control = DraftLength("early_exit", 4, clock=FakeClock())
    choices, tokens, elapsed = drive(
        control, 600, 8, linear_cost(1.0, exit_pass=0.25), lambda d, s: 0.6
    )
    assert max(control.options(8), key=lambda o: o.score).choice == PLAIN_STEP
    assert Counter(choices[100:])[PLAIN_STEP] >= 0.95 * 500
    # The probes that keep the verify steps measured cost about 1% of plain's throughput.
    assert tokens / elapsed >= 0.97 * 8


@pytest.mark.parametrize(("c", "per_draft"), [(0.75, 0.1), (0.9, 0.03)])
def test_best_k_when_acceptance_is_high_and_verify_is_cheap(c, per_draft):
    seconds = linear_cost(per_draft)
    expected = best_k(1000, c, 8, seconds)
    assert expected.k >= 4
    control = DraftLength("ngram", 8, clock=FakeClock())
    choices, tokens, elapsed = drive(control, 600, 1000, seconds, lambda d, s: c, matches=8)
    assert Counter(choices[200:]).most_common(1)[0][0] == expected
    assert max(control.options(1000, [8] * 1000), key=lambda o: o.score).choice == expected
    assert tokens / elapsed > 2.0 * 1000  # far above plain's 1000 tokens per second


def test_early_exit_takes_the_longest_draft_when_everything_is_accepted_cheaply():
    control = DraftLength("early_exit", 4, clock=FakeClock())
    choices, _, _ = drive(control, 300, 8, linear_cost(0.02, 0.05), lambda d, s: 0.95)
    assert Counter(choices[100:]).most_common(1)[0][0] == Choice(EARLY_EXIT, 4)


def test_unmeasured_positions_and_lengths_are_extrapolated():
    control = DraftLength("early_exit", 6, clock=FakeClock())
    rows = 1000
    control.record(PLAIN_STEP, rows, 1.0)
    control.record(Choice(EARLY_EXIT, 1), rows, 1.5, [0] * rows, [1] * rows)
    accepted = accepted_counts(rows, [0.9, 0.6])
    for _ in range(50):
        control.record(Choice(EARLY_EXIT, 2), rows, 2.0, accepted, [2] * rows)
    conditional = control.acceptance[EARLY_EXIT].conditional()
    assert conditional[1] == pytest.approx(0.6, abs=0.01)
    # Positions never measured: the last measured conditional acceptance.
    assert conditional[2:] == pytest.approx([conditional[1]] * 4)
    tokens = {o.choice.k: o.tokens / rows for o in control.options(rows)}
    expected = 1 + 0.9 + 0.9 * 0.6 + 0.9 * 0.6**2 + 0.9 * 0.6**3
    assert tokens[4] == pytest.approx(expected, rel=0.02)
    # Costs: beyond the longest measured k, its line from plain's cost (k = 0) goes on.
    table = control.costs.table(rows_bucket(rows))
    assert table[EARLY_EXIT][4] == pytest.approx(3.0)
    assert table[EARLY_EXIT][6] == pytest.approx(4.0)


def test_costs_interpolate_and_scale_between_row_buckets():
    control = DraftLength("early_exit", 4, clock=FakeClock())
    control.record(PLAIN_STEP, 8, 1.0)
    control.record(Choice(EARLY_EXIT, 4), 8, 3.0, [0] * 8, [4] * 8)
    assert control.costs.table(rows_bucket(8))[EARLY_EXIT][2] == pytest.approx(2.0)
    control.record(PLAIN_STEP, 32, 4.0)
    # 32 rows measured plain steps only: the early exit scales with plain from 8 rows.
    assert control.costs.table(rows_bucket(32))[EARLY_EXIT][2] == pytest.approx(8.0)
    # 2 rows measured nothing: the nearest bucket's figures.
    assert control.costs.table(rows_bucket(2))[EARLY_EXIT][4] == pytest.approx(3.0)
    assert [rows_bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [0, 1, 2, 2, 3, 3, 4, 5, 6]


def test_exploration_is_rare_cheap_and_deterministic():
    runs = []
    for _ in range(2):
        control = DraftLength("hybrid", 4, clock=FakeClock())
        choices, tokens, elapsed = drive(
            control, 2000, 8, linear_cost(0.9, 0.25), lambda d, s: 0.8, matches=2
        )
        runs.append(choices)
        assert 0 < control.probes <= 2000 / 16
        best = max(control.options(8, [2] * 8), key=lambda o: o.score).choice
        assert best == PLAIN_STEP
        assert sum(c != best for c in choices) <= 2000 / 16
        assert tokens / elapsed >= 0.97 * 8
    assert runs[0] == runs[1]


@pytest.mark.parametrize(
    ("method", "per_draft", "c"), [("ngram", 0.03, 0.0), ("early_exit", 0.9, 0.7)]
)
def test_a_changing_load_does_not_make_drafting_look_cheap(method, per_draft, c):
    # Plain decoding is best (drafts never accepted, or verify steps dear); the machine's load
    # comes and goes, so a probe's time is not comparable with an old plain step's.
    load = machine_load(0, 3000)
    seconds = linear_cost(per_draft, 0.1 if method == "early_exit" else 0.0, load.__getitem__)
    control = DraftLength(method, 4, clock=FakeClock())
    matches = 4 if method == "ngram" else None
    choices, tokens, elapsed = drive(control, 3000, 32, seconds, lambda d, s: c, matches)
    plain_elapsed = sum(load)  # plain steps all along: one token per row and step
    assert tokens / elapsed >= 0.97 * 32 * 3000 / plain_elapsed
    if per_draft > 0.5:  # drafting far dearer than plain (not merely no better)
        assert Counter(choices)[PLAIN_STEP] >= 0.95 * 3000


def test_follows_a_change_in_acceptance():
    control = DraftLength("early_exit", 4, clock=FakeClock())
    seconds = linear_cost(0.05, 0.1)
    high, _, _ = drive(control, 300, 8, seconds, lambda d, s: 0.9)
    assert Counter(high[-100:]).most_common(1)[0][0] == Choice(EARLY_EXIT, 4)
    low, _, _ = drive(control, 300, 8, seconds, lambda d, s: 0.05, step0=300)
    assert Counter(low[-200:])[PLAIN_STEP] >= 0.9 * 200
    again, _, _ = drive(control, 600, 8, seconds, lambda d, s: 0.9, step0=600)
    assert Counter(again[-200:]).most_common(1)[0][0] == Choice(EARLY_EXIT, 4)


def test_hybrid_picks_the_drafter_with_more_tokens_per_cost():
    seconds = linear_cost(0.05, 0.2)
    good_ngram = DraftLength("hybrid", 4, clock=FakeClock())
    choices, _, _ = drive(
        good_ngram, 400, 8, seconds, lambda d, s: 0.9 if d == NGRAM else 0.3, matches=4
    )
    assert Counter(choices[100:]).most_common(1)[0][0] == Choice(NGRAM, 4)
    good_exit = DraftLength("hybrid", 4, clock=FakeClock())
    choices, _, _ = drive(
        good_exit, 400, 8, seconds, lambda d, s: 0.1 if d == NGRAM else 0.9, matches=2
    )
    top = Counter(choices[100:]).most_common(1)[0][0]
    # The early exit, without the poor n-gram match in front of its drafts.
    assert top == Choice(EARLY_EXIT, 4, ngram_prefix=False)


def test_ngram_matches_are_looked_up_only_when_an_ngram_step_could_win():
    control = DraftLength("ngram", 4, clock=FakeClock())
    lookups = []

    def matches():
        lookups.append(1)
        return [4] * 8

    for _ in range(400):
        choice = control.choose(8, matches)
        proposed = [choice.k] * 8 if choice.kind == NGRAM else None
        control.record(choice, 8, 1.0 + 3.0 * choice.k, [0] * 8 if proposed else None, proposed)
    # Nothing is ever accepted and verify steps are slow: lookups only for the probes.
    assert len(lookups) < 400 / 8


# ---------------------------------------------------------------- the engine


ADAPTIVE = [
    SpecConfig(method="early_exit", k=3, exit_layer=1),
    SpecConfig(method="ngram", k=3, ngram_max_n=2, ngram_min_n=1),
    SpecConfig(method="hybrid", k=3, exit_layer=1, ngram_max_n=2, ngram_sources="group"),
]


def _id(spec: SpecConfig) -> str:
    return f"{spec.method}-k{spec.k}"


def chosen(stats: dict[str, float]) -> set[int]:
    prefix = f"{mn.SPEC_DRAFT_LEN_PREFIX}k"
    return {int(key[len(prefix) :]) for key, v in stats.items() if key.startswith(prefix) and v}


@pytest.mark.parametrize("spec", ADAPTIVE, ids=_id)
def test_adaptive_greedy_equals_plain_greedy(spec):
    assert spec.adaptive
    stats, _ = greedy_matches_plain(spec)
    assert sum(v for k, v in stats.items() if k.startswith(mn.SPEC_DRAFT_LEN_PREFIX)) == (
        pytest.approx(1.0)
    )


def test_adaptive_adapter_draft_greedy_equals_plain_greedy():
    spec = SpecConfig(method="hybrid", k=3, exit_layer=1, ngram_max_n=2, adapter=True)
    greedy_matches_plain(spec)


@pytest.mark.parametrize("spec", ADAPTIVE, ids=_id)
def test_greedy_equals_plain_whatever_the_controller_picks(spec):
    model = peaky_model(vocab=16, seed=0, scale=30.0)
    prompts = [[1, 5, 6, 5, 6], [1, 7], [1, 8, 9, 8, 9, 8, 9], [1, 3]]
    expected = TorchEngine(model, EOS, 0, temperature=0.0).generate(prompts, 3, 12)
    for max_rows in (None, 2):
        engine = TorchEngine(model, EOS, 0, temperature=0.0, spec=spec, max_rows=max_rows)
        engine.draft_length.clock = jittery_clock(0)
        for _ in range(2):
            got = engine.generate(prompts, 3, 12)
            assert [[r.token_ids.tolist() for r in g] for g in got] == [
                [r.token_ids.tolist() for r in g] for g in expected
            ]
        assert len(chosen(engine.stats())) >= 2


@pytest.mark.parametrize("spec", ADAPTIVE, ids=_id)
def test_adaptive_sampled_sequences_follow_plain_distribution(spec):
    # On a jittery fake clock the controller keeps changing its draft length whatever the
    # machine's speed, so the 6000 sequences cover drafted steps of several lengths: on the wall
    # clock it may settle on k=0 and the test would pass without drafting.
    model = peaky_model(vocab=6, seed=1, scale=8.0)
    engine = TorchEngine(model, EOS, 0, 1.3, 1.0, seed=123, spec=spec)
    engine.draft_length.clock = jittery_clock(2)
    p_value = sequence_pvalue(engine, [1, 4, 5, 4], max_new=3, samples=6000)
    assert p_value > 1e-3, f"{spec.method}: p = {p_value:.2e}"
    stats = engine.stats()
    assert stats[mn.SPEC_ACCEPTANCE_RATE] > 0, "no draft token was proposed and kept"
    lengths = chosen(stats)
    assert len(lengths) >= 2 and max(lengths) >= 1, lengths


@pytest.mark.parametrize("spec", ADAPTIVE, ids=_id)
def test_adaptive_with_refill_follows_plain_distribution(spec):
    # 6000 completions through 40 rows: newcomers join mid-rollout while the controller,
    # confused by its clock, changes the draft length from step to step.
    model = peaky_model(vocab=6, seed=1, scale=8.0)
    engine = TorchEngine(model, EOS, 0, 1.0, seed=5, spec=spec, max_rows=40)
    engine.draft_length.clock = jittery_clock(1)
    p_value = sequence_pvalue(engine, [1, 4, 5, 4], max_new=3, samples=6000)
    assert p_value > 1e-3, f"{spec.method}: p = {p_value:.2e}"
    assert len(chosen(engine.stats())) >= 2
    assert engine.cache.used_blocks() == 0


def test_fixed_k_has_no_controller_and_reports_no_draft_lengths():
    spec = SpecConfig(method="early_exit", k=3, exit_layer=1, adaptive=False)
    stats, _ = greedy_matches_plain(spec)
    assert not any(k.startswith(mn.SPEC_DRAFT_LEN_PREFIX) for k in stats)
    assert stats[mn.SPEC_TOKENS_PER_VERIFY_FORWARD] > 1
    model = peaky_model(vocab=6, seed=1, scale=8.0)
    assert TorchEngine(model, EOS, 0, spec=spec).draft_length is None
    assert TorchEngine(model, EOS, 0, spec=SpecConfig(method="none")).draft_length is None


def test_adaptive_figures_are_registered_and_reported():
    spec = SpecConfig(method="hybrid", k=3, exit_layer=1, ngram_max_n=2, ngram_sources="group")
    model = peaky_model(vocab=16, seed=0, scale=30.0)
    engine = TorchEngine(model, EOS, 0, temperature=0.0, spec=spec)
    engine.draft_length.clock = jittery_clock(2)
    engine.generate([[1, 5, 6, 5, 6], [1, 7]], 4, 16)
    stats = engine.stats()
    assert all(mn.is_known(key) for key in stats)
    shares = [stats[f"{mn.SPEC_DRAFTER_PREFIX}{kind}"] for kind in (PLAIN, NGRAM, EARLY_EXIT)]
    assert sum(shares) == pytest.approx(1.0)
    assert stats[f"{mn.SPEC_DRAFT_LEN_PREFIX}k0"] == pytest.approx(shares[0])
    assert 0 <= stats[mn.SPEC_MEAN_DRAFT_LEN] <= 3
    # One row of the report: the learner's records carry the actors' figures.
    rows = [{mn.LEARNER_STEP: 1, mn.LEARNER_VERSION: 1, mn.LEARNER_REWARD_MEAN: 0.5, **stats}]
    text = render_markdown(rows, {}, "run")
    assert "tokens per verify forward" in text
    assert f"{stats[mn.SPEC_MEAN_DRAFT_LEN]:.2f}" in text


def test_a_fixed_k_is_a_fixed_choice_of_the_one_dispatcher():
    """``spec.adaptive=false``: the decoder's step takes its drafter and k from a FixedLength,
    as it takes them from DraftLength otherwise: the choice by drafters present, hybrid's by
    whether every row has an n-gram match (looked up only for an n-gram step)."""
    from actors.decoding.draft_length import EAGLE, EARLY_EXIT, NGRAM, PLAIN_STEP, Choice
    from actors.decoding.fixed_length import FixedLength

    def never() -> list[int]:
        raise AssertionError("looked up n-gram matches for a step that drafts none")

    fixed = FixedLength
    assert fixed(4, early_exit=False, ngram=False, eagle=False).choose(8, None) == PLAIN_STEP
    assert fixed(4, early_exit=False, ngram=False, eagle=True).choose(8, never) == Choice(EAGLE, 4)
    assert fixed(4, early_exit=True, ngram=False, eagle=False).choose(8) == Choice(EARLY_EXIT, 4)
    looked: list[int] = []
    ngram = fixed(4, early_exit=False, ngram=True, eagle=False)
    assert ngram.choose(2, lambda: looked.append(1) or [3, 0]) == Choice(NGRAM, 4)
    assert looked == [1]  # the lookup fills the step's drafts
    hybrid = fixed(3, early_exit=True, ngram=True, eagle=False)
    assert hybrid.choose(2, [2, 1]) == Choice(NGRAM, 3)
    assert hybrid.choose(2, [2, 0]) == Choice(EARLY_EXIT, 3, ngram_prefix=True)
    assert not fixed.adaptive and DraftLength.adaptive
