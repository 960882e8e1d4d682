"""The policy's EAGLE-3 head on vLLM's native ``eagle3`` proposer (``spec.method=eagle3``,
:mod:`actors.engines.vllm.eagle`): ``specrl export-draft`` output served by a stock vLLM; what is
refused before vLLM starts; then, on one engine: exact sampling through vLLM's rejection sampler
with the head's q (chi-square over complete sequences at T=1 and at T=0.7 / top-p 0.9, and a
control with a wrong q that fails), the draft reloaded with the target in every swap (between
calls, and mid-rollout with delayed verification, at T=1 and at T=0.7 / top-p 0.9), and a stale
or missing head refused.

The models are enumerable (vocabulary 6, 3 new tokens, EOS outside the vocabulary): the head
drafts over 5 of the 6 tokens (``d2t``), reads the residual stream after layers 1, 2 and 3.
"""

from __future__ import annotations

import json

import pytest
import torch

from actors.engines.rollout_engine import StaleDraftError
from actors.engines.vllm.eagle import (
    EagleHeadError,
    draft_module,
    draft_version,
    eagle3_support,
    set_draft_version,
)
from actors.engines.vllm.engine import VllmEngine
from common.config.actor import SpecConfig
from ops.cli import main as cli
from testing.lossless_check import NO_EOS, exact_sequence_logprobs, peaky_model, rollouts_pvalue
from testing.vllm_eagle import (
    AUX,
    HEAD_FILE,
    NEW,
    PROMPT,
    VOCAB_IDS,
    K,
    enumerable_policy,
    head_of,
    published,
    published_engine,
    pvalue,
    rotated_draft_q,
    sample,
    save_with_head,
    with_head,
)

pytestmark = pytest.mark.vllm

EAGLE = SpecConfig(method="eagle3", k=K, adaptive=False)


def policy(seed: int):
    """An enumerable peaky model with a random EAGLE-3 head, and the head (``eagle.*``)."""
    model = enumerable_policy(seed)
    return model, head_of(model)


def exact(model, temperature: float = 1.0, top_p: float = 1.0):
    return exact_sequence_logprobs(model, PROMPT, NEW, temperature, top_p, NO_EOS)


def greedy_reference(model, n: int) -> list[int]:
    seq = list(PROMPT)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(PROMPT) :]


def draft_lm_head(draft) -> torch.Tensor:
    """The draft's LM head rows (vLLM pads its vocabulary to a multiple of 64)."""
    return draft.lm_head.weight[: len(VOCAB_IDS)]


# ----------------------------------------------------------------------- export-draft, stock vLLM


def test_export_draft_loads_as_the_eagle3_model_of_a_stock_vllm(tmp_path, monkeypatch):
    # First in the module: its LLM is gone (conftest collects it) before the engine below starts.
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from actors.engines.vllm.plugins.cpu_fix import ensure_exact_spec_sampling

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # collective_rpc below reads it
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    ensure_exact_spec_sampling()

    # A head over the whole vocabulary (no d2t: the engine below covers the reduced one).
    model = with_head(peaky_model(6, 1, 6.0), AUX, None, seed=11)
    head = head_of(model)
    src = save_with_head(model, head, tmp_path / "policy")
    out = tmp_path / "draft"
    assert cli(["export-draft", str(src), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == config["vocab_size"] == 6
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)
    llm = LLM(
        model=str(src),
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=32,
        dtype="float32",
        disable_log_stats=False,
        speculative_config={"method": "eagle3", "model": str(out), "num_speculative_tokens": K},
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, detokenize=False)
    got = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)
    assert list(got[0].outputs[0].token_ids) == greedy_reference(model, 12)
    drafts = sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
    assert drafts > 0
    # The draft vLLM loaded is the exported head: its own LM head, no id mapping.
    draft = llm.collective_rpc(draft_module)[0]
    torch.testing.assert_close(draft.lm_head.weight[:6], head["eagle.lm_head.weight"])
    assert draft.draft_id_to_target_id is None


