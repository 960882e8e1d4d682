"""Delayed verification is turn-local (design note §1.6, §5.2): two-turn episodes through the
torch engine's turn-request stream, with a token-dependent stochastic environment between the
turns (testing/multiturn_check.py), follow the exact law of where the weights changed; the
environment never sees a token that verification later rejects; the recorded log-probs are those
of each token's own version over the whole history. Every chi-square test has a control that
the same samples fail (``keep``, or the law of the other weights)."""

from __future__ import annotations

import threading

import pytest

from actors.engines.rollout_engine import EngineBase
from actors.engines.torch.engine import TorchEngine
from actors.engines.turns import TurnQueue
from common import metric_names as mn
from testing import multiturn_check as mc
from testing.lossless_check import NO_EOS

EPISODES = 6000
"""Episodes per chi-square test: 512 outcomes, most of the mass in a few dozen; the controls
fail at p < 1e-10 with these counts."""
VERIFYING = ["verify_on_swap", "verify_on_finish", "abort"]


def serve(mode: str, when: str, episodes: int = EPISODES, seed: int = 0, **kwargs):
    """``episodes`` episodes with ``inflight=mode`` and the weights changing ``when``
    (``testing/multiturn_check.py``: ``turn1``, ``turn2`` or ``between``)."""
    return mc.serve_episodes(mode, when, episodes, seed, **kwargs)


def versions(episodes) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
    return {tuple(tuple(t.token_versions.tolist()) for t in ep.turns) for ep in episodes}


def pvalues(episodes, models) -> dict[str, float]:
    old, new = models
    return {
        f"{a}{b}": mc.episodes_pvalue(mc.exact_episode_logprobs(*pair), episodes)
        for (a, b), pair in {
            ("old", "new"): (old, new),
            ("old", "old"): (old, old),
            ("new", "new"): (new, new),
        }.items()
    }


@pytest.mark.parametrize("mode", VERIFYING)
def test_swap_mid_turn_follows_the_turn_local_law(mode):
    engine, _, episodes, models = serve(mode, "turn2")
    p = pvalues(episodes, models)
    # Turn 1 under the old weights, the environment, turn 2 under the new ones over the whole
    # history: pi_old(y1 | x) P_env(o | x, y1) pi_new(y2 | x, y1, o).
    assert p["oldnew"] > 0.01, p
    assert p["oldold"] < 0.01 and p["newnew"] < 0.01, p  # the test tells the laws apart
    assert versions(episodes) == {((0, 0), (1, 1))}
    for ep in episodes[:50]:
        tokens, token_versions, logprobs = ep.stream()
        assert token_versions[2:4] == [-1, -1] and logprobs[2:4] == [0.0, 0.0]
        assert tokens[2:4] == ep.obs
    stats = engine.stats()
    assert stats[mn.VERIFY_SWAPS] == 1
    assert stats[mn.VERIFY_INFLIGHT_TOKENS] == EPISODES  # the one token of turn 2 so far
    if mode != "abort":
        assert 0 < stats[mn.VERIFY_SALVAGED_FRAC] < 1


def test_keep_mid_turn_does_not():
    # Control: keep leaves turn 2's first token (and its KV) of the old weights.
    _, _, episodes, models = serve("keep", "turn2")
    assert versions(episodes) == {((0, 0), (0, 1))}
    p = pvalues(episodes, models)
    assert p["oldnew"] < 0.01, p


def test_swap_between_turns_recomputes_history():
    # The weights change while every episode waits on its environment: nothing is in flight,
    # and each second turn is prefilled, history and all, under the new weights.
    engine, _, episodes, models = serve("verify_on_swap", "between")
    p = pvalues(episodes, models)
    assert p["oldnew"] > 0.01, p
    assert p["oldold"] < 0.01, p  # control: the second turns are not the old weights'
    assert versions(episodes) == {((0, 0), (1, 1))}
    stats = engine.stats()
    assert stats[mn.VERIFY_SWAPS] == 1 and stats[mn.VERIFY_INFLIGHT_TOKENS] == 0


