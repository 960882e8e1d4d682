"""The built-in ``guess_number`` game (common/guess_number.py, actors/episodes/builtin.py): the
instance distribution and its pools, each observation, the turn limit, the no-feedback ceiling
against a brute-force simulation, direction consistency, and episodes through the episode
runner with a scripted binary-search "model"."""

from __future__ import annotations

import random
import re
import string
from collections import Counter

import numpy as np
import pytest

from actors.engines.turns import TurnRequest, TurnResult
from actors.episodes.builtin import BUILTIN, GuessNumberEnv
from actors.episodes.env import EnvSpecError, make_env
from actors.episodes.runner import EpisodeRunner
from common import guess_number as gn
from common.chat_bridge import make_bridge
from common.config import load_config
from common.config.env import EnvConfig
from common.tasks import make_task, task_from_config
from common.tokenizer import CharTokenizer


def test_instances_stay_inside_the_distribution():
    insts = [gn.draw(random.Random(s)) for s in range(3000)]
    sizes = Counter(i.n for i in insts)
    assert set(sizes) == set(range(8, 33))  # every size in 8..32, none outside
    assert {i.lo for i in insts} == set(range(1, 61))
    assert all(i.lo <= i.secret <= i.hi and i.hi == i.lo + i.n - 1 for i in insts)
    assert {i.secret - i.lo for i in insts if i.n == 8} == set(range(8))  # both ends reached
    # T = ceil(log2(n + 1)) + 1: binary search always fits, with one spare.
    assert [gn.turns_for(n) for n in (8, 15, 16, 31, 32)] == [5, 5, 6, 6, 7]
    assert all(
        2 ** (gn.turns_for(n) - 1) >= n + 1 > 2 ** (gn.turns_for(n) - 2) for n in range(8, 33)
    )


def test_seeds_pools_and_the_held_out_set_are_fixed_and_disjoint():
    pool, held = gn.training_pool(), gn.held_out()
    assert len(pool) == gn.POOL_SIZE and len(held) == gn.HELD_OUT_SIZE
    assert len(set(held)) == len(held) and not set(held) & set(pool)
    assert gn.instance(7) == gn.instance(7) == pool[7] == gn.instance(7 + gn.POOL_SIZE)
    assert gn.instance(3, "held_out") == held[3]
    assert gn.instance(5, pool_size=0) == gn.instance(5, pool_size=0) != gn.instance(6, pool_size=0)
    assert gn.training_pool(1) != pool
    # The task's pool (task.pool_size=2000, task.pool_seed=0) is the environment's.
    task = task_from_config(load_config(["task=guess_number"]).task)
    assert [p.prompt_id for p in task.problems] == [
        f"guess_number-{i.lo}-{i.hi}-{i.secret}" for i in pool
    ]
    with pytest.raises(ValueError, match="split"):
        gn.instance(0, "test")


def test_each_observation():
    env = make_env("guess_number", {}, 1.0)
    obs, info = env.reset(seed=11)
    lo, hi, secret = gn.instance(11)
    assert obs == (
        f"Guess the secret number between {lo} and {hi}. Reply with one number only. I will "
        "answer higher or lower, then you guess again."
    )
    assert info == {"lo": lo, "hi": hi, "turns": gn.turns_for(hi - lo + 1)}
    malformed = env.step("I think it is big")
    assert malformed.obs == f"Please reply with one number between {lo} and {hi}."
    assert malformed.info["malformed"] and not malformed.terminated
    out = env.step(f"My guess: {hi + 5}")
    assert out.obs == f"Out of range: the number is between {lo} and {hi}."
    assert not out.info["malformed"] and out.info["feedback"] == "out_of_range"
    assert env.step(f"{lo - 1}").obs.startswith("Out of range")
    low = lo if secret != lo else None
    if low is not None:
        assert env.step(f"{low}, then 99").obs == "Higher."  # the first integer counts
    if secret != hi:
        assert env.step(str(hi)).obs == "Lower."
    assert gn.parse_guess("minus -3 or 4") == -3 and gn.parse_guess("none") is None