def test_export_draft_refusals(tmp_path, capsys):
    model, head = policy(1)
    src = save_with_head(model, head, tmp_path / "policy")
    out = tmp_path / "draft"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert cli(["export-draft", str(src), str(out)]) == 2
    assert "not empty" in capsys.readouterr().err and (out / "keep.txt").exists()
    # --force replaces only a previous export (tests/unit/actors/test_export_draft_force.py).
    assert cli(["export-draft", str(src), str(out), "--force"]) == 2
    assert "not a previous export-draft output" in capsys.readouterr().err
    assert (out / "keep.txt").exists()
    (out / "keep.txt").unlink()
    assert cli(["export-draft", str(src), str(out)]) == 0
    assert cli(["export-draft", str(src), str(out), "--force"]) == 0
    assert (out / "model.safetensors").exists()
    # A model without a head (no eagle_aux_layers), and one whose head file is gone.
    plain = tmp_path / "plain"
    save_with_head(peaky_model(6, 1, 6.0), {}, plain)  # no head: config and tensors
    assert cli(["export-draft", str(plain), str(tmp_path / "o1")]) == 2
    assert "no EAGLE-3 head" in capsys.readouterr().err
    # One safetensors file as SRC: the head's own file, config.json one directory up.
    assert cli(["export-draft", str(src / HEAD_FILE), str(tmp_path / "from_file")]) == 0
    same = json.loads((tmp_path / "from_file" / "config.json").read_text())
    assert same == json.loads((out / "config.json").read_text())
    (src / HEAD_FILE).unlink()
    assert cli(["export-draft", str(src), str(tmp_path / "o2")]) == 2
    assert "no eagle.* tensors" in capsys.readouterr().err
    assert cli(["export-draft", str(tmp_path / "missing"), str(tmp_path / "o3")]) == 2
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_a_policy_or_layout_without_a_usable_head_is_refused_before_vllm_starts(tmp_path):
    model, head = policy(1)
    plain = save_with_head(peaky_model(6, 1, 6.0), {}, tmp_path / "plain")
    with pytest.raises(EagleHeadError, match="no EAGLE-3 head"):
        VllmEngine(plain, NO_EOS, spec=EAGLE)
    partial = {k: v for k, v in head.items() if k != "eagle.d2t"}
    with pytest.raises(EagleHeadError, match="eagle.d2t"):
        VllmEngine(save_with_head(model, partial, tmp_path / "partial"), NO_EOS, spec=EAGLE)
    wrong = {**head, "eagle.fc.weight": head["eagle.fc.weight"][:, :128]}
    with pytest.raises(EagleHeadError, match="fc.weight has shape"):
        VllmEngine(save_with_head(model, wrong, tmp_path / "wrong"), NO_EOS, spec=EAGLE)
    # A layout whose vLLM model emits no aux hidden states (Gemma 3 lacks SupportsEagle3).
    gemma = save_with_head(model, head, tmp_path / "gemma")
    config = json.loads((gemma / "config.json").read_text())
    config["architectures"] = ["Gemma3ForCausalLM"]
    (gemma / "config.json").write_text(json.dumps(config))
    with pytest.raises(EagleHeadError, match="does not implement SupportsEagle3"):
        VllmEngine(gemma, NO_EOS, spec=EAGLE)
    assert eagle3_support({"architectures": ["Qwen2ForCausalLM"]}) is None
    assert eagle3_support({"architectures": ["Qwen3ForCausalLM"]}) is None


# ----------------------------------------------------------------------- one engine from here on


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # Started as an actor starts it: from the directory it writes of a published version.
    yield published_engine(policy(1)[0], tmp_path_factory.mktemp("eagle") / "policy", EAGLE)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_through_the_native_head_is_exact(engine, temperature, top_p):
    engine.stats()
    out = sample(engine, 900, temperature, top_p)
    stats = engine.stats()
    assert stats["spec/draft_tokens"] > 500 and 0.05 < stats["spec/acceptance_rate"] < 0.99
    assert stats["spec/acceptance_pos1"] > 0 and stats["spec/acceptance_pos2"] > 0
    model, _ = policy(1)
    assert rollouts_pvalue(exact(model, temperature, top_p), out) > 0.01
    # Control: the same samples against another policy's law fail.
    assert pvalue(policy(2)[0], out, temperature, top_p) < 0.01


def test_a_wrong_draft_q_makes_it_inexact(engine):
    # The rejection sampler reads the q vLLM's drafter hands it; another one (the head's q with
    # its token ids rotated by one, while the drafts are still drawn from the true q) breaks
    # exactness: the test above would see it (p < 1e-25 in three runs of 600 samples).
    with rotated_draft_q(engine):
        out = sample(engine, 600)
    assert engine.stats()["spec/draft_tokens"] > 300
    assert pvalue(policy(1)[0], out) < 0.01


def test_a_swap_reloads_the_draft_with_the_target(engine):
    v1_model, v1_head = policy(1)
    v2_model, v2_head = policy(2)
    draft = engine.llm.collective_rpc(draft_module)[0]
    weight = draft.lm_head.weight
    torch.testing.assert_close(draft_lm_head(draft), v1_head["eagle.lm_head.weight"])
    engine.load_weights(1, published(v2_model))
    assert engine.llm.collective_rpc(draft_version)[0] == 1
    # The same parameter, new values (vLLM's in-place reload), v2's and not v1's.
    assert draft.lm_head.weight is weight
    torch.testing.assert_close(draft_lm_head(draft), v2_head["eagle.lm_head.weight"])
    assert not torch.allclose(draft_lm_head(draft), v1_head["eagle.lm_head.weight"])
    # fc is packed for the CPU GEMM: its output is v2's map.
    x = torch.randn(3, len(AUX) * 64)
    with torch.no_grad():
        y = draft.model.fc(x)
    y = y[0] if isinstance(y, tuple) else y
    torch.testing.assert_close(y, x @ v2_head["eagle.fc.weight"].T, atol=1e-4, rtol=1e-4)
    engine.stats()
    out = sample(engine, 600)
    stats = engine.stats()
    assert stats["spec/draft_tokens"] > 300 and stats["spec/acceptance_rate"] > 0.05
    assert stats["spec/draft_version"] == 1
    assert rollouts_pvalue(exact(v2_model), out) > 0.01
    assert pvalue(v1_model, out) < 0.01
    engine.load_weights(2, published(v1_model))  # back to the law the others test
    torch.testing.assert_close(draft_lm_head(draft), v1_head["eagle.lm_head.weight"])