def test_stale_history_kv_is_detected():
    # Control: the second turns' history KV computed under the old weights (as an engine that
    # kept each episode's KV across the version change would) fails the law the engine passes.
    _, _, episodes, models = serve("verify_on_swap", "between", stale_history=True)
    assert versions(episodes) == {((0, 0), (1, 1))}
    p = pvalues(episodes, models)
    assert p["oldnew"] < 0.01, p


@pytest.mark.parametrize("mode", VERIFYING)
def test_swap_in_turn_one(mode):
    engine, _, episodes, models = serve(mode, "turn1")
    p = pvalues(episodes, models)
    assert p["newnew"] > 0.01, p
    assert p["oldnew"] < 0.01, p  # control: turn 1 is not the old weights'
    assert versions(episodes) == {((1, 1), (1, 1))}
    assert engine.stats()[mn.VERIFY_INFLIGHT_TOKENS] == EPISODES


def test_env_never_sees_a_rejected_token():
    # verify_on_finish verifies a turn when it ends, before it is delivered: a cut turn decodes
    # on, and the environment only ever receives the final turn (each turn delivered once).
    engine, driver, episodes, models = serve("verify_on_finish", "turn1", episodes=400)
    stats = engine.stats()
    assert stats[mn.VERIFY_WASTED_TOKENS] > 0, "no turn was cut: the test would prove nothing"
    assert len(driver.env_log) == len(episodes)
    assert mc.env_saw_rejected(driver, episodes) == 0
    assert versions(episodes) == {((1, 1), (1, 1))}
    assert mc.logprob_errors(dict(enumerate(models)), episodes) < 1e-4
    assert engine.swapper.kept == {}  # the old weights went once nothing needed them


@pytest.mark.parametrize("mode", [*VERIFYING, "keep"])
def test_recorded_logprobs_match_a_fresh_forward(mode):
    # Per token, under its own version, over the whole history (prompt, turn 1, observation).
    _, _, episodes, models = serve(mode, "turn2", episodes=200)
    worst = mc.logprob_errors(dict(enumerate(models)), episodes)
    if mode == "keep":
        # Control: keep's new-version tokens were scored over the history's old KV.
        assert worst > 1e-3
    else:
        assert worst < 1e-4


def test_turns_join_between_steps_with_their_own_kv():
    # max_rows=7, max_admit=3: turns join the batch between steps as rows free up, beside rows
    # of other episodes at other steps (first turns of the group copy each other's prompt KV; a
    # later turn's history is its own, never a sibling's: keyed by the group, this fails).
    # Every log-prob equals a fresh forward over the turn's own history, and every row leaves
    # when its turn is delivered: no cache block outlives serve.
    old, _ = mc.model_pair()
    engine = TorchEngine(old, NO_EOS, 0, seed=0, version=0, max_rows=7, max_admit=3)
    driver = mc.Driver(60)
    out = mc.run(engine, driver, None)
    assert all(len(ep.turns) == 2 for ep in out)
    assert len({tuple(ep.prompts[1]) for ep in out}) > 4  # siblings' histories differ
    assert mc.logprob_errors({0: old}, out) < 1e-4
    assert engine.cache.tables == {}
    assert engine.batch.live is None


def test_an_engine_without_serve_refuses_clearly():
    class NoServe(EngineBase):
        def generate(self, prompts, n, max_new_tokens, weight_source=None, on_group=None):
            return []

    with pytest.raises(NotImplementedError, match="engine.name=torch"):
        NoServe().serve(TurnQueue())


def test_a_closed_queue_refuses_more_items_and_serve_returns():
    old, _ = mc.model_pair()
    engine = TorchEngine(old, NO_EOS, 0, seed=0, version=0)
    queue = TurnQueue()
    queue.close()
    with pytest.raises(RuntimeError, match="closed"):
        queue.put(mc.EpisodeDone("task", [1]))
    done = threading.Event()
    engine.serve(queue, None, lambda result: done.set())
    assert not done.is_set()
