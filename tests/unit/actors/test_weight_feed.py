"""The actor's weight feed against a real Redis: versions are fetched and verified on the feed's
thread while the engine keeps decoding, the swap comes once the weights are in memory, failures
keep the old weights, a newer version replaces a ready one, and close joins the thread; the stall
meter counts only blocked time during deliveries, the engine's loads and in-flight verification
included."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import redis
import torch

from actors.engines.torch.engine import TorchEngine
from actors.exporter import ActorExporter
from actors.loop import ActorPhases, ActorStats
from common import metric_names as mn
from common.config import load_config
from common.tasks import task_from_config
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from common.weights.fetch.feed import RedisWeightFeed, StallMeter, meter_loads, take
from common.weights.fetch.reader import WeightReader
from common.weights.fetch.watcher import VersionWatcher
from common.weights.keys import weights_chunk_key
from common.weights.publish.writer import WeightWriter
from testing.models import random_model
from testing.prometheus import scrape
from testing.transport import wait_until

RUN = "feed-run"
VOCAB = 32
NO_EOS = 99  # outside the vocabulary: every row decodes its whole budget


class ScriptedReader(WeightReader):
    """A real reader whose fetches can be slowed down or made to fail first; it records when
    each fetch started and ended."""

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        super().__init__(client, run_id, chunk_bytes=4096)
        self.delay_s = 0.0
        self.raise_first: list[BaseException] = []  # raised by the next fetches, in order
        self.started: list[int | None] = []
        self.fetched: list[tuple[int, float, float]] = []  # (version, start, end)

    def fetch(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        begun = time.perf_counter()
        self.started.append(version)
        time.sleep(self.delay_s)
        if self.raise_first:
            raise self.raise_first.pop(0)
        got = super().fetch(version)
        self.fetched.append((got[0], begun, time.perf_counter()))
        return got


def state(seed: int) -> dict[str, torch.Tensor]:
    return random_model(VOCAB, seed=seed).state_dict()


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def writer(redis_client: redis.Redis) -> WeightWriter:
    store = WeightWriter(redis_client, RUN, chunk_bytes=4096)
    store.publish(1, state(1))
    return store


@contextmanager
def running_feed(client: redis.Redis) -> Iterator[tuple[ScriptedReader, RedisWeightFeed]]:
    """A feed on version 1 (what the engine holds), with a quick fallback poll of ``latest``;
    closed with its watcher on the way out (closing twice is harmless)."""
    reader = ScriptedReader(client, RUN)
    watcher = VersionWatcher.of_store(reader, last_seen=1, poll_interval_s=0.05)
    feed = RedisWeightFeed(reader, watcher, current=1, poll_s=0.05)
    try:
        yield reader, feed
    finally:
        feed.close()
        watcher.close()


def test_generate_keeps_decoding_while_a_slow_fetch_runs_and_swaps_after_it(
    redis_client: redis.Redis, writer: WeightWriter
) -> None:
    engine = TorchEngine(random_model(VOCAB, seed=1), NO_EOS, 0, version=1)
    meter = StallMeter()
    polls: list[float] = []
    swaps: list[float] = []
    last = []
    with running_feed(redis_client) as (reader, feed):
        reader.delay_s = 1.0  # the fetch of version 2 takes at least a second

        def source():
            polls.append(time.perf_counter())
            update = take(feed, meter)
            if update is not None:
                swaps.append(time.perf_counter())
            return update

        publish = threading.Timer(0.2, writer.publish, args=(2, state(2)))
        publish.start()
        deadline = time.monotonic() + 30.0
        try:
            with meter.running(feed):
                while engine.version < 2 and time.monotonic() < deadline:
                    last = engine.generate([[1, 2, 3]], 2, 24, weight_source=source)[0]
        finally:
            publish.join()
    [(version, started, ended)] = reader.fetched
    assert version == 2 and engine.version == 2
    during = [t for t in polls if started < t < ended]
    assert len(during) >= 10, "the engine stopped decoding while the version was fetched"
    assert len(swaps) == 1 and swaps[0] >= ended  # swapped once the weights were in memory
    assert any(2 in r.token_versions for r in last)
    # The meter saw the delivery, and the loop was almost never blocked during it.
    assert meter.loop_s >= 0.5 * (ended - started)
    assert meter.frac < 0.05, meter.figures()


def test_a_refused_version_keeps_the_weights_and_the_next_good_one_arrives(
    redis_client: redis.Redis, writer: WeightWriter
) -> None:
    writer.publish(2, state(2))
    chunk = bytearray(redis_client.get(weights_chunk_key(RUN, 2, 0)))
    chunk[-1] ^= 0xFF  # the checksum no longer matches
    redis_client.set(weights_chunk_key(RUN, 2, 0), bytes(chunk))
    with running_feed(redis_client) as (reader, feed):
        wait_until(lambda: feed.stats()[mn.ACTOR_WEIGHT_FETCH_FAILURES] >= 1)
        assert reader.started[0] == 2 and reader.fetched == []
        assert feed.poll() is None  # nothing to swap in: the engine keeps version 1
        writer.publish(3, state(3))
        update = feed.wait(timeout_s=5.0)
        assert update is not None and update[0] == 3 and same(update[1], state(3))


def test_redis_away_during_a_fetch_is_retried(
    redis_client: redis.Redis, writer: WeightWriter
) -> None:
    with running_feed(redis_client) as (reader, feed):
        reader.raise_first = [redis.ConnectionError("Redis went away")]
        writer.publish(2, state(2))
        update = feed.wait(timeout_s=5.0)
        assert update is not None and update[0] == 2 and same(update[1], state(2))
        assert feed.stats()[mn.ACTOR_WEIGHT_FETCH_FAILURES] == 1
        assert reader.started == [2, 2]


def test_a_newer_version_replaces_one_not_taken_yet(
    redis_client: redis.Redis, writer: WeightWriter
) -> None:
    with running_feed(redis_client) as (reader, feed):
        writer.publish(2, state(2))
        wait_until(lambda: [v for v, _, _ in reader.fetched] == [2])
        writer.publish(3, state(3))
        wait_until(lambda: [v for v, _, _ in reader.fetched] == [2, 3])
        wait_until(lambda: not feed.delivering)
        update = feed.poll()
        assert update is not None and update[0] == 3 and same(update[1], state(3))
        assert feed.stats()[mn.ACTOR_WEIGHT_SUPERSEDED] == 1
        assert feed.poll() is None


def test_an_unexpected_error_is_raised_on_the_loop_and_close_joins_the_thread(
    redis_client: redis.Redis, writer: WeightWriter
) -> None:
    with running_feed(redis_client) as (reader, feed):
        reader.raise_first = [RuntimeError("a bug in the fetch")]
        writer.publish(2, state(2))
        with pytest.raises(RuntimeError, match="a bug in the fetch"):
            feed.wait(timeout_s=5.0)
        feed.close()
        feed.watcher.close()
        assert "weight-feed" not in {t.name for t in threading.enumerate()}


def test_close_waits_for_the_fetch_in_progress_and_joins(
    redis_client: redis.Redis, writer: WeightWriter
) -> None:
    with running_feed(redis_client) as (reader, feed):
        reader.delay_s = 0.5
        writer.publish(2, state(2))
        wait_until(lambda: reader.started == [2])
        assert feed.delivering
        feed.close()
        feed.watcher.close()
        assert [v for v, _, _ in reader.fetched] == [2]  # finished, then stopped
        assert "weight-feed" not in {t.name for t in threading.enumerate()}
        assert not feed.delivering


def test_stall_meter_counts_blocked_time_during_deliveries_only() -> None:
    now = [0.0]
    meter = StallMeter(clock=lambda: now[0])
    feed = SimpleNamespace(delivering=False)

    def blocked(start: float, end: float) -> None:
        now[0] = start
        with meter.blocked(feed):  # type: ignore[arg-type]
            now[0] = end

    blocked(0.0, 0.5)  # outside the loop: never counted
    feed.delivering = True
    blocked(0.5, 0.9)
    feed.delivering = False
    now[0] = 1.0
    with meter.running(feed):  # type: ignore[arg-type]
        blocked(2.0, 2.1)  # no delivery: not counted
        now[0] = 2.5
        feed.delivering = True  # a delivery starts during this decoding stretch
        blocked(3.0, 3.5)  # 2.1 -> 3.0 decoding, 3.0 -> 3.5 blocked
        now[0] = 4.0
        feed.delivering = False  # it ends during this stretch
        blocked(4.5, 4.6)  # 3.5 -> 4.5 decoding (counted), 4.5 -> 4.6 not
        now[0] = 6.0
    assert meter.loop_s == pytest.approx(0.9 + 0.5 + 1.0)
    assert meter.stall_s == pytest.approx(0.5)
    assert meter.frac == pytest.approx(0.5 / 2.4)
    figures = meter.figures()
    assert figures[mn.ACTOR_DECODE_STALL_S] == pytest.approx(0.5)
    assert figures[mn.ACTOR_DECODE_S_DURING_DELIVERY] == pytest.approx(2.4)


class SlowSwapEngine(TorchEngine):
    """A real torch engine whose load between calls, and delayed verification of the rows in
    flight at a swap (its swapper's), each take at least ``SLOW_S`` (a weight copy to an
    accelerator, a long verification forward)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        verify = self.swapper.verify

        def slow_verify(rows, old_models, bonus):
            time.sleep(SLOW_S)
            return verify(rows, old_models, bonus)

        self.swapper.verify = slow_verify  # type: ignore[method-assign]

    def load_weights(self, version, state_dict) -> None:
        time.sleep(SLOW_S)
        super().load_weights(version, state_dict)