SWAPS = 5  # calls of 100 requests, each swapped once


def swapped_mid_rollout(engine: VllmEngine, temperature: float, top_p: float):
    """SWAPS calls of 100 requests under verify_on_swap, each swapped from v1 to v2 when its
    first tokens are out: (the rollouts, the engine's stats, the two models)."""
    v1_model, _ = policy(1)
    v2_model, _ = policy(2)
    old, new = published(v1_model), published(v2_model)
    inflight = engine.inflight
    engine.temperature, engine.top_p = temperature, top_p
    engine.inflight = "verify_on_swap"  # read per call and per request (_params, _swap)
    out = []
    try:
        for _ in range(SWAPS):
            engine.load_weights(10, old)
            polls = {"n": 0}

            def source(polls=polls):
                polls["n"] += 1
                return (11, new) if polls["n"] == 1 else None

            out += engine.generate([PROMPT], 100, NEW, weight_source=source)[0]
        stats = engine.stats()
    finally:
        engine.inflight = inflight
        engine.temperature, engine.top_p = 1.0, 1.0
        engine.load_weights(12, old)
    assert stats["verify/swaps"] == SWAPS and 0 < stats["verify/salvaged_frac"] < 1
    assert stats["spec/draft_tokens"] > 300 and stats["spec/draft_version"] == 11
    assert all(r.token_versions.tolist() == [11] * NEW for r in out)
    return out, stats, v1_model, v2_model


def test_a_swap_mid_rollout_with_delayed_verification_stays_exact(engine):
    # verify_on_swap: every request holds its first token (v1's) when v2 lands; it is verified
    # against v2 and the rest is drafted by v2's head: complete sequences follow v2's law.
    out, _, v1_model, v2_model = swapped_mid_rollout(engine, 1.0, 1.0)
    assert rollouts_pvalue(exact(v2_model), out) > 0.01
    assert pvalue(v1_model, out) < 0.01


def test_a_swap_mid_rollout_at_temperature_and_top_p_stays_exact(engine):
    # The same at T = 0.7 / top-p 0.9: the stale tokens are scored with the processed
    # distribution (actors.engines.vllm.verify's runner hook, which an engine started at this
    # setting with verify_on_swap installs; installed here on the head's engine, started at
    # T = 1), and the head's q is processed the same way: complete sequences follow v2's
    # processed law.
    from actors.engines.vllm.verify import install_processed_prompt_logprobs

    engine.llm.collective_rpc(install_processed_prompt_logprobs)
    engine.score_processed = True
    try:
        out, _, v1_model, v2_model = swapped_mid_rollout(engine, 0.7, 0.9)
    finally:
        engine.score_processed = False
        engine.temperature, engine.top_p = 1.0, 1.0
    assert rollouts_pvalue(exact(v2_model, 0.7, 0.9), out) > 0.01
    assert pvalue(v1_model, out, 0.7, 0.9) < 0.01


def test_a_version_without_the_head_or_a_stale_draft_is_refused(engine):
    v1_model, v1_head = policy(1)
    before = engine.version
    state = published(v1_model)
    no_head = {k: v for k, v in state.items() if not k.startswith("eagle.")}
    with pytest.raises(StaleDraftError, match="no eagle.\\* tensors"):
        engine.load_weights(before + 1, no_head)
    partial = {k: v for k, v in state.items() if k != "eagle.lm_head.weight"}
    with pytest.raises(StaleDraftError, match="lm_head"):
        engine.load_weights(before + 1, partial)
    assert engine.version == before  # refused before anything changed
    assert engine.llm.collective_rpc(draft_version)[0] == before
    # A draft left on an older version (a reload that skipped it) is never used.
    engine.llm.collective_rpc(set_draft_version, args=(before - 1,))
    try:
        with pytest.raises(StaleDraftError, match=f"version {before - 1}, the target {before}"):
            engine.generate([PROMPT], 2, NEW)
    finally:
        engine.llm.collective_rpc(set_draft_version, args=(before,))
    assert len(engine.generate([PROMPT], 2, NEW)[0]) == 2


def test_the_draft_directory_is_removed_once_vllm_started(engine):
    assert engine.eagle is not None and not engine.eagle.draft_dir.exists()
