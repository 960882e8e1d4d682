"""Held-out evaluation of multi-turn episodes (actors/episodes/evaluation.py) on the tiny char
model and in-process environments: held-out seeds and the ``eval`` split reach the environment,
the figures are single-turn evaluation's over the episodes' rewards, failures score the failure
reward and are counted, the training's runner counters are left as they were, and every episode
is written to the samples file."""

from __future__ import annotations

import json

from actors.engines.torch.engine import TorchEngine
from actors.episodes.builtin import GuessNumberEnv
from actors.episodes.env import CheckedEnv
from actors.episodes.evaluation import EVAL_SEED_BASE, EpisodeEvaluator, eval_seeds
from actors.episodes.runner import EpisodeRunner
from common import guess_number as gn
from common import metric_names as mn
from common.chat_bridge import make_bridge
from common.config.env import EnvConfig
from common.config.run import EvalConfig
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from testing.models import random_model

TOKENIZER = CharTokenizer(BUILTIN_ALPHABET)
SEEN: list[tuple[int, dict]] = []


class Scored:
    """Two turns; reward 1 on the last when the seed is even; the seed of 3 mod 4 raises."""

    def reset(self, *, seed, options):
        SEEN.append((seed, dict(options)))
        self.seed, self.n = seed, 0
        return "go>", {}

    def step(self, action):
        self.n += 1
        if self.seed % 4 == 3:
            raise RuntimeError("broken")
        done = self.n >= 2
        return "=ok>", float(done and self.seed % 2 == 0), done, False, {}


def test_held_out_episodes_are_scored_like_single_turn_evaluation(tmp_path):
    SEEN.clear()
    engine = TorchEngine(
        random_model(TOKENIZER.vocab_size, seed=3),
        TOKENIZER.eos_id,
        TOKENIZER.pad_id,
        1.0,
        seed=1,
        version=0,
    )
    cfg = EnvConfig(name="s:Scored", max_turn_tokens=4, failure_reward=-0.5)
    bridge = make_bridge(TOKENIZER, max_obs_chars=cfg.max_obs_chars, max_obs_tokens=16)
    runner = EpisodeRunner(
        engine, cfg, bridge, TOKENIZER, lambda: CheckedEnv(Scored()), frozenset({TOKENIZER.eos_id})
    )
    runner.counts["env/stop/env_done"] = 7  # the training's, so far
    path = tmp_path / "eval.jsonl"
    evaluation = EvalConfig(every=2, prompts=8, samples=3, seed=1)
    evaluator = EpisodeEvaluator(evaluation, runner, cfg.failure_reward, path)
    assert evaluator.due(0)
    figures = evaluator.run(engine)
    assert not evaluator.due(1) and evaluator.due(2)
    seeds = eval_seeds(8, 1)
    assert all(s >= EVAL_SEED_BASE for s in seeds)
    assert {s for s, _ in SEEN} == set(seeds)
    assert all(options["split"] == "eval" for _, options in SEEN)
    # 8 problems x (3 sampled + 1 greedy); seeds 3 mod 4 fail; even seeds score 1 at the end.
    rewards = {s: (-0.5 if s % 4 == 3 else float(s % 2 == 0)) for s in seeds}
    mean = sum(rewards.values()) / 8
    assert abs(figures[mn.EVAL_AVG_REWARD] - mean) < 1e-9
    assert figures[mn.EVAL_PROMPTS] == 8 and figures[mn.EVAL_K] == 3
    assert abs(figures[mn.EVAL_GREEDY_AVG_REWARD] - mean) < 1e-9
    failing = sum(s % 4 == 3 for s in seeds)
    assert figures[mn.EVAL_REWARD_FAILED] == failing * 4
    assert dict(runner.counts) == {"env/stop/env_done": 7}  # the training's counters, untouched
    evaluator.close()
    [record] = [json.loads(line) for line in path.read_text().splitlines()]
    assert [p["seed"] for p in record["problems"]] == seeds
    assert all(len(p["episodes"]) == 3 and "greedy" in p for p in record["problems"])


def test_guess_number_evaluates_on_its_held_out_instances():
    env = GuessNumberEnv()
    for seed in (0, 5, EVAL_SEED_BASE + 3):
        env.reset(seed=seed, options={"split": "eval", "sibling": 0})
        assert env.instance == gn.instance(seed, "held_out")
        env.reset(seed=seed, options={"sibling": 0})
        assert env.instance == gn.instance(seed, "train")
