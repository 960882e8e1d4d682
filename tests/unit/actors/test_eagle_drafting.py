"""The policy's EAGLE-3 head drafting in the torch engine (spec.method=eagle3): exact
(chi-square against the enumerated plain distribution, with a negative control that hands the
verifier a wrong q), greedy-identical, really drafting (a fitted head brings more tokens per
verify than a random one), its cached first pass equal to a fresh pass of the head over the
whole sequence through continuous batching, plain steps and every in-flight mode, and the head
always the policy's version (a version without it refused)."""

from __future__ import annotations

import copy

import pytest
import torch

from actors.decoding.draft_length import EAGLE, PLAIN, DraftLength
from actors.decoding.eagle import EagleDrafter
from actors.engines.rollout_engine import StaleDraftError
from actors.engines.torch.eagle import EagleSteps
from actors.engines.torch.engine import TorchEngine
from actors.loop import group_stat
from common import metric_names as mn
from common.config.actor import SpecConfig
from common.model import Transformer
from testing.eagle import fit_head, one_thread, with_head
from testing.lossless_check import (
    EOS,
    exact_sequence_logprobs,
    peaky_model,
    rollouts_pvalue,
    sequence_pvalue,
)
from tests.unit.actors.engine_helpers import jittery_clock, swap_after

SPEC = SpecConfig(method="eagle3", k=3, adaptive=False)
ADAPTIVE = SpecConfig(method="eagle3", k=3, adaptive=True)
HEAD_VOCAB = (0, 2, 3, 4, 5)
"""The draft vocabulary of the lossless checks' head: EOS included, token 1 left out."""
PROMPT = [1, 4, 5, 4]
NO_EOS = 99


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():  # tiny models: several times faster on a shared CPU
        yield


@pytest.fixture(scope="module")
def small() -> Transformer:
    """vocab 6 (enumerable), a head over HEAD_VOCAB fitted a little: drafts often accepted."""
    model = with_head(peaky_model(vocab=6, seed=1, scale=8.0), HEAD_VOCAB, seed=2)
    fit_head(model, steps=60, seed=3)
    return model


@pytest.fixture(scope="module")
def fitted() -> Transformer:
    """vocab 16, context-dependent next-token distributions, a head fitted to them."""
    model = with_head(peaky_model(vocab=16, seed=0, scale=10.0), seed=3)
    fit_head(model, steps=120, seed=4)
    return model


def random_head(model: Transformer, seed: int = 3) -> Transformer:
    """A copy of ``model`` with a fresh (unfitted) head."""
    return with_head(copy.deepcopy(model), seed=seed)


# ------------------------------------------------------------------ exactness


@pytest.mark.parametrize(
    ("spec", "temperature", "top_p", "max_rows"),
    [
        (SPEC, 1.0, 1.0, None),
        (SpecConfig(method="eagle3", k=2, adaptive=False), 0.7, 0.9, None),
        (ADAPTIVE, 1.0, 1.0, 40),
    ],
    ids=["t1", "t0.7-p0.9", "t1-adaptive-refill"],
)
def test_samples_follow_plain_distribution(small, spec, temperature, top_p, max_rows):
    engine = TorchEngine(small, EOS, 0, temperature, top_p, seed=123, spec=spec, max_rows=max_rows)
    if engine.draft_length is not None:
        engine.draft_length.clock = jittery_clock(2)
    p_value = sequence_pvalue(engine, PROMPT, max_new=3, samples=6000)
    assert p_value >= 0.01, f"p = {p_value:.2e}"
    stats = engine.stats()
    assert 0.05 < stats[mn.SPEC_ACCEPTANCE_RATE] < 1.0  # drafts accepted and rejected


def test_negative_control_a_wrong_q_is_detected(small, monkeypatch):
    # The verifier is handed a q the drafts were not sampled from (uniform over the head's
    # vocabulary): the output is biased, and the same check must see it.
    real = EagleDrafter._sample

    def wrong(self, *args, **kwargs):
        tokens, q = real(self, *args, **kwargs)
        uniform = -torch.log(torch.tensor(float(len(HEAD_VOCAB))))
        return tokens, torch.where(torch.isfinite(q), uniform, q)

    monkeypatch.setattr(EagleDrafter, "_sample", wrong)
    engine = TorchEngine(small, EOS, 0, 1.0, seed=123, spec=SPEC)
    assert sequence_pvalue(engine, PROMPT, max_new=3, samples=6000) < 1e-4