SLOW_S = 0.2


def test_the_stall_meter_counts_the_engines_load_and_inflight_verification(
    redis_client: redis.Redis, writer: WeightWriter, tmp_path
) -> None:
    cfg = load_config(["actor.metrics_port=-1"])
    engine = SlowSwapEngine(random_model(VOCAB, seed=1), NO_EOS, 0, version=1)
    with running_feed(redis_client) as (reader, feed):
        meter = StallMeter()
        phases = ActorPhases(  # the actor loop's phases, as run() builds them
            cfg,
            engine,
            feed,
            meter,
            ActorStats(),
            ActorExporter.start(cfg, tmp_path, "a"),
            task_from_config(cfg.task),
            lambda text: [1, 2, 3],
            random.Random(0),
            CharTokenizer(BUILTIN_ALPHABET),
            None,
            "a",
            lambda: False,  # type: ignore[arg-type]
            reader,
        )

        def ready(version: int) -> None:
            writer.publish(version, state(version))
            wait_until(lambda: [v for v, _, _ in reader.fetched][-1:] == [version])
            wait_until(lambda: not feed.delivering)  # held ready: taking it is instant

        # Phase 1 between batches: take() is instant, the engine's load is not.
        ready(2)
        with meter.running(feed):
            phases.sync_weights()
        assert engine.version == 2
        assert meter.load_s >= SLOW_S, meter.figures()
        # Nothing was being delivered: the load is all the meter counted, as blocked.
        assert meter.stall_s == meter.loop_s == pytest.approx(meter.load_s)
        # Mid-generate: the swap's delayed verification of the rows in flight blocks decoding.
        ready(3)
        load_s, stall_s = meter.load_s, meter.stall_s
        with meter.running(feed):
            engine.generate([[1, 2, 3]], 2, 8, weight_source=phases.weight_source)
        assert engine.version == 3
        assert engine.stats()[mn.VERIFY_INFLIGHT_TOKENS] > 0  # it did verify rows in flight
        assert meter.load_s - load_s >= SLOW_S, meter.figures()
        assert meter.stall_s - stall_s >= SLOW_S, meter.figures()
        figures = meter.figures()
        assert figures[mn.ACTOR_WEIGHT_LOAD_S] == meter.load_s
        assert figures[mn.ACTOR_DECODE_STALL_FRAC] > 0.5  # no fetch ran: the loads are the windows
        assert reader.stats()[mn.ACTOR_HOST_CACHE_REFUSED] == 0


