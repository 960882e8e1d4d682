"""Speculative drafts across turns (design note §1.7, §5.2): greedy multi-turn episodes through
the torch engine's turn-request stream give plain greedy decoding's turns, token for token, with
every drafting method the tiny models support; n-gram rows and history are keyed by the task
(``draft_key``), the history (tool output included) is a draft source, and no row outlives
``serve``; a turn stops at any of its own stop ids; sampled episodes with drafts and a swap
follow the turn-local law."""

from __future__ import annotations

import copy

import pytest

from actors.engines.torch.engine import TorchEngine
from actors.engines.turns import EpisodeDone, TurnQueue, TurnRequest, TurnResult
from common import metric_names as mn
from common.config.actor import SpecConfig
from common.model import Transformer
from testing import multiturn_check as mc
from testing.eagle import with_head
from testing.lossless_check import NO_EOS, peaky_model, with_adapter

EOS, END = 11, 2  # the turns' stop ids: EOS ends the episode, END only the turn
PROMPTS = [[1, 5, 6, 5, 6], [1, 7], [1, 8, 9, 8, 9, 8, 9], [1, 3]]
SIBLINGS, TURNS, BUDGET = 2, 3, 6

SPECS = [
    SpecConfig(method="ngram", k=3, ngram_max_n=2, ngram_min_n=1, adaptive=False),
    SpecConfig(method="ngram", k=3, ngram_max_n=2, ngram_sources="group", adaptive=False),
    SpecConfig(method="ngram", k=2, ngram_max_n=3, ngram_sources="prompt"),
    SpecConfig(method="early_exit", k=2, exit_layer=1, adaptive=False),
    SpecConfig(method="hybrid", k=3, exit_layer=1, ngram_max_n=2, adaptive=False),
    SpecConfig(method="hybrid", k=3, exit_layer=2, ngram_max_n=2),
    SpecConfig(method="early_exit", k=3, exit_layer=1, adapter=True, adaptive=False),
    SpecConfig(method="eagle3", k=3, adaptive=False),
]


def tool_output(turn: list[int]) -> list[int]:
    """A deterministic environment: a marker and the turn's tokens (stop ids left out) twice,
    for n-gram drafts to copy."""
    body = [t for t in turn if t not in (EOS, END)] or [3]
    return [4, *body, 4, *body]


class Runner:
    """Synchronous episodes (the environment steps inside ``on_turn``): ``SIBLINGS`` episodes
    per prompt, up to ``TURNS`` turns each, ending early at EOS."""

    def __init__(self) -> None:
        self.queue = TurnQueue()
        self.turns: dict[int, tuple[list[int], str]] = {}
        self.starts = [(g, p) for g, p in enumerate(PROMPTS) for _ in range(SIBLINGS)]
        self.history = [list(p) for _, p in self.starts]
        self.open = len(self.starts)

    def start(self) -> None:
        for episode in range(len(self.starts)):
            self._request(episode, 0)

    def _request(self, episode: int, turn: int) -> None:
        group = self.starts[episode][0]
        self.queue.put(
            TurnRequest(
                request_id=episode * TURNS + turn,
                prompt_ids=list(self.history[episode]),
                max_new_tokens=BUDGET,
                stop_ids=frozenset({EOS, END}),
                draft_key=f"task{group}",
                group=group,
                first_turn=turn == 0,
            )
        )

    def on_turn(self, result: TurnResult) -> None:
        episode, turn = divmod(result.request_id, TURNS)
        tokens = result.token_ids.tolist()
        self.turns[result.request_id] = (tokens, result.stop)
        self.history[episode] += tokens
        if turn + 1 < TURNS and not (tokens and tokens[-1] == EOS):
            self.history[episode] += tool_output(tokens)
            self._request(episode, turn + 1)
            return
        key = f"task{self.starts[episode][0]}"
        self.queue.put(EpisodeDone(key, self.history[episode]))
        self.open -= 1
        if self.open == 0:
            self.queue.close()


def greedy_episodes(engine: TorchEngine) -> dict[int, tuple[list[int], str]]:
    runner = Runner()
    runner.start()
    with engine.greedy():
        engine.serve(runner.queue, None, runner.on_turn)
    assert runner.open == 0
    return runner.turns


def tiny_model() -> Transformer:
    return peaky_model(vocab=16, seed=0, scale=30.0)


