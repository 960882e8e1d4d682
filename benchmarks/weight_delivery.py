"""The weight plane under load, for benchmarks/weights.py: a learner publishing a version every
step while actor processes decode, each counting how long its decoding stalled for the
versions it took in (take from the feed, the engine's load, the in-flight verification)."""

from __future__ import annotations

import multiprocessing as mp
import random
import tempfile
import time

import redis
import torch

from actors.engines.torch.engine import TorchEngine
from benchmarks import cli
from benchmarks._procs import Children
from benchmarks.weight_scaling import shm_root
from common import metric_names as mn
from common.model import Transformer
from common.model_args import with_tied_head
from common.policy_meta import model_args_from_meta
from common.weights.fetch.feed import RedisWeightFeed, StallMeter, meter_loads, take
from common.weights.fetch.reader import WeightReader
from common.weights.fetch.watcher import VersionWatcher
from common.weights.host_cache import HostCache
from common.weights.publish.writer import WeightWriter
from testing.publishing import bf16_publisher
from testing.shapes import QWEN25_05B, shape

TIMEOUT_S = 600.0


def next_version(watcher: VersionWatcher) -> int:
    """The next version ``watcher`` reports (it returns None on a lost connection, so poll
    again); TimeoutError after ``TIMEOUT_S``."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        version = watcher.poll(timeout_s=1.0)
        if version is not None:
            return version
    raise TimeoutError(f"no new version within {TIMEOUT_S} s")


DELIVERY_SHAPES = {
    "full": QWEN25_05B,
    "quick": shape(4096, 256, 768, 4, 4, 2, tie_word_embeddings=True),
}
"""The delivery run's model: Qwen2.5-0.5B's shape, or ~10 MB with ``--quick``."""
DELIVERY_ACTORS = 2
DELIVERY_STEP_S = {"full": 0.5, "quick": 0.0}  # the learner's step time
DELIVERY_STEPS = {"full": 24, "quick": 12}
DELIVERY_ROWS_CHANGED = 0.02  # share of each matrix's rows a step changes
STALL_GOAL = 0.05


class _Stopped(Exception):
    """Raised from the weight source to leave a generate call when the run ends."""


def delivery_actor(
    index: int, url: str, run_id: str, cache_root: str, results: mp.Queue, holds, stop
) -> None:
    """One actor-like process: an engine on the first version, then decoding batch after batch
    with new weights taken from a background feed between steps; the meter's figures at the end.
    ``holds[index]`` is the version its engine holds."""
    torch.set_num_threads(1)
    client = redis.Redis.from_url(url)
    store = WeightReader(client, run_id, host_cache=HostCache(cache_root))
    watcher = VersionWatcher.of_store(store, poll_interval_s=0.5)
    version, state = store.fetch(next_version(watcher))
    args = model_args_from_meta(store.manifest(version)["meta"])
    with torch.device("meta"):
        model = Transformer(args)
    # The fetched tensors themselves (a version leaves a tied LM head out: it is the embedding).
    model.load_state_dict(with_tied_head(state, args), strict=True, assign=True)
    model.tie_weights()
    engine = TorchEngine(model.eval(), eos_id=args.vocab_size, pad_id=0, version=version)
    holds[index] = version
    feed = RedisWeightFeed(store, watcher, version)
    meter = StallMeter()
    meter_loads(engine, meter, feed)  # the engine's loads and in-flight verification, as the actor
    rng = random.Random(index)
    # Polls of the feed (between decoding steps, and between batches), versions taken, tokens.
    counts = {"polls": 0, "polls_during_delivery": 0, "versions_taken": 0, "tokens": 0}

    def poll():
        counts["polls"] += 1
        counts["polls_during_delivery"] += feed.delivering
        update = take(feed, meter)
        if update is not None:
            counts["versions_taken"] += 1
            holds[index] = update[0]
        return update

    def weight_source():
        if stop.is_set():
            raise _Stopped
        return poll()

    results.put(("ready", index))
    loop_started = time.perf_counter()
    try:
        with meter.running(feed):
            while not stop.is_set():
                update = poll()  # between batches, as the actor's phase 1
                if update is not None:
                    engine.load_weights(*update)
                prompt = [rng.randrange(args.vocab_size) for _ in range(8)]
                out = engine.generate([prompt], 2, 16, weight_source=weight_source)
                counts["tokens"] += sum(len(r.token_ids) for r in out[0])
    except _Stopped:
        pass
    finally:
        feed.close()
        watcher.close()
    # Decoding steps per second while versions were delivered and otherwise: what a delivery's
    # share of the cores costs the loop, beside the time it blocks it.
    loop_s = time.perf_counter() - loop_started
    during = meter.loop_s
    steps_otherwise = counts["polls"] - counts["polls_during_delivery"]
    rates = {
        "steps_per_s_during_delivery": counts["polls_during_delivery"] / during if during else 0.0,
        "steps_per_s_otherwise": steps_otherwise / (loop_s - during) if loop_s > during else 0.0,
    }
    results.put(("done", index, {**meter.figures(), **feed.stats(), **counts, **rates}))
    client.close()


def learner_step(model: Transformer, gen: torch.Generator) -> None:
    """Change ``DELIVERY_ROWS_CHANGED`` of the rows of every matrix (a sparse update, so most
    versions go out as deltas)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                rows = max(1, int(p.shape[0] * DELIVERY_ROWS_CHANGED))
                index = torch.randint(0, p.shape[0], (rows,), generator=gen)
                p[index] += 1e-2