def test_a_nested_load_counts_once_and_loads_outside_the_loop_count_only_as_load() -> None:
    now = [0.0]
    meter = StallMeter(clock=lambda: now[0])
    feed = SimpleNamespace(delivering=False)
    with meter.loading(feed):  # type: ignore[arg-type]  # the first version: no loop yet
        now[0] = 1.0
    assert (meter.load_s, meter.stall_s, meter.loop_s) == (1.0, 0.0, 0.0)
    with meter.running(feed):  # type: ignore[arg-type]
        now[0] = 2.0
        with meter.loading(feed):  # type: ignore[arg-type]  # vLLM's swap calls load_weights
            now[0] = 2.5
            with meter.loading(feed):  # type: ignore[arg-type]
                now[0] = 3.0
            now[0] = 3.5
        now[0] = 5.0
    assert meter.load_s == pytest.approx(2.5)
    assert meter.stall_s == pytest.approx(1.5) and meter.loop_s == pytest.approx(1.5)


def test_meter_loads_refuses_an_engine_it_cannot_meter() -> None:
    with pytest.raises(TypeError, match="_swap"):
        meter_loads(SimpleNamespace(load_weights=print), StallMeter(), SimpleNamespace())


def test_the_stall_and_feed_figures_reach_the_actor_exporter(tmp_path) -> None:
    cfg = load_config(["actor.metrics_port=0"])
    meter = StallMeter()
    meter.stall_s, meter.loop_s = 0.25, 10.0
    feed_stats = {
        mn.ACTOR_WEIGHT_FETCH_S: 1.5,
        mn.ACTOR_WEIGHT_FETCH_FAILURES: 2,
        mn.ACTOR_WEIGHT_SUPERSEDED: 1,
    }
    with ActorExporter.start(cfg, tmp_path, "a") as exporter:
        exporter.update({**meter.figures(), **feed_stats}, version=3)
        m = scrape(exporter.port)
    me = (("actor_id", "a"),)
    assert m[("specrl_actor_decode_stall_frac", me)] == pytest.approx(0.025)
    assert m[("specrl_actor_decode_stall_seconds_total", me)] == pytest.approx(0.25)
    assert m[("specrl_actor_decode_seconds_during_delivery_total", me)] == pytest.approx(10.0)
    assert m[("specrl_actor_weight_fetch_failures_total", me)] == 2
    assert m[("specrl_actor_weight_versions_superseded_total", me)] == 1