def test_a_correct_guess_ends_the_episode_with_reward_one():
    env = make_env("guess_number", {}, 1.0)
    env.reset(seed=4)
    secret = gn.instance(4).secret
    step = env.step(f"Is it {secret}?")
    assert (step.obs, step.reward, step.terminated, step.truncated) == ("", 1.0, True, False)
    discounted = make_env("guess_number", {"turn_discount": 0.5}, 1.0)
    discounted.reset(seed=4)
    discounted.step("nothing")
    assert discounted.step(str(secret)).reward == 0.5


def test_t_wrong_turns_truncate_with_reward_zero():
    env = make_env("guess_number", {}, 1.0)
    for seed in range(20):
        _, info = env.reset(seed=seed)
        wrong = gn.instance(seed).lo - 1  # out of range: never correct
        steps = [env.step(str(wrong)) for _ in range(info["turns"])]
        assert [s.truncated for s in steps] == [False] * (info["turns"] - 1) + [True]
        assert not any(s.terminated for s in steps) and all(s.reward == 0.0 for s in steps)


def brute_force_no_feedback(inst: gn.Instance) -> float:
    """Success of the best feedback-ignoring policy (a fixed sequence of distinct guesses) over
    every secret of ``inst``'s range, played through the environment."""
    env, wins = GuessNumberEnv(pool_size=0), 0
    for secret in range(inst.lo, inst.hi + 1):
        env.reset(seed=0)
        env.instance = gn.Instance(inst.lo, inst.hi, secret)
        for guess in range(inst.lo, inst.hi + 1):
            _, reward, terminated, truncated, _ = env.step(str(guess))
            wins += reward
            if terminated or truncated:
                break
    return wins / inst.n


def test_the_no_feedback_ceiling_matches_a_brute_force_simulation():
    insts = [
        gn.Instance(1, 8, 3),
        gn.Instance(20, 35, 20),
        gn.Instance(5, 36, 9),
        gn.Instance(9, 20, 9),
    ]
    simulated = [brute_force_no_feedback(i) for i in insts]
    assert gn.no_feedback_ceiling(insts) == pytest.approx(np.mean(simulated))
    assert simulated[0] == 5 / 8 and simulated[2] == 7 / 32
    # Over the distribution (each size equally likely): 0.324, as the design notes say.
    exact = np.mean([min(gn.turns_for(n), n) / n for n in range(8, 33)])
    assert exact == pytest.approx(0.324, abs=5e-4)
    assert gn.no_feedback_ceiling(gn.training_pool()) == pytest.approx(exact, abs=0.01)


def test_direction_consistency_on_hand_made_episodes():
    # Range 1..16, secret 11: 8 Higher, 12 Lower, 10 Higher, 11 correct: all three follow.
    assert gn.direction_consistency(
        1, 16, [8, 12, 10, 11], ["higher", "lower", "higher", "correct"]
    ) == (3, 3)
    # The observation texts work too; 9 moves up after "Higher." but 13 leaves [9, 12] known so
    # far, and a malformed turn after feedback is never consistent.
    said = ["Higher.", "Lower.", "Lower.", "Please reply..."]
    assert gn.direction_consistency(1, 16, [8, 13, 20, None], said) == (1, 3)
    # Turns after a malformed or out-of-range answer are not counted; the first turn never is.
    assert gn.direction_consistency(
        1, 16, [None, 40, 5], ["malformed", "out_of_range", "higher"]
    ) == (0, 0)
    # Repeating the guess after "Higher." is inconsistent.
    assert gn.direction_consistency(1, 16, [8, 8], ["higher", "higher"]) == (0, 1)


