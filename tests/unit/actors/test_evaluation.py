"""Evaluation during training: avg@k and pass@k on held-out problems training never draws."""

from __future__ import annotations

import json
import random

import pytest

from actors.engines.torch.engine import TorchEngine
from actors.evaluation import Evaluator, evaluation_figures, greedy_figures
from actors.rewards.scoring import TaskScorer, completion_text
from common import metric_names as mn
from common.config import load_config
from common.config.actor import SpecConfig
from common.config.run import EvalConfig
from common.dataset_task import DatasetTask
from common.tasks import PromptPool, held_out_problems, make_task
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from testing.models import random_model

TOKENIZER = CharTokenizer(BUILTIN_ALPHABET)
REVERSE = make_task("reverse", min_digits=3, max_digits=3)


def reverse_evaluator(cfg: EvalConfig, problems, max_new_tokens: int, path=None) -> Evaluator:
    """An evaluator of ``problems`` of the reverse task, scored by the task's own reward."""
    return Evaluator(
        cfg, problems, TOKENIZER.encode, TaskScorer(REVERSE), TOKENIZER, max_new_tokens, path
    )


def test_figures_of_a_hand_computed_batch():
    rewards = [[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 1.0]]
    figures = evaluation_figures(rewards, pass_reward=1.0)
    assert figures[mn.EVAL_AVG_REWARD] == pytest.approx(4.5 / 12)
    assert figures[mn.EVAL_PASS_AT_1] == pytest.approx(4 / 12)
    assert figures[mn.EVAL_PASS_AT_K] == pytest.approx(2 / 3)
    assert (figures[mn.EVAL_K], figures[mn.EVAL_PROMPTS]) == (4, 3)
    # A lower bar counts the 0.5 too.
    assert evaluation_figures(rewards, pass_reward=0.5)[mn.EVAL_PASS_AT_1] == pytest.approx(5 / 12)


def test_held_out_problems_are_outside_the_training_pool():
    pool = PromptPool(make_task("addition", min_digits=1, max_digits=2), size=64, seed=0)
    held = held_out_problems(pool, 32, seed=1)
    assert len(held) == 32
    assert not {p.prompt for p in held} & {p.prompt for p in pool.problems}
    assert held == held_out_problems(pool, 32, seed=1)  # the same every time


def test_a_data_set_evaluates_its_held_out_problems_and_needs_some(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{i}+1", "answer": i + 1}) + "\n" for i in range(50))
    )
    task = DatasetTask(path, eval_fraction=0.2)
    assert held_out_problems(task, 0, seed=0) == task.eval_problems
    assert held_out_problems(task, 3, seed=0) == task.eval_problems[:3]
    with pytest.raises(ValueError, match="no held-out problems"):
        held_out_problems(DatasetTask(path), 0, seed=0)
    with pytest.raises(ValueError, match="needs held-out problems"):
        load_config(["task=dataset", f"task.path={path}", "eval.every=5", "model.path=x"])


def test_config_refuses_an_evaluating_actor_that_does_not_exist():
    with pytest.raises(ValueError, match="eval.actor"):
        load_config(["eval.every=5", "eval.actor=2", "actor.num_actors=2"])
    with pytest.raises(ValueError, match="eval.samples"):
        load_config(["eval.samples=0"])


def test_the_evaluator_runs_at_each_new_multiple_of_every_on_a_real_engine():
    task = make_task("reverse", min_digits=3, max_digits=3)
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    problems = task.sample(random.Random(3), 5)
    engine = TorchEngine(
        random_model(tokenizer.vocab_size, seed=0), tokenizer.eos_id, tokenizer.pad_id, version=0
    )
    evaluator = reverse_evaluator(EvalConfig(every=3, samples=2), problems, max_new_tokens=6)
    assert [evaluator.due(v) for v in (0,)] == [True]
    figures = evaluator.run(engine)
    assert figures[mn.EVAL_VERSION] == 0 and figures[mn.EVAL_PROMPTS] == 5
    assert figures[mn.EVAL_K] == 2 and 0.0 <= figures[mn.EVAL_AVG_REWARD] <= 1.0
    assert [evaluator.due(v) for v in (0, 1, 2, 3, 4)] == [False, False, False, True, True]
    model = random_model(tokenizer.vocab_size, seed=1)
    engine.load_weights(4, model.state_dict())
    evaluator.run(engine)
    assert evaluator.latest[mn.EVAL_VERSION] == 4
    assert [evaluator.due(v) for v in (4, 5, 6)] == [False, False, True]