@pytest.mark.parametrize(
    "spec", SPECS, ids=lambda s: f"{s.method}-{s.ngram_sources}{'-adapter' if s.adapter else ''}"
)
def test_greedy_multiturn_with_drafts_equals_plain(spec):
    model = tiny_model()
    plain = greedy_episodes(TorchEngine(model, EOS, 0, seed=0))
    assert len({len(tokens) for tokens, _ in plain.values()}) > 1  # turns end differently
    drafted = with_adapter(copy.deepcopy(model), spec, None)  # a perturbed adapter, if any
    if spec.method == "eagle3":
        drafted = with_head(drafted)
    engine = TorchEngine(drafted, EOS, 0, seed=0, spec=spec, max_rows=5)
    for _ in range(2):  # the second time, n-gram history holds the first time's episodes
        assert greedy_episodes(engine) == plain
        assert engine.cache.tables == {}
        if engine.ngram is not None:
            assert engine.ngram.rows() == 0 and engine.ngram._groups == {}
    if engine.ngram is not None:
        assert engine.batch.counters.proposed > 0  # drafts copied from the history
    stats = engine.stats()
    if engine.ngram is not None and spec.ngram_sources == "history":
        assert stats[mn.SPEC_ACCEPTANCE_RATE] > 0
        # History is remembered per task, once per episode: not per prompt, not per turn.
        assert set(engine.ngram._history) == {f"task{g}" for g in range(len(PROMPTS))}
        assert all(len(engine.ngram.history(f"task{g}")) == 2 * SIBLINGS for g in range(4))


@pytest.mark.parametrize("spec", [None, SPECS[0], SPECS[3]], ids=["plain", "ngram", "early_exit"])
def test_a_turn_stops_at_any_of_its_stop_ids(spec):
    # Per-request stop ids: each turn ends at the first of its own stop ids (accepted drafts
    # after it are dropped), whatever the engine's EOS.
    model = tiny_model()
    reference = TorchEngine(model, NO_EOS, 0, temperature=0.0).generate(PROMPTS, 1, 12)
    engine = TorchEngine(model, NO_EOS, 0, temperature=0.0, spec=spec)
    queue, out = TurnQueue(), {}
    expected = {}
    for i, (prompt, group) in enumerate(zip(PROMPTS, reference, strict=True)):
        tokens = group[0].token_ids.tolist()
        stop = frozenset({tokens[3], 0 if tokens[3] else 1})  # one met, one maybe not
        end = min(tokens.index(s) for s in stop if s in tokens)
        expected[i] = (tokens[: end + 1], "stop_id")
        queue.put(TurnRequest(i, prompt, 12, stop, f"task{i}", i, True))
    expected[len(PROMPTS)] = (reference[0][0].token_ids.tolist()[:5], "length")
    queue.put(TurnRequest(len(PROMPTS), PROMPTS[0], 5, frozenset(), "task0", 0, True))
    queue.close()
    engine.serve(
        queue, None, lambda r: out.__setitem__(r.request_id, (r.token_ids.tolist(), r.stop))
    )
    assert out == expected


@pytest.mark.parametrize(
    "spec",
    [
        SpecConfig(method="ngram", k=2, ngram_max_n=2, adaptive=False),
        SpecConfig(method="hybrid", k=2, exit_layer=1, ngram_max_n=2, adaptive=False),
    ],
    ids=["ngram", "hybrid"],
)
def test_sampled_multiturn_with_drafts_follows_the_turn_local_law(spec):
    # Drafts change how many tokens a step emits, so with them a swap lands mid-turn at a
    # different point in each episode; between turns it lands at the same point for all: turn 1
    # drafted under the old weights, turn 2 (drafts copied from the history, the environment's
    # tokens included) under the new ones.
    old, new = mc.model_pair()
    engine = TorchEngine(old, NO_EOS, 0, seed=4, version=0, spec=spec, inflight="verify_on_swap")
    driver: mc.Driver
    source = mc.SwapWhen(new, lambda: driver.all_first_turns_done())
    driver = mc.Driver(3000, env_seed=9, gate=source.delivered)
    episodes = mc.run(engine, driver, source)
    p = mc.episodes_pvalue(mc.exact_episode_logprobs(old, new), episodes)
    control = mc.episodes_pvalue(mc.exact_episode_logprobs(old, old), episodes)
    assert p > 0.01 and control < 0.01, (p, control)
    assert engine.batch.counters.accepted > 0
    assert engine.ngram is not None and engine.ngram.rows() == 0
