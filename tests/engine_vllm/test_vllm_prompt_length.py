"""A prompt vLLM cannot serve (longer than ``engine.vllm_max_model_len`` minus one new token) is
refused by the engine, counted, and the rest of the batch is served: never an exception inside
the actor (which restarted with the same seed and prompts, a crash loop)."""

from __future__ import annotations

import pytest

from actors.exporter import ActorExporter
from common import metric_names as mn
from common.config import load_config
from common.model import save_pretrained
from testing.prometheus import scrape
from testing.vllm import greedy_vllm, weights

pytestmark = pytest.mark.vllm

MAX_LEN = 16


def test_an_over_long_prompt_is_refused_counted_and_the_batch_goes_on(tmp_path):
    save_pretrained(weights(0), tmp_path)
    engine = greedy_vllm(tmp_path, eos_id=-1, vllm_max_model_len=MAX_LEN)
    assert engine.max_prompt_len == MAX_LEN - 1
    fits = [1] + [5] * (MAX_LEN - 2)  # the longest prompt served: room for one new token
    too_long = [1] + [6] * (MAX_LEN - 1)  # vLLM itself would raise on this one
    prompts = [[1, 5, 6, 7], too_long, fits, [1, 9] + [7] * 40]
    delivered: list[int] = []
    out = engine.generate(prompts, 2, 4, on_group=lambda i, group: delivered.append(i))
    assert delivered == [0, 2]  # the refused prompts' groups are never handed on
    assert [len(group) for group in out] == [2, 0, 2, 0]
    assert [len(r.token_ids) for r in out[0]] == [4, 4]
    # The longest prompt served is capped by the model length: one new token.
    assert [len(r.token_ids) for r in out[2]] == [1, 1]
    stats = engine.stats()
    assert stats[mn.ACTOR_PROMPTS_TOO_LONG] == 2
    assert stats[mn.ACTOR_TOKENS] == 10
    # The engine goes on: the next batch is served and the counter was reset by stats().
    again = engine.generate([[1, 5, 6, 7]], 2, 4)
    assert [len(r.token_ids) for r in again[0]] == [4, 4]
    second = engine.stats()
    assert second[mn.ACTOR_PROMPTS_TOO_LONG] == 0

    # The actor's /metrics sums the per-batch counts into a counter (what the loop hands its
    # exporter: the engine's stats of each batch).
    cfg = load_config(["actor.metrics_port=0"])
    with ActorExporter.start(cfg, tmp_path, "a") as exporter:
        exporter.update(stats, version=0)
        exporter.update(second, version=0)
        metrics = scrape(exporter.port)
    assert metrics[("specrl_actor_prompts_too_long_total", (("actor_id", "a"),))] == 2
