"""The torch rollout engine: batched sampling whose behaviour log-probs the learner can reproduce."""

import torch

from actors.engines.torch.engine import TorchEngine
from common.model import Transformer
from testing.lossless_check import assert_recorded_logprobs_exact
from testing.models import random_model

EOS = 2


def model(seed: int = 0) -> Transformer:
    return random_model(12, seed)


PROMPTS = [[1, 5, 6], [1, 7], [1, 8, 9, 10, 11]]


def test_rollout_shapes_versions_and_stop():
    engine = TorchEngine(model(), eos_id=EOS, pad_id=0, temperature=1.0, seed=0, version=7)
    out = engine.generate(PROMPTS, n=4, max_new_tokens=6)
    assert len(out) == 3 and all(len(g) == 4 for g in out)
    for group in out:
        for r in group:
            t = len(r.token_ids)
            assert 1 <= t <= 6
            assert r.behaviour_logprobs.shape == (t,) and r.token_versions.tolist() == [7] * t
            assert r.finished == (r.token_ids[-1] == EOS)
            assert EOS not in r.token_ids[:-1].tolist()
            assert r.finished or t == 6
    stats = engine.stats()
    assert stats["actor/tokens"] == sum(len(r.token_ids) for g in out for r in g)


def test_behaviour_logprobs_equal_a_fresh_full_forward():
    # What the actor records is what the learner recomputes: cache + per-row positions + early
    # exit of finished rows must not change a single log-prob.
    net = model()
    engine = TorchEngine(net, eos_id=EOS, pad_id=0, temperature=0.8, top_p=0.95, seed=3)
    out = engine.generate(PROMPTS, n=3, max_new_tokens=8)
    assert_recorded_logprobs_exact(net, PROMPTS, out, 0.8, 0.95)


def test_seeded_determinism_and_low_temperature_is_greedy():
    a = TorchEngine(model(), EOS, 0, seed=11).generate(PROMPTS, 2, 5)
    b = TorchEngine(model(), EOS, 0, seed=11).generate(PROMPTS, 2, 5)
    assert [r.token_ids.tolist() for g in a for r in g] == [
        r.token_ids.tolist() for g in b for r in g
    ]
    net = model()
    cold = TorchEngine(net, EOS, 0, temperature=1e-4, seed=0).generate([PROMPTS[0]], 1, 5)[0][0]
    seq = list(PROMPTS[0])
    greedy = []
    with torch.no_grad():
        for _ in range(len(cold.token_ids)):
            nxt = int(net(torch.tensor([seq]))[0, -1].argmax())
            greedy.append(nxt)
            seq.append(nxt)
    assert cold.token_ids.tolist() == greedy


def test_load_weights_sets_version_and_changes_outputs():
    engine = TorchEngine(model(0), EOS, 0, seed=0, version=0)
    before = engine.generate(PROMPTS, 2, 5)
    engine.load_weights(5, model(1).state_dict())
    engine.generator.manual_seed(0)
    after = engine.generate(PROMPTS, 2, 5)
    assert engine.version == 5
    assert all(r.token_versions.tolist() == [5] * len(r.token_ids) for g in after for r in g)
    assert [r.token_ids.tolist() for g in before for r in g] != [
        r.token_ids.tolist() for g in after for r in g
    ]