def test_sharpened_drafts_stay_exact_and_the_unsharpened_q_is_detected(small, monkeypatch):
    # The warm start's draft sharpening s rescales the head's published LM head by 1/s: drafts
    # come from softmax(z / (T s)) and the verifier is handed that q, so the output stays the
    # plain distribution. Control: handing it the trained (unsharpened) q instead biases it.
    sharp = copy.deepcopy(small)
    sharp.eagle.set_sharpening(0.5)
    engine = TorchEngine(sharp, EOS, 0, 1.0, seed=123, spec=SPEC)
    p_value = sequence_pvalue(engine, PROMPT, max_new=3, samples=6000)
    assert p_value >= 0.01, f"p = {p_value:.2e}"
    assert 0.05 < engine.stats()[mn.SPEC_ACCEPTANCE_RATE] < 1.0
    real = EagleDrafter._sample

    def unsharpened(self, *args, **kwargs):
        tokens, q = real(self, *args, **kwargs)
        return tokens, torch.log_softmax(q * self.model.eagle.sharpening, dim=-1)

    monkeypatch.setattr(EagleDrafter, "_sample", unsharpened)
    engine = TorchEngine(sharp, EOS, 0, 1.0, seed=123, spec=SPEC)
    assert sequence_pvalue(engine, PROMPT, max_new=3, samples=6000) < 1e-4


