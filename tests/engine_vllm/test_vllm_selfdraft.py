"""The policy's own trained draft inside vLLM (``spec=early_exit``,
:mod:`actors.engines.vllm.plugins.selfdraft`): exact sampling through vLLM's rejection sampler
with the draft's q (chi-square on an enumerable model, and a control with a wrong q that fails),
the draft reloaded in the same swap as the target (between calls and mid-rollout with delayed
verification), the stale-draft control, the adaptive draft length, and what the engine refuses."""

from __future__ import annotations

import pytest
import torch

from actors.engines.rollout_engine import StaleDraftError
from actors.engines.torch.engine import TorchEngine
from actors.engines.vllm.engine import VllmEngine
from common.config.actor import EngineConfig, SpecConfig
from common.model import Transformer, attach_draft, save_pretrained
from testing.lossless_check import (
    ADAPTER_VOCAB,
    NO_EOS,
    assert_recorded_logprobs_exact,
    exact_sequence_logprobs,
    peaky_model,
    rollouts_pvalue,
    with_adapter,
)
from testing.models import random_model
from testing.vllm import EOS, PROMPTS, enumerable_vllm, tokens

pytestmark = pytest.mark.vllm

SELFDRAFT = SpecConfig(method="early_exit", adapter=True, exit_layer=1, k=3, adaptive=False)