def test_the_builtin_loads_and_the_config_takes_it():
    assert BUILTIN["guess_number"] is GuessNumberEnv
    env = make_env("guess_number", {}, 1.0)
    assert env.reset(seed=1)[0].startswith("Guess the secret number")
    with pytest.raises(EnvSpecError):
        make_env("guess_number", {"split": "test"}, 1.0)
    cfg = load_config(["task=guess_number", "env.name=guess_number", "env.max_turn_tokens=24"])
    assert (cfg.task.name, cfg.env.name, cfg.task.pool_size) == (
        "guess_number",
        "guess_number",
        2000,
    )
    assert make_task("guess_number").reward(task_from_config(cfg.task).problems[0], "I say 3") in (
        0.0,
        1.0,
    )


# ---------------------------------------------------------------- through the episode runner

ALPHABET = "".join(sorted(set(string.ascii_letters + string.digits + " .,:'-?!")))
TOKENIZER = CharTokenizer(ALPHABET)
EOS = TOKENIZER.eos_id


class BinarySearcher:
    """A scripted engine: each turn guesses the middle of the interval the history tells (or, with
    ``ignore``, the low end, whatever was said)."""

    def __init__(self, ignore: bool = False) -> None:
        self.ignore, self.state = ignore, {}

    def serve(self, source, weight_source, on_turn) -> None:
        while True:
            items = source.take(64)
            for item in items:
                if isinstance(item, TurnRequest):
                    on_turn(self.turn(item))
            if not items:
                if source.closed:
                    return
                source.wait(0.01)

    def turn(self, req: TurnRequest) -> TurnResult:
        text = TOKENIZER.decode(list(req.prompt_ids))
        if req.first_turn:
            lo, hi = map(int, re.search(r"between (\d+) and (\d+)", text).groups())
            self.state[req.request_id] = [lo, hi, None]
        low, high, last = state = self.state[req.request_id]
        if last is not None and text.endswith(gn.HIGHER):
            state[0] = last + 1
        elif last is not None and text.endswith(gn.LOWER):
            state[1] = last - 1
        guess = state[0] if self.ignore else (state[0] + state[1]) // 2
        state[2] = guess
        ids = np.asarray([*TOKENIZER.encode(f"I guess {guess}"), EOS], dtype=np.int32)
        return TurnResult(
            req.request_id,
            ids,
            np.zeros(len(ids), np.float32),
            np.zeros(len(ids), np.int32),
            "stop_id",
        )


def run_episodes(engine, seeds, group_size=2):
    cfg = EnvConfig(name="guess_number", workers=0, max_turn_tokens=24)
    bridge = make_bridge(TOKENIZER)
    make = lambda: make_env("guess_number", {}, 1.0)  # noqa: E731
    runner = EpisodeRunner(engine, cfg, bridge, TOKENIZER, make, frozenset({EOS}))
    groups = []
    episodes = runner.run_batch(seeds, group_size, None, groups.append)
    return episodes, groups


def test_binary_search_through_the_runner_always_wins():
    episodes, groups = run_episodes(BinarySearcher(), [3, 41, 977])
    assert len(groups) == 3
    for seed, row in zip([3, 41, 977], episodes, strict=True):
        inst = gn.instance(seed)
        for ep in row:
            assert ep.stop == "env_done" and sum(ep.turn_rewards) == 1.0
            assert len(ep.seen) <= inst.turns
            guesses = [gn.parse_guess(t) for t in ep.seen]
            kinds = [gn.answer(inst, g)[1] for g in guesses]
            consistent, eligible = gn.direction_consistency(inst.lo, inst.hi, guesses, kinds)
            assert consistent == eligible == len(guesses) - 1
    assert all(c.reward == 1.0 and c.finished for g in groups for c in g.completions)


def test_ignoring_the_feedback_runs_out_of_turns():
    seeds = [
        s for s in range(50) if gn.instance(s).secret - gn.instance(s).lo >= gn.instance(s).turns
    ][:2]
    episodes, groups = run_episodes(BinarySearcher(ignore=True), seeds)
    for seed, row in zip(seeds, episodes, strict=True):
        for ep in row:
            assert ep.stop == "max_turns" and len(ep.seen) == gn.instance(seed).turns
    assert all(c.reward == 0.0 for g in groups for c in g.completions)