def test_drafts_never_leave_the_heads_vocabulary(small):
    engine = TorchEngine(small, EOS, 0, 1.0, seed=5, spec=SPEC)
    seen: list[torch.Tensor] = []
    real = engine.eagle.draft

    def draft(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append(out.tokens.flatten())
        assert torch.isneginf(out.logprobs[..., 1]).all()  # no mass on token 1
        return out

    engine.eagle.draft = draft
    engine.generate([PROMPT, [1, 3]], 16, 8)
    drafted = set(torch.cat(seen).tolist())
    assert drafted and drafted <= set(HEAD_VOCAB)


@pytest.mark.parametrize(
    ("spec", "max_rows"),
    [(SPEC, None), (SPEC, 2), (ADAPTIVE, 3)],
    ids=["k3", "k3-rows2", "adaptive"],
)
def test_greedy_equals_plain_greedy(fitted, spec, max_rows):
    prompts = [[1, 5, 6, 5, 6], [1, 7], [1, 8, 9, 8, 9, 8, 9], [1], [1, 3]]
    expected = TorchEngine(fitted, EOS, 0, temperature=0.0).generate(prompts, 2, 12)
    engine = TorchEngine(fitted, EOS, 0, temperature=0.0, spec=spec, max_rows=max_rows)
    if engine.draft_length is not None:
        engine.draft_length.clock = jittery_clock(0)
    for _ in range(2):
        got = engine.generate(prompts, 2, 12)
        assert [[r.token_ids.tolist() for r in g] for g in got] == [
            [r.token_ids.tolist() for r in g] for g in expected
        ]
    stats = engine.stats()
    assert stats[mn.SPEC_ACCEPTANCE_RATE] > 0
    assert stats[mn.ACTOR_FORWARD_PASSES] < stats[mn.ACTOR_TOKENS]


# ------------------------------------------------------------------ drafting happens


def tokens_per_verify(model: Transformer, seed: int = 1) -> dict[str, float]:
    engine = TorchEngine(model, EOS, 0, temperature=1.0, seed=seed, spec=SPEC, version=7)
    engine.generate([[1, 5, 6], [1, 7, 3]], 16, 24)
    stats = engine.stats()
    assert stats[mn.SPEC_DRAFT_VERSION] == 7
    return stats


def test_a_fitted_head_brings_more_tokens_per_verify_than_a_random_one(fitted):
    good = tokens_per_verify(fitted)
    bad = tokens_per_verify(random_head(fitted))
    # Tokens per row and verification (the accepted drafts + one), k = 3.
    assert good[mn.SPEC_MEAN_ACCEPTED_LEN] > 2.3, good
    assert bad[mn.SPEC_MEAN_ACCEPTED_LEN] < good[mn.SPEC_MEAN_ACCEPTED_LEN] - 0.7, bad
    positions = [good[f"{mn.SPEC_ACCEPTANCE_POS_PREFIX}{i}"] for i in (1, 2, 3)]
    assert positions[0] > 0.8 and positions[0] >= positions[2] > 0
    assert good[mn.SPEC_TOKENS_PER_VERIFY_FORWARD] > good[mn.SPEC_MEAN_ACCEPTED_LEN]
    assert all(mn.is_known(key) for key in good)
    # Each group carries these to the learner (its steps, /metrics and the run report).
    carried = {k for k in good if group_stat(k)}
    assert {mn.SPEC_DRAFT_VERSION, mn.SPEC_TOKENS_PER_VERIFY_FORWARD} <= carried
    assert {f"{mn.SPEC_ACCEPTANCE_POS_PREFIX}{i}" for i in (1, 2, 3)} <= carried


def test_adaptive_draft_length_handles_the_head():
    # Accepted drafts and cheap verify steps: the head drafts; dear ones: plain steps.
    for per_draft, expect_plain in ((0.01, False), (2.0, True)):
        control = DraftLength("eagle3", 4, draft_cost=0.1)
        for _ in range(300):
            choice = control.choose(8)
            seconds = 1.0 + per_draft * choice.k
            accepted = [choice.k] * 8 if choice.kind == EAGLE else None
            control.record(choice, 8, seconds, accepted, [choice.k] * 8)
        final = control.choose(8)
        assert (final.kind == PLAIN) == expect_plain, (per_draft, final)
        if not expect_plain:
            assert final.kind == EAGLE and final.k == 4


# ------------------------------------------------------------------ the head's cache


def fresh_first(model: Transformer, seq: list[int]) -> torch.Tensor:
    """The head's first-pass output at the last state of ``seq`` (its last token pending),
    computed from scratch: the policy over seq[:-1], the head over all of it, no cache."""
    ids = torch.tensor([seq])
    aux: list[torch.Tensor] = []
    layers = model.args.num_hidden_layers
    with torch.no_grad():
        model.run_layers(model.model.embed_tokens(ids[:, :-1]), None, None, 0, layers, aux=aux)
        return model.run_eagle(ids[:, 1:], model.eagle.combine(aux), None, None)[0, -1]


@pytest.mark.parametrize("mode", ["verify_on_swap", "verify_on_finish", "abort", "keep"])
def test_first_pass_equals_a_fresh_pass_of_the_current_head(mode, monkeypatch):
    # Rows of different lengths (a 1-token prompt, one long enough to be caught up on its own),
    # 4 rows at most (rows join and leave), the controller changing k (plain steps between
    # drafts) and new weights mid-rollout: every first pass equals the current head run afresh
    # over the row's whole sequence, so no stale or misplaced KV is ever read (under keep, the
    # rows in flight stop drafting: their states are the old weights').
    old = with_head(peaky_model(vocab=12, seed=1, scale=6.0), seed=5)
    new = with_head(peaky_model(vocab=12, seed=2, scale=6.0), seed=6)
    log: list[dict] = []
    real_step, real_draft = EagleSteps.step, EagleDrafter.draft

    def step(self, active, last, pos, k):
        rows = [(r.prompt + r.tokens, r.head_ok and r.head_pending() > 0) for r in active]
        log.append({"rows": rows})
        return real_step(self, active, last, pos, k)

    def draft(self, first, *args, **kwargs):
        log[-1].update(first=first.clone(), model=self.model, version=self.version)
        return real_draft(self, first, *args, **kwargs)

    monkeypatch.setattr(EagleSteps, "step", step)
    monkeypatch.setattr(EagleDrafter, "draft", draft)
    engine = TorchEngine(
        old, NO_EOS, 0, 1.0, seed=3, version=0, spec=ADAPTIVE, inflight=mode, max_rows=4
    )
    engine.draft_length.clock = jittery_clock(4)
    prompts = [[1, 4, 5, 4], [1], [1, 3, 7, 8, 9, 10, 3, 4, 5, 6, 7, 8, 2, 3], [1, 7, 8]]
    engine.generate(prompts, 3, 9, weight_source=swap_after(6, 1, new))
    checked = {0: 0, 1: 0}
    for entry in log:
        if "first" not in entry:
            continue
        for b, (seq, ready) in enumerate(entry["rows"]):
            if ready:
                want = fresh_first(entry["model"], seq)
                torch.testing.assert_close(entry["first"][b], want, atol=1e-4, rtol=1e-4)
                checked[entry["version"]] += 1
    assert checked[0] > 10 and checked[1] > 10, checked
    assert engine.stats()[mn.SPEC_DRAFT_VERSION] == 1
    assert engine.cache.used_blocks() == 0


# ------------------------------------------------------------------ weight swaps


def test_load_weights_brings_that_versions_head(fitted):
    engine = TorchEngine(random_head(fitted), EOS, 0, 1.0, seed=1, spec=SPEC, version=1)
    engine.generate([[1, 5, 6], [1, 7, 3]], 16, 24)
    before = engine.stats()
    engine.load_weights(2, {k: v.clone() for k, v in fitted.state_dict().items()})
    engine.generate([[1, 5, 6], [1, 7, 3]], 16, 24)
    after = engine.stats()
    assert before[mn.SPEC_DRAFT_VERSION] == 1 and after[mn.SPEC_DRAFT_VERSION] == 2
    assert engine.eagle.model is engine.model and engine.eagle.version == engine.version == 2
    assert after[mn.SPEC_MEAN_ACCEPTED_LEN] > before[mn.SPEC_MEAN_ACCEPTED_LEN] + 0.7


def without_head(model: Transformer) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.startswith("eagle.")}


