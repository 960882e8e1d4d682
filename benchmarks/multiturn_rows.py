"""The mechanics and speed rows of ``benchmarks/multiturn.py`` (design note §5.1), on the
built-in ``lookup`` environment and the tiny char model warm-started on lookup demonstrations
(``learner/prepare/warm_start.py``, built once into ``runs/models``).

Episodes run through the actor's own episode runner (``actors/episodes/runner.py``) and the
torch engine's ``serve``; :class:`Instrumented` stands between them and records each turn
request the runner queued, when each turn was delivered and how long the decode loop sat idle
(every row waiting on its environment). Reported:

- ``mt_env_positions_in_loss``: over every batch of the run's groups collated by the learner
  (``learner/batch.py``), loss-mask positions whose target is an environment token;
- ``mt_retokenization_mismatches``: turn requests whose prompt is not the prefix of the
  episode's final token stream (the next prompt is the previous ids, never re-tokenised text);
- ``mt_bridge_probe_mismatches``: random conversations (``testing/conversations.py``) whose
  turn-by-turn ids differ from the full render, for SmolLM2's template (when the preset is
  installed) and a ChatML fixture;
- ``mt_ngram_tokens_per_verify_after_tool`` / ``_other_turns``: tokens per verification
  (accepted drafts + 1, per row) of ``spec=ngram`` at k = 4 on lookup's turns that follow the
  tool's output, and on first turns;
- ``mt_decode_idle_frac``: the share of ``serve``'s wall time with no row to decode, with 32
  episodes in flight (8 problems x 4, the next problem admitted as a group ends:
  ``env.problems_in_flight``) and ``ENV_LATENCY_S`` of latency in every environment step;
  beside it, the same problems served a batch of 8 at a time (``_batch_at_once``) and with the
  latency drawn uniformly from 0 to twice it (``_jittered_latency``, and
  ``_jittered_latency_batch_at_once``);
- ``mt_turn_overhead_ms_p50``: per turn, from its delivery by the engine to the next turn's
  request, less the environment's own step time (runner, bridge, thread hand-offs).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from actors.engines.torch.engine import TorchEngine
from actors.engines.turns import TurnRequest
from actors.episodes.env import CheckedEnv, make_env
from actors.episodes.runner import EpisodeRunner, episode_runner
from common import metric_names as mn
from common.chat_bridge import BridgeError, ChatBridge, make_bridge, probe_conversation
from common.config import load_config
from common.config.actor import SpecConfig
from common.config.env import EnvConfig
from common.model import load_pretrained
from common.tokenizer import CharTokenizer, load_tokenizer
from learner.batch import collate
from learner.prepare.warm_start import ensure_model
from testing.conversations import random_conversation

INIT_STEPS = 800
"""Warm-start steps of the tiny model for these rows: the tool call and the copy mostly right
(the learning row starts from a weaker model on purpose)."""
ENV_LATENCY_S = 0.05
IN_FLIGHT = (8, 4)
"""Problems x siblings: 32 episodes in flight."""
PROBE_CONVERSATIONS = 500


def lookup_config(init_steps: int = INIT_STEPS) -> Any:
    return load_config(
        [
            "task=lookup",
            "env.name=lookup",
            "env.max_turn_tokens=10",
            "env.max_total_tokens=100",
            "env.max_obs_tokens=32",
            f"model.init_steps={init_steps}",
        ]
    )


def lookup_model(cfg: Any) -> tuple[torch.nn.Module, CharTokenizer]:
    path = ensure_model(cfg)
    tokenizer = load_tokenizer(path)
    assert isinstance(tokenizer, CharTokenizer)
    return load_pretrained(path).eval(), tokenizer


class Latency:
    """An environment whose ``step`` takes at least ``seconds`` (sleeping: it holds no core),
    or, with ``rng``, uniformly 0 to 2 x ``seconds``; the wall time of each of its steps is
    kept."""

    def __init__(self, env: Any, seconds: float, rng: random.Random | None = None) -> None:
        self.env, self.seconds, self.rng = env, seconds, rng
        self.times: list[float] = []

    def reset(self, *, seed, options=None):
        return self.env.reset(seed=seed, options=options)

    def step(self, action):
        started = time.perf_counter()
        if self.seconds:
            time.sleep(self.seconds * (2 * self.rng.random() if self.rng else 1.0))
        out = self.env.step(action)
        self.times.append(time.perf_counter() - started)
        return out

    def close(self):
        close = getattr(self.env, "close", None)
        if close is not None:
            close()


@dataclass
class ServeLog:
    """One ``serve`` call as :class:`Instrumented` saw it, by request id (the episode's)."""

    requests: dict[int, list[TurnRequest]] = field(default_factory=lambda: defaultdict(list))
    requested_at: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    delivered_at: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    idle_s: float = 0.0
    wall_s: float = 0.0
    deliver_s: float = 0.0
    """Time the decode thread spent handing finished turns to the runner (``on_turn``)."""
    deliver_max_s: float = 0.0
    """The longest single hand-off."""


class Instrumented:
    """The engine, as the runner sees it, with each ``serve`` call logged (:class:`ServeLog`):
    the turn requests queued and when, when each turn was delivered, and the decode loop's idle
    time (``serve`` waits on its queue only when no row is left to decode)."""

    def __init__(self, engine: TorchEngine) -> None:
        self.engine = engine
        self.calls: list[ServeLog] = []
        self._lock = threading.Lock()
        self.decode_threads: set[int] = set()
        """The threads ``serve`` ran on (the decode loop's)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def serve(self, queue, weight_source, on_turn) -> None:
        log, put, wait = ServeLog(), queue.put, queue.wait
        self.calls.append(log)

        def record(item) -> None:
            if isinstance(item, TurnRequest):
                with self._lock:
                    log.requests[item.request_id].append(item)
                    log.requested_at[item.request_id].append(time.perf_counter())
            put(item)

        def idle(timeout_s: float) -> None:
            started = time.perf_counter()
            wait(timeout_s)
            log.idle_s += time.perf_counter() - started

        def delivered(result) -> None:
            started = time.perf_counter()
            with self._lock:
                log.delivered_at[result.request_id].append(started)
            on_turn(result)
            took = time.perf_counter() - started
            log.deliver_s += took
            log.deliver_max_s = max(log.deliver_max_s, took)

        queue.put, queue.wait = record, idle
        self.decode_threads.add(threading.get_ident())
        started = time.perf_counter()
        try:
            self.engine.serve(queue, weight_source, delivered)
        finally:
            log.wall_s = time.perf_counter() - started


def tiny_engine(model, tokenizer, cfg: Any, spec: SpecConfig | None = None) -> TorchEngine:
    """The torch engine of the rows: the run's sampling and seed, version 0."""
    return TorchEngine(
        model,
        tokenizer.eos_id,
        tokenizer.pad_id,
        cfg.sampling.temperature,
        seed=cfg.run.seed,
        version=0,
        spec=spec,
    )


def lookup_runner(
    model: torch.nn.Module,
    tokenizer: CharTokenizer,
    cfg: Any,
    spec: SpecConfig | None = None,
    latency_s: float = 0.0,
    jitter_seed: int | None = None,
) -> tuple[EpisodeRunner, Instrumented]:
    """The runner of the rows over ``Instrumented`` (the torch engine), each environment step
    taking ``latency_s`` (uniformly 0 to twice it, seeded, with ``jitter_seed``)."""
    engine = tiny_engine(model, tokenizer, cfg, spec)
    env_cfg: EnvConfig = cfg.env
    bridge = make_bridge(tokenizer, max_obs_chars=env_cfg.max_obs_chars)

    jitter = None if jitter_seed is None else random.Random(jitter_seed)

    def fresh() -> CheckedEnv:
        inner = make_env(env_cfg.name, env_cfg.kwargs, cfg.learner.max_abs_reward)
        latency = Latency(inner.env, latency_s, jitter)
        return CheckedEnv(latency, inner.max_abs_reward, env_cfg.name)

    wrapped = Instrumented(engine)
    stop_ids = frozenset({tokenizer.eos_id, *bridge.eot_ids})
    return EpisodeRunner(wrapped, env_cfg, bridge, tokenizer, fresh, stop_ids), wrapped


def run(runner: EpisodeRunner, batches: int, problems: int, group: int, seed: int = 0):
    """``batches`` batches of ``problems`` x ``group`` episodes: the groups sent, and each
    batch's episodes (one list per batch, in the order of the serve calls)."""
    groups: list = []
    batches_out: list[list] = []
    for b in range(batches):
        seeds = [seed + 1000 * b + p for p in range(problems)]
        rows = runner.run_batch(seeds, group, None, groups.append)
        batches_out.append([ep for row in rows for ep in row])
    return groups, batches_out


def env_positions_in_loss(groups, pad_id: int) -> tuple[int, int]:
    """(loss-mask positions whose target is an environment token, environment tokens), over the
    groups collated by the learner, 8 groups a batch."""
    in_loss = env_tokens = 0
    for at in range(0, len(groups), 8):
        chunk = groups[at : at + 8]
        batch = collate(chunk, 0, pad_id, torch.device("cpu"))
        rows = [(g.prompt_ids, c) for g in chunk for c in g.completions]
        for i, (prompt, completion) in enumerate(rows):
            env = np.flatnonzero(completion.token_versions < 0)
            positions = torch.as_tensor(len(prompt) - 1 + env, dtype=torch.long)
            in_loss += int((batch.mask[i, positions] > 0).sum())
            env_tokens += len(env)
    return in_loss, env_tokens


def retokenization_mismatches(wrapped: Instrumented, batches: list[list]) -> tuple[int, int]:
    """(turn requests whose prompt is not a prefix of their episode's final stream, requests)."""
    bad = total = 0
    for log, episodes in zip(wrapped.calls, batches, strict=True):
        for ep in episodes:
            final = [*ep.prompt_ids, *ep.stream]
            requests = log.requests[request_id(ep, episodes)]
            total += len(requests)
            bad += sum(list(r.prompt_ids) != final[: len(r.prompt_ids)] for r in requests)
    return bad, total


def request_id(ep, episodes: list) -> int:
    """The runner's request id of ``ep``'s turns: problem x siblings + sibling."""
    siblings = 1 + max(e.sibling for e in episodes)
    return ep.problem * siblings + ep.sibling


def turn_overheads_ms(wrapped: Instrumented, batches: list[list]) -> list[float]:
    """Per turn followed by another: from its delivery to the next request, less the
    environment's step in-process (runner, bridge and thread hand-offs; with worker processes
    the call's IPC too)."""
    out: list[float] = []
    for log, episodes in zip(wrapped.calls, batches, strict=True):
        for ep in episodes:
            rid = request_id(ep, episodes)
            asked, got = log.requested_at[rid], log.delivered_at[rid]
            # In-process: less the environment's own step time; worker processes: the whole
            # call (IPC included; the lookup environment's own compute is microseconds).
            inner = getattr(ep.env, "env", None)
            steps = inner.times if isinstance(inner, Latency) else [0.0] * len(asked)
            for turn in range(len(asked) - 1):
                gap = asked[turn + 1] - got[turn] - steps[turn]
                out.append(1e3 * gap)
    return out


def chat_tokenizers(directory: Path) -> dict[str, Any]:
    """The chat templates the bridge rows use: a ChatML fixture (built in ``directory``) and
    SmolLM2's, when its preset is installed."""
    from common.model_presets import preset_dir
    from common.tokenizer import HFTokenizer
    from testing.own_model import build_tokenizer

    build_tokenizer(directory)
    out = {"chatml_fixture": HFTokenizer(directory)}
    smollm2 = Path(preset_dir("smollm2-135m"))
    if (smollm2 / "tokenizer.json").is_file():
        out["smollm2"] = HFTokenizer(smollm2)
    return out


def bridge_probe_mismatches(conversations: int = PROBE_CONVERSATIONS) -> dict[str, int]:
    """Random conversations whose turn-by-turn ids differ from the full render, per template."""
    out: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, tokenizer in chat_tokenizers(Path(tmp)).items():
            bridge = make_bridge(tokenizer, check=False, max_obs_chars=1 << 30)
            assert isinstance(bridge, ChatBridge)
            rng, bad = random.Random(0), 0
            for index in range(conversations):
                try:
                    probe_conversation(bridge, random_conversation(rng), f"random {index}")
                except BridgeError:
                    bad += 1
            out[name] = bad
    return out


def ngram_tokens_per_verify(model, tokenizer, cfg, requests: list[TurnRequest]) -> float:
    """Tokens per verification (accepted drafts + 1, per row) of ``spec=ngram`` at k = 4 over
    ``requests`` alone, served as fresh turns."""
    from actors.engines.turns import TurnQueue

    engine = tiny_engine(model, tokenizer, cfg, SpecConfig(method="ngram", k=4, adaptive=False))
    queue = TurnQueue()
    queue.put_many(requests)
    queue.close()
    engine.serve(queue, None, lambda result: None)
    return float(engine.stats()[mn.SPEC_MEAN_ACCEPTED_LEN])


def mechanics_figures(
    model, tokenizer, cfg, batches: int = 8, conversations: int = PROBE_CONVERSATIONS
) -> dict:
    """The counters that must be zero, and the n-gram rows, from plain lookup episodes."""
    runner, wrapped = lookup_runner(model, tokenizer, cfg)
    groups, by_batch = run(runner, batches, *IN_FLIGHT)
    in_loss, env_tokens = env_positions_in_loss(groups, tokenizer.pad_id)
    bad, requests = retokenization_mismatches(wrapped, by_batch)
    out: dict = {
        "mt_mechanics_episodes": sum(len(b) for b in by_batch),
        "mt_env_positions_in_loss": in_loss,
        "mt_env_tokens_collated": env_tokens,
        "target_mt_env_positions_in_loss": "== 0",
        "mt_retokenization_mismatches": bad,
        "mt_turn_requests_checked": requests,
        "target_mt_retokenization_mismatches": "== 0",
    }
    probes = bridge_probe_mismatches(conversations)
    out["mt_bridge_probe_mismatches"] = sum(probes.values())
    out["mt_bridge_probe_conversations"] = {name: conversations for name in probes}
    out["target_mt_bridge_probe_mismatches"] = "== 0"
    # The turns that follow the tool's output (the history holds the value to copy), and the
    # first turns, each served alone through spec=ngram at k = 4.
    after_tool, first = [], []
    for log, episodes in zip(wrapped.calls, by_batch, strict=True):
        for ep in episodes:
            turns = log.requests[request_id(ep, episodes)]
            first.append(turns[0])
            after_tool += [
                t for i, t in enumerate(turns[1:], 1) if ep.seen[i - 1].startswith("get ")
            ]
    out["mt_ngram_turns_after_tool"] = len(after_tool)
    out["mt_ngram_tokens_per_verify_after_tool"] = ngram_tokens_per_verify(
        model, tokenizer, cfg, after_tool
    )
    out["target_mt_ngram_tokens_per_verify_after_tool"] = ">= 2.0 (k = 4)"
    out["mt_ngram_tokens_per_verify_other_turns"] = ngram_tokens_per_verify(
        model, tokenizer, cfg, first
    )
    return out


def speed_figures(model, tokenizer, cfg, batches: int = 8) -> dict:
    """Decode idle share and per-turn overhead with 32 episodes in flight and
    ``ENV_LATENCY_S`` in each environment step: ``batches`` batches each served whole, and the
    same problems admitted continuously (8 in flight); the idle share also with latency drawn
    uniformly from 0 to twice it and with none, and the overhead with the environment in two
    worker processes."""
    problems, group = IN_FLIGHT
    runner, wrapped = lookup_runner(model, tokenizer, cfg, latency_s=ENV_LATENCY_S)
    _, by_batch = run(runner, batches, *IN_FLIGHT, seed=10_000)
    overhead = turn_overheads_ms(wrapped, by_batch)
    seeds = [10_000 + 1000 * b + p for b in range(batches) for p in range(problems)]
    streamed: dict[str, Instrumented] = {}
    for name, jitter in (("fixed", None), ("jittered", 1)):
        stream_runner, streamed[name] = lookup_runner(
            model, tokenizer, cfg, latency_s=ENV_LATENCY_S, jitter_seed=jitter
        )
        stream_runner.run_batch(seeds, group, None, lambda g: None, in_flight=problems)
    jittered_runner, jittered = lookup_runner(
        model, tokenizer, cfg, latency_s=ENV_LATENCY_S, jitter_seed=2
    )
    run(jittered_runner, batches, *IN_FLIGHT, seed=10_000)
    quick_runner, quick = lookup_runner(model, tokenizer, cfg)
    _, quick_batches = run(quick_runner, batches, *IN_FLIGHT, seed=20_000)
    quick_overhead = turn_overheads_ms(quick, quick_batches)
    pooled_cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, workers=2))
    pooled = Instrumented(tiny_engine(model, tokenizer, cfg))
    pooled_runner = episode_runner(pooled_cfg, pooled, tokenizer)
    try:
        _, pooled_batches = run(pooled_runner, batches, *IN_FLIGHT, seed=30_000)
    finally:
        pooled_runner.env_pool.close()
    pooled_overhead = turn_overheads_ms(pooled, pooled_batches)
    return {
        "mt_env_latency_s": ENV_LATENCY_S,
        "mt_episodes_in_flight": problems * group,
        "mt_speed_problems": len(seeds),
        "mt_decode_idle_frac": idle_share(streamed["fixed"]),
        "target_mt_decode_idle_frac": "<= 0.10",
        "mt_decode_idle_frac_batch_at_once": idle_share(wrapped),
        "mt_decode_idle_frac_jittered_latency": idle_share(streamed["jittered"]),
        "mt_decode_idle_frac_jittered_latency_batch_at_once": idle_share(jittered),
        "mt_decode_idle_frac_no_latency": idle_share(quick),
        "mt_serve_wall_s": sum(c.wall_s for c in streamed["fixed"].calls),
        "mt_serve_wall_s_batch_at_once": sum(c.wall_s for c in wrapped.calls),
        "mt_serve_wall_s_jittered_latency": sum(c.wall_s for c in streamed["jittered"].calls),
        "mt_turn_overhead_ms_p50": statistics.median(overhead),
        "mt_turn_overhead_ms_p90": float(np.percentile(overhead, 90)),
        "target_mt_turn_overhead_ms_p50": "<= 5",
        "mt_turn_overhead_ms_p50_no_latency": statistics.median(quick_overhead),
        "mt_turn_overhead_ms_p50_workers": statistics.median(pooled_overhead),
        "mt_turns_timed": len(overhead),
    }


def idle_share(wrapped: Instrumented) -> float:
    """The share of the serve calls' wall time with no row to decode."""
    return sum(c.idle_s for c in wrapped.calls) / sum(c.wall_s for c in wrapped.calls)