def test_greedy_figures_of_a_hand_computed_batch():
    figures = greedy_figures([1.0, 0.0, 0.5, 1.0], pass_reward=1.0)
    assert figures[mn.EVAL_GREEDY_AVG_REWARD] == pytest.approx(2.5 / 4)
    assert figures[mn.EVAL_GREEDY_PASS] == pytest.approx(2 / 4)
    assert greedy_figures([0.5], pass_reward=0.5)[mn.EVAL_GREEDY_PASS] == 1.0


@pytest.mark.parametrize(
    "spec",
    [SpecConfig(method="none"), SpecConfig(method="early_exit", k=3, exit_layer=1, adaptive=False)],
    ids=["plain", "early_exit"],
)
def test_the_greedy_evaluation_is_the_argmax_decode_and_leaves_sampling_as_it_was(spec, tmp_path):
    # The greedy completion of each prompt is what an engine built at temperature 0 decodes
    # (with or without drafts), whatever the sampling engine's seed; sampling resumes after.
    tokenizer = TOKENIZER
    problems = REVERSE.sample(random.Random(5), 4)
    prompts = [tokenizer.encode(p.prompt) for p in problems]
    model = random_model(tokenizer.vocab_size, seed=2)
    reference = TorchEngine(model, tokenizer.eos_id, tokenizer.pad_id, temperature=0.0)
    expected = [
        completion_text(tokenizer, r[0]) for r in reference.generate(prompts, 1, max_new_tokens=8)
    ]
    texts = []
    for seed in (0, 1):
        engine = TorchEngine(
            model, tokenizer.eos_id, tokenizer.pad_id, temperature=0.9, seed=seed, spec=spec
        )
        path = tmp_path / f"eval-{seed}.jsonl"
        evaluator = reverse_evaluator(EvalConfig(every=1, samples=2), problems, 8, path)
        figures = evaluator.run(engine)
        evaluator.close()
        assert engine.temperature == 0.9
        assert 0.0 <= figures[mn.EVAL_GREEDY_PASS] <= figures[mn.EVAL_GREEDY_AVG_REWARD] <= 1.0
        row = json.loads(path.read_text())
        texts.append([p["greedy"]["completion"] for p in row["problems"]])
        assert (
            len(row["problems"][0]["completions"]) == 2 and "reward" in row["problems"][0]["greedy"]
        )
    assert texts == [expected, expected]
    # Sampling at 0.9 after the greedy block: the completions of a prompt differ again.
    sampled = engine.generate([prompts[0]], 8, max_new_tokens=8)[0]
    assert len({completion_text(tokenizer, r) for r in sampled}) > 1


def test_without_greedy_no_greedy_figures():
    engine = TorchEngine(
        random_model(TOKENIZER.vocab_size, seed=0), TOKENIZER.eos_id, TOKENIZER.pad_id
    )
    problems = REVERSE.sample(random.Random(3), 2)
    evaluator = reverse_evaluator(EvalConfig(every=1, samples=1, greedy=False), problems, 4)
    assert mn.EVAL_GREEDY_PASS not in evaluator.run(engine)


def test_a_stop_leaves_the_evaluation_at_the_next_decoding_step():
    # A held-out evaluation is hundreds of completions on a real model: a stop must not wait
    # for it (the launcher kills what outlives its grace period).
    from actors.loop import GenerationStopped

    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    problems = REVERSE.sample(random.Random(3), 5)
    engine = TorchEngine(
        random_model(tokenizer.vocab_size, seed=0), tokenizer.eos_id, tokenizer.pad_id, version=0
    )
    evaluator = reverse_evaluator(EvalConfig(every=1, samples=4), problems, max_new_tokens=12)
    polls = []

    def stop_source() -> None:
        polls.append(1)
        if len(polls) == 3:
            raise GenerationStopped

    with pytest.raises(GenerationStopped):
        evaluator.run(engine, stop_source=stop_source)
    assert len(polls) == 3  # polled once per decoding step, left at the first poll after the stop
    assert evaluator.latest == {}  # nothing half-measured is reported
    assert evaluator.run(engine)[mn.EVAL_PROMPTS] == 5  # and the engine still serves