def test_a_version_without_the_head_is_refused(fitted):
    engine = TorchEngine(fitted, EOS, 0, 1.0, seed=1, spec=SPEC, version=1)
    with pytest.raises(StaleDraftError, match="version 2 has no EAGLE-3 head"):
        engine.load_weights(2, without_head(fitted))
    assert engine.version == 1 and engine.model is fitted
    # Mid-rollout too, before anything changes: the engine stays usable on its version.
    with pytest.raises(StaleDraftError, match="version 3 has no EAGLE-3 head"):
        engine.generate([[1, 5, 6]], 4, 12, weight_source=lambda: (3, without_head(fitted)))
    assert engine.version == 1
    out = engine.generate([[1, 5, 6]], 4, 12)
    assert all(len(r.token_ids) for r in out[0]) and engine.cache.used_blocks() == 0


def test_engine_refuses_eagle3_without_a_head():
    with pytest.raises(ValueError, match="no EAGLE-3 head"):
        TorchEngine(peaky_model(vocab=6, seed=1, scale=8.0), EOS, 0, spec=SPEC)


def test_in_flight_swap_with_the_head_is_exact():
    # Rows drafted by the old head when the new weights (and head) arrive: after delayed
    # verification the sequences are exact samples of the new policy.
    old = with_head(peaky_model(vocab=6, seed=1, scale=6.0), HEAD_VOCAB, seed=5)
    new = with_head(peaky_model(vocab=6, seed=2, scale=6.0), HEAD_VOCAB, seed=6)
    engine = TorchEngine(old, NO_EOS, 0, 1.0, seed=0, version=0, spec=SPEC)
    # 3000 rows: the block pool grows row by row, which costs more than the decoding here.
    out = engine.generate([PROMPT], 3000, 3, weight_source=swap_after(1, 1, new))[0]
    exact = exact_sequence_logprobs(new, PROMPT, 3, 1.0, 1.0, NO_EOS)
    assert rollouts_pvalue(exact, out) >= 0.01
    stats = engine.stats()
    assert stats[mn.VERIFY_SWAPS] == 1 and stats[mn.SPEC_DRAFT_VERSION] == 1