def delivery_figures(url: str, client: redis.Redis, quick: bool) -> dict:
    """The learner publishing a version every ``DELIVERY_STEP_S`` while ``DELIVERY_ACTORS``
    processes decode: each actor's stall figures and the publisher's skipped versions."""
    mode = "quick" if quick else "full"
    run_id = "bench-delivery"
    model = cli.random_model(dtype=torch.bfloat16, **DELIVERY_SHAPES[mode])
    store = WeightWriter(client, run_id, keyframe_every=10, retention=3)
    uploaded: list[int] = []
    publisher = bf16_publisher(store, model, latest_wins=True, on_published=uploaded.append)
    publisher.publish(1)
    publisher.flush()
    model_bytes = store.manifest(1)["total_bytes"]
    steps = DELIVERY_STEPS[mode]
    try:
        with (
            tempfile.TemporaryDirectory(prefix="specrl-bench-shm-", dir=shm_root()) as root,
            Children(TIMEOUT_S, join_s=60.0) as children,
        ):
            holds = children.ctx.Array("i", [-1] * DELIVERY_ACTORS)
            for i in range(DELIVERY_ACTORS):
                args = (i, url, run_id, root, children.results, holds, children.stop)
                children.start(delivery_actor, *args, name=f"delivery actor {i}")
            children.each("ready")
            gen = torch.Generator().manual_seed(1)
            started = time.perf_counter()
            for version in range(2, steps + 2):
                learner_step(model, gen)
                publisher.publish(version)  # never waits for the upload (latest wins)
                next_step = started + (version - 1) * DELIVERY_STEP_S[mode]
                time.sleep(max(0.0, next_step - time.perf_counter()))
            publisher.flush()
            final = uploaded[-1]
            deadline = time.monotonic() + TIMEOUT_S
            while min(holds[:]) < final and time.monotonic() < deadline:
                time.sleep(0.1)
            held = list(holds[:])
            children.stop.set()
            actors = [message[2] for message in children.each("done")]
    finally:
        publisher.close()
    client.flushdb()
    return _figures(actors, publisher, uploaded, held, steps + 1, mode, model_bytes)


def _figures(actors, publisher, uploaded, held, published, mode, model_bytes) -> dict:
    """The delivery's figures from each actor's stall figures and the publisher's counts."""
    final = uploaded[-1]
    skipped = publisher.skipped
    counted = skipped == published - len(uploaded) - publisher.refused
    fracs = [a[mn.ACTOR_DECODE_STALL_FRAC] for a in actors]
    delivered = all(a[mn.ACTOR_DECODE_S_DURING_DELIVERY] > 0 for a in actors)
    # Every load ran inside the meter's loop (the first version's is not metered): the part of
    # the stall that is not loading is the time take() blocked.
    take_fracs = (
        [
            (a[mn.ACTOR_DECODE_STALL_S] - a[mn.ACTOR_WEIGHT_LOAD_S])
            / a[mn.ACTOR_DECODE_S_DURING_DELIVERY]
            for a in actors
        ]
        if delivered
        else [float("nan")]
    )
    load_s = [a[mn.ACTOR_WEIGHT_LOAD_S] / max(a["versions_taken"], 1) for a in actors]
    return {
        "decode_stall_frac_during_delivery": max(fracs) if delivered else float("nan"),
        "decode_stall_counts": "take from the feed + engine load + in-flight verification",
        "decode_stall_frac_take_only": max(take_fracs),
        "delivery_weight_load_s_mean": max(load_s),
        "decode_stall_goal": STALL_GOAL,
        "decode_stall_met": delivered and max(fracs) <= STALL_GOAL,
        "skipped_versions_counted": skipped > 0 and counted and min(held) == final,
        "delivery_model": mode,
        "delivery_model_bytes": model_bytes,
        "delivery_versions_published": published,
        "delivery_versions_uploaded": len(uploaded),
        "delivery_versions_skipped": skipped,
        "delivery_final_version": final,
        "delivery_actor_versions": held,
        "delivery_upload_s_last": publisher.last_publish_s,
        "delivery_actors": actors,
    }