def drafting_model(seed: int) -> Transformer:
    """A peaky random model (vocabulary 64) whose adapter after layer 2 drafts its exact
    distribution: layers 2-3 add nothing to the residual stream and the adapter is a copy of
    layer 2 and of the final norm. Two seeds' distributions differ widely."""
    model = random_model(
        64, seed, num_hidden_layers=4, bos_token_id=1, eos_token_id=EOS, pad_token_id=0
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for layer in model.model.layers[2:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    attach_draft(model, 2)
    return model


def engine_on(model: Transformer, path, spec=SELFDRAFT, **kwargs) -> VllmEngine:
    save_pretrained(model, path)
    kwargs.setdefault("inflight", "keep")
    kwargs.setdefault("temperature", 1.0)
    return VllmEngine(path, EOS, EngineConfig(vllm_max_model_len=64), spec=spec, seed=3, **kwargs)


def acceptance(engine: VllmEngine, n: int = 4) -> float:
    engine.generate(PROMPTS, n, 16)
    return engine.stats()["spec/acceptance_rate"]


PROMPT, TEMPERATURE = [1, 4, 5, 4], 0.7
"""The enumerable checks' prompt and temperature."""


def drafting_engine(path, seed: int, top_p: float = 1.0) -> tuple[VllmEngine, Transformer]:
    """An engine (at TEMPERATURE and ``top_p``) drafting with an enumerable model (vocabulary 6)
    whose adapter covers 5 of the 6 tokens and drafts differently from the model (perturbed), and
    the model."""
    spec = SpecConfig(method="early_exit", adapter=True, exit_layer=1, k=3, adaptive=False)
    model = with_adapter(peaky_model(6, 1, 6.0), spec, ADAPTER_VOCAB)
    save_pretrained(model, path)
    return enumerable_vllm(path, spec, seed, temperature=TEMPERATURE, top_p=top_p), model


def enumerable_engine(path, seed: int) -> tuple[VllmEngine, dict[tuple[int, ...], float]]:
    """:func:`drafting_engine`, and the exact log-prob of every completion of PROMPT (3 tokens)."""
    engine, model = drafting_engine(path, seed)
    return engine, exact_sequence_logprobs(model, PROMPT, 3, TEMPERATURE, 1.0, NO_EOS)


def count_rejection_sampling(engine: VllmEngine) -> dict[str, int]:
    """A counter (``["n"]``) of the calls to vLLM's rejection sampler of ``engine``."""
    runner = engine.proposer.runner
    calls = {"n": 0}
    forward = runner.rejection_sampler.forward

    def counted(*args, **kwargs):
        calls["n"] += 1
        return forward(*args, **kwargs)

    runner.rejection_sampler.forward = counted
    return calls


def other_model() -> dict[tuple[int, ...], float]:
    """The exact completions' log-probs of another model: a negative control."""
    return exact_sequence_logprobs(peaky_model(6, 2, 6.0), PROMPT, 3, TEMPERATURE, 1.0, NO_EOS)


def test_sampling_through_the_self_draft_is_exact_and_uses_its_q(tmp_path):
    engine, exact = enumerable_engine(tmp_path, seed=5)
    out = []
    for _ in range(15):
        out += engine.generate([PROMPT], 100, 3)[0]
    stats = engine.stats()
    assert stats["spec/draft_tokens"] > 1000 and 0.05 < stats["spec/acceptance_rate"] < 0.99
    assert rollouts_pvalue(exact, out) > 0.01
    # Negative control 1: the same samples against another model's distribution fail.
    assert rollouts_pvalue(other_model(), out) < 0.01
    # Negative control 2: the rejection sampler reads the q the proposer hands it: a wrong one
    # (q at temperature 3 while the drafts are drawn at 0.7) makes the output inexact.
    proposer = engine.proposer
    draft = proposer._draft

    def wrong_q(ids, contexts, k):
        proposed, q = draft(ids, contexts, k)
        flat = q.pow(1 / 3.0 * TEMPERATURE)
        return proposed, (flat / flat.sum(-1, keepdim=True)).contiguous()

    proposer._draft = wrong_q
    bad = []
    for _ in range(15):
        bad += engine.generate([PROMPT], 100, 3)[0]
    assert rollouts_pvalue(exact, bad) < 0.01


def test_a_step_without_drafts_samples_through_the_plain_sampler_exactly(tmp_path):
    # With a speculative config vLLM sends every step through its rejection sampler; a step
    # whose requests have no drafts (k = 0: what an adaptive length picks when drafting does
    # not pay) takes the plain sampler instead
    # (actors.engines.vllm.setup.plain_steps_without_drafts).
    engine, exact = enumerable_engine(tmp_path, seed=7)
    calls = count_rejection_sampling(engine)
    engine.generate([PROMPT], 4, 3)
    assert calls["n"] > 0 and engine.stats()["spec/draft_tokens"] > 0  # drafts: rejection
    engine.proposer.k = 0  # no request drafts in any step
    calls["n"] = 0
    out = []
    for _ in range(15):
        out += engine.generate([PROMPT], 100, 3)[0]
    assert calls["n"] == 0 and engine.stats()["spec/draft_tokens"] == 0
    assert rollouts_pvalue(exact, out) > 0.01
    assert rollouts_pvalue(other_model(), out) < 0.01


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_recorded_logprobs_equal_a_reference_forward_with_and_without_drafts(tmp_path, top_p):
    # The behaviour log-probs the learner's importance ratios use, on both of vLLM's sampling
    # paths: steps with drafts (the rejection sampler, given the draft's q; accepted drafts,
    # recovered tokens and bonus tokens) and steps with k = 0 (the plain sampler,
    # actors.engines.vllm.setup.plain_steps_without_drafts). Each must equal a fresh forward of
    # specrl's own torch model on the same weights, processed at the engine's temperature and
    # top-p.
    engine, model = drafting_engine(tmp_path, 11, top_p)
    calls = count_rejection_sampling(engine)
    prompts = [PROMPT, [1, 3, 0, 5, 3]]
    drafted = engine.generate(prompts, 6, 16)
    stats = engine.stats()
    # Drafts were accepted and rejected (recovered tokens), all through the rejection sampler.
    assert calls["n"] > 0 and stats["spec/draft_tokens"] > 50
    assert 0.05 < stats["spec/acceptance_rate"] < 0.95
    assert_recorded_logprobs_exact(model, prompts, drafted, TEMPERATURE, top_p)
    engine.proposer.k = 0  # no drafts in any step: the plain sampler
    calls["n"] = 0
    plain = engine.generate(prompts, 6, 16)
    assert calls["n"] == 0 and engine.stats()["spec/draft_tokens"] == 0
    assert_recorded_logprobs_exact(model, prompts, plain, TEMPERATURE, top_p)
    # Controls: the same check at another temperature, or without the nucleus, fails.
    wrong = [(1.0, top_p)] + ([(TEMPERATURE, 1.0)] if top_p < 1 else [])
    for out in (drafted, plain):
        for temperature, p in wrong:
            with pytest.raises(AssertionError):
                assert_recorded_logprobs_exact(model, prompts, out, temperature, p)


def test_the_draft_dtype_falls_back_to_float32_without_torch_s_bf16_check(monkeypatch, caplog):
    # torch.ops.mkldnn._is_mkldnn_bf16_supported is a private torch op: where it is missing the
    # self-draft runs in float32 (and says so) instead of failing at start.
    from actors.engines.vllm.plugins.selfdraft import draft_dtype

    cpu = torch.device("cpu")
    assert draft_dtype("float16", cpu) == torch.float16
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no mkldnn")

    def missing():
        raise AttributeError("no _is_mkldnn_bf16_supported")

    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", missing)
    with caplog.at_level("INFO", logger="common.cpu_precision"):
        assert draft_dtype("auto", cpu) == torch.float32
    assert any("counted as slow" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert draft_dtype("auto", cpu) == torch.bfloat16


def test_the_packed_draft_follows_each_load(monkeypatch):
    # On CPU the draft's linear maps run through prepacked oneDNN copies of its weights: a load
    # must repack them, or the draft would keep drafting from the previous version.
    from actors.decoding.paged_cache import PagedKVCache
    from actors.engines.vllm.plugins import selfdraft
    from actors.engines.vllm.plugins.selfdraft import SelfDraft

    if selfdraft._cpu_gemm() is None:
        pytest.skip("this vLLM build has no oneDNN GEMM")
    old, new = drafting_model(0), drafting_model(1)
    cpu = torch.device("cpu")
    packed = SelfDraft(old.args, old.state_dict(), True, 0, 0, cpu)
    assert "forward" in vars(packed.model.model.layers[0].mlp.up_proj)  # the packed kernel

    def logq(draft: SelfDraft) -> torch.Tensor:
        cache = PagedKVCache(draft.args, 16, cpu, torch.float32)
        for row in (0, 1):
            cache.reserve(row, 8)
        bound = cache.bind([0, 1])
        tokens = torch.tensor([[1, 5, 6, 7], [1, 9, 3, 2]])
        positions = torch.arange(4).expand(2, 4)
        h = draft.layers(tokens, positions, bound)
        return draft.logprobs(h, positions, torch.tensor([3, 3]), bound, 1.0, 1.0)

    before = logq(packed)
    packed.load(1, new.state_dict())
    monkeypatch.setattr(selfdraft, "_cpu_gemm", lambda: None)  # F.linear throughout
    reference = SelfDraft(new.args, new.state_dict(), True, 0, 1, cpu)
    assert "forward" not in vars(reference.model.model.layers[0].mlp.up_proj)
    assert torch.allclose(logq(packed), logq(reference), atol=1e-4)
    assert not torch.allclose(before, logq(reference), atol=1e-2)


def test_draft_reloads_in_the_swap_and_a_stale_draft_loses_acceptance(tmp_path):
    old, new = drafting_model(0), drafting_model(1)
    engine = engine_on(old, tmp_path, version=0)
    proposer = engine.proposer
    assert proposer.draft is engine.selfdraft and proposer.draft.version == 0
    assert acceptance(engine) > 0.9  # the draft is the model's own distribution
    engine.load_weights(1, new.state_dict())
    assert proposer.draft.version == proposer.target_version == engine.version == 1
    assert acceptance(engine) > 0.9  # reloaded with the target: as good as before
    # Stale-draft control: the previous version's draft, loaded on purpose.
    proposer.draft.load(0, old.state_dict())
    with pytest.raises(StaleDraftError, match="version 0, the target 1"):
        engine.generate(PROMPTS, 1, 4)
    proposer.check_version = False  # what the version check prevents
    proposer.forget()
    assert acceptance(engine) < 0.5
    # A version without the draft's tensors is refused before vLLM's weights change.
    policy_only = {k: v for k, v in old.state_dict().items() if not k.startswith("draft.")}
    with pytest.raises(ValueError, match="without the draft adapter"):
        engine.load_weights(2, policy_only)
    assert engine.version == 1


def test_swap_mid_rollout_with_delayed_verification_reloads_the_draft(tmp_path):
    old, new = drafting_model(0), drafting_model(1)
    engine = engine_on(old, tmp_path, version=0, inflight="verify_on_swap")
    calls = {"n": 0}

    def source():
        calls["n"] += 1
        return (1, new.state_dict()) if calls["n"] == 4 else None

    out = engine.generate(PROMPTS, 4, 24, weight_source=source)
    stats = engine.stats()
    assert stats["verify/swaps"] == 1 and stats["verify/inflight_tokens"] > 0
    assert all(set(r.token_versions.tolist()) == {1} for g in out for r in g)
    assert engine.proposer.draft.version == 1
    assert stats["spec/acceptance_rate"] > 0.9  # drafts after the swap come from the new draft


def test_greedy_self_draft_matches_plain_decoding(tmp_path):
    model = with_adapter(peaky_model(16, 0, 30.0), SELFDRAFT, None)
    save_pretrained(model, tmp_path)
    engine = VllmEngine(
        tmp_path,
        EOS,
        EngineConfig(vllm_max_model_len=64),
        spec=SELFDRAFT,
        inflight="keep",
        temperature=0.0,
    )
    prompts = [[1, 5, 6, 5, 6], [1, 7], [1, 8, 9, 8, 9, 8, 9]]
    reference = TorchEngine(model, EOS, 0, temperature=0.0).generate(prompts, 2, 12)
    assert tokens(engine.generate(prompts, 2, 12)) == tokens(reference)
    assert engine.stats()["spec/draft_tokens"] > 0


def test_adaptive_length_drafts_a_good_draft_and_learns_its_acceptance(tmp_path):
    spec = SpecConfig(method="early_exit", adapter=True, k=4, adaptive=True)
    good = drafting_model(0)
    engine = engine_on(good, tmp_path, spec=spec, version=0)
    timer = engine.proposer.timer
    control = timer.control
    # A deterministic clock: a plain step costs 1, a drafting step 1 + k / 4 (each draft pass a
    # quarter of a plain step), so the choice follows the acceptance vLLM reports back per
    # draft position (the measured-cost side is covered in tests/unit/actors).
    now = [0.0]
    close = timer.close

    def timed_close(req_ids, sampled):
        if timer._open is not None:
            now[0] += 1.0 + timer._open[0].k / 4
        close(req_ids, sampled)

    timer.close = timed_close
    control.clock = lambda: now[0]
    for _ in range(2):
        engine.generate(PROMPTS, 4, 24)
    stats = engine.stats()
    drafted = stats["spec/draft_tokens"] / stats["actor/tokens"]
    assert drafted > 0.4 and stats["spec/mean_accepted_len"] > 2.5
    assert control.steps > 0 and control.acceptance["early_exit"].conditional()[0] > 0.9


def test_self_draft_refuses_a_model_without_adapter_and_a_multiprocess_engine(
    tmp_path, monkeypatch
):
    save_pretrained(random_model(64, 0), tmp_path)
    with pytest.raises(ValueError, match="no draft adapter"):
        VllmEngine(tmp_path, EOS, spec=SELFDRAFT)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ValueError, match="engine core in this process"):
        VllmEngine(tmp_path, EOS, spec=SELFDRAFT)


def test_the_self_draft_of_a_model_that_also_has_an_eagle_head():
    # A model directory warm-started for both drafts (`specrl warm-draft`, then with spec=eagle3)
    # carries an EAGLE-3 head reading layers deeper than the self-draft's exit: the self-draft
    # leaves the head out and drafts as it does without one.
    from actors.engines.vllm.plugins.selfdraft import SelfDraft
    from testing.eagle import with_head

    cpu = torch.device("cpu")
    plain = random_model(64, 0, num_hidden_layers=8, bos_token_id=1, eos_token_id=EOS)
    attach_draft(plain, 2)
    headed = with_head(random_model(64, 0, num_hidden_layers=8, bos_token_id=1, eos_token_id=EOS))
    attach_draft(headed, 2)
    headed.load_state_dict(plain.state_dict(), strict=False)  # the same policy and adapter
    assert max(headed.args.eagle_aux_layers) > 3
    drafts = [SelfDraft(m.args, m.state_dict(), True, 0, 0, cpu) for m in (plain, headed)]
    assert not drafts[1].args.has_eagle
    from actors.decoding.paged_cache import PagedKVCache

    def logq(draft: SelfDraft) -> torch.Tensor:
        cache = PagedKVCache(draft.args, 16, cpu, torch.float32)
        cache.reserve(0, 8)
        bound = cache.bind([0])
        tokens, positions = torch.tensor([[1, 5, 6, 7]]), torch.arange(4)[None]
        h = draft.layers(tokens, positions, bound)
        return draft.logprobs(h, positions, torch.tensor([3]), bound, 1.0, 1.0)

    assert torch.equal(logq(drafts[0]), logq(drafts[1]))
