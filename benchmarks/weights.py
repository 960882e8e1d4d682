"""Weight sync through Redis: the scaling figures of deltas, async publish and one fetch per
host, then publish and fetch throughput and how long until every reader holds a new version,
for several model sizes and reader counts side by side in one run.

    python -m benchmarks.weights [--quick] [--full] [--json PATH] [--chunk-mb MB]

Scaling figures (all in one run, on the same Redis):

  delta_bytes_over_full      mean bytes stored per version as a delta / bytes of a full
                             version, over 20 versions of the ``small`` model
                             (configs/model/small.yaml) trained with AdamW at lr 1e-6 (weight
                             decay 0) on next-token loss over random tokens: fp32 master weights,
                             published in bf16; the delta is computed on the published bf16
                             tensors (goal <= 0.1). ``..._demo``: the tiny demo model at the
                             learner's defaults (fp32, lr 3e-4), reported only.
  publish_hidden_frac        1 - (step time with async publish - step time without publishing)
                             / (step time with synchronous publish - without), on the small
                             model in bf16 with deltas (keyframe every 10), the upload in a
                             child process (the learner's default, learner.publish_upload);
                             ``hidden_frac_thread``: the same with the upload on a thread.
                             Blocks of 5 steps of the four modes interleaved (the order
                             rotating every round), 12 rounds, medians (goal >= 0.9).
  egress_over_model_bytes_4_actors
                             Redis INFO total_net_output_bytes while 4 processes on this host
                             fetch one full version through the host cache, / the version's
                             bytes (goal <= 1.1); without the cache for comparison.
  fetch_over_plain_read      a plain redis-py read of the same chunk keys (the faster of a
                             pipelined and a one-GET-at-a-time loop) takes t_plain; a verified
                             ``WeightReader.fetch`` (checksums, tensors, finite check) takes
                             t_fetch; the ratio of throughputs t_plain / t_fetch, medians of
                             interleaved repeats on the 100mb model (goal >= 0.8).

Delivery figures (one run: a learner publishing while 2 actor processes decode):

  decode_stall_frac_during_delivery
                             each actor process decodes a random-weight model of Qwen2.5-0.5B's
                             shape in bf16 (494M parameters, about 1 GB; a full version's bytes
                             in ``delivery_model_bytes``) with the torch engine (1
                             prompt x 2 completions, plain decoding) and takes new weights from
                             its background weight feed (common/weights/fetch/feed.py: watcher, verified
                             fetch, deltas, the host cache shared by both) between decoding
                             steps, as the actor loop does. Its StallMeter, inside the loop,
                             sums the time the loop spent blocked on weights while a version
                             was being delivered (taking it from the feed, and the engine
                             loading it: the new model, and the delayed verification of the
                             rows in flight at a swap) and the loop's time in those windows; the
                             figure is the larger of the two actors' ratios (goal <= 0.05).
                             ``decode_stall_frac_take_only``: the same without the engine's
                             loads (what take() alone blocked); ``delivery_weight_load_s_mean``:
                             the engine's seconds per version taken (the worse actor).
                             ``delivery_actors``: per actor, the ratio, and its decoding steps
                             per second during deliveries and otherwise (the cores a delivery
                             takes slow the loop down without blocking it).
  skipped_versions_counted   the learner side (this process) changes 2% of the rows of every
                             matrix every 0.5 s and publishes each version through the
                             learner's Publisher (bf16, deltas with a keyframe every 10, upload
                             in a child process, latest wins); uploads take longer than a step,
                             so versions are skipped. True when some were, the publisher counted
                             exactly the versions published but never uploaded, and both actors
                             end on the last uploaded version.
  ``--quick`` runs them on a ~10 MB model, 12 steps back to back (a smoke test).

Collective figure (benchmarks/weights_collective.py, its own run):

  collective_over_redis_delivery_s
                             a random model of Qwen2.5-0.5B's shape in bf16 and 2 actor
                             processes, members of the learner's weights group; each version goes
                             by one path, the paths alternating: time from publish until both
                             actors hold it, collective broadcast (bf16 buckets, sha256 per bucket
                             checked) over the Redis path (WeightWriter.publish, each actor's
                             verified fetch), medians of 3 (goal <= 0.5). Details under
                             ``collective``.

A private redis-server (ops.redis_server.RedisServer, as the tests use) holds the versions;
the learner side is this process, with a real `common.weights.publish.writer.WeightWriter`. Models are random
fp32 tensors shaped like a Llama-style transformer (untied embedding and LM head, per layer
q/k/v/o with grouped KV, a gated MLP and two norms), of about 10 MB, 100 MB and 1 GB
(MB = 10^6 bytes, GB/s = 10^9 bytes/s; the table shows the exact size).

Readers are separate processes (spawn, so no GIL is shared), each with its own Redis client,
WeightReader and VersionWatcher, as actors are: they wait on a `VersionWatcher` for the next
version, then `store.fetch()` it (read, verify every chunk's sha256, build the tensors). For
each model and reader count (1 and 4) one warm-up version and then N versions are published one
after another, the next only once every reader holds the previous one. Per version:

  publish GB/s      model bytes / duration of `store.publish` (serialize, hash, write the
                    chunks, commit, prune the previous version)
  fetch GB/s        model bytes / duration of `store.fetch` in one reader ("per reader" is the
                    mean over readers); "aggregate" = readers x bytes / (last fetch end - first
                    fetch start)
  seen ms           start of publish -> the last reader's watcher reported the version (it is
                    announced at the commit, before publish returns from pruning)
  latency ms        start of publish -> the last reader's fetch returned ("all readers hold it")

The table shows medians over the N versions. retention=1, so Redis holds at most two versions
(1 GB x 4 readers needs ~10 GB of RAM in all; every publish still prunes one version, as in a
steady-state run). The 1 GB model runs only with `--full`; `--quick` publishes fewer versions
and shrinks the scaling figures' runs (a smoke test, not the figures).

Other benchmarks share the cores: run the measured figures under a lock, e.g.
    flock /tmp/specrl-bench.lock python -m benchmarks.weights --json weights.json
"""

from __future__ import annotations

import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis
import torch

from actors.engines.torch_engine import TorchEngine
from benchmarks import cli, weights_collective
from benchmarks._procs import Children
from benchmarks.gpu_check.plan import QWEN25_05B
from benchmarks.weight_scaling import GOALS, scaling_figures, shm_root
from common import metric_names as mn
from common.config.run import RedisConfig
from common.model import Transformer
from common.policy_meta import model_args_from_meta
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from common.weights.fetch.feed import RedisWeightFeed, StallMeter, meter_loads, take
from common.weights.fetch.host_cache import HostCache
from common.weights.fetch.reader import WeightReader
from common.weights.fetch.watcher import VersionWatcher
from common.weights.publish.publisher import Publisher
from common.weights.publish.writer import WeightWriter
from ops.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent

MB = 10**6
GB = 10**9
# label -> (target bytes, hidden size, vocab)
MODELS = {
    "10mb": (10 * MB, 256, 2048),
    "100mb": (100 * MB, 768, 8192),
    "1gb": (1000 * MB, 2048, 32000),
}
READERS = (1, 4)
TARGET_FETCH_GBPS_100MB = 1.0
TIMEOUT_S = 600.0
DELIVERY_SHAPES = {
    "full": QWEN25_05B,
    "quick": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}
"""The delivery run's model: Qwen2.5-0.5B's shape, or ~10 MB with ``--quick``."""
DELIVERY_ACTORS = 2
DELIVERY_STEP_S = {"full": 0.5, "quick": 0.0}  # the learner's step time
DELIVERY_STEPS = {"full": 24, "quick": 12}
DELIVERY_ROWS_CHANGED = 0.02  # share of each matrix's rows a step changes
STALL_GOAL = 0.05


def model_shapes(target_bytes: int, d: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Llama-style tensor shapes whose fp32 size is close to ``target_bytes``."""
    kv = d // 4  # grouped-query attention: 4 query heads per KV head
    ffn = (8 * d // 3 + 63) // 64 * 64
    per_layer = 2 * d * d + 2 * kv * d + 3 * ffn * d + 2 * d
    fixed = 2 * vocab * d + d
    layers = max(1, round((target_bytes / 4 - fixed) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (d, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, d),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (ffn, d),
            p + "mlp.up_proj.weight": (ffn, d),
            p + "mlp.down_proj.weight": (d, ffn),
        }
    shapes |= {"model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    return shapes


def make_model(label: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(shape, generator=generator)
        for name, shape in model_shapes(*MODELS[label]).items()
    }


def nbytes(state_dict: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


# ------------------------------------------------------------------------------ reader side


def next_version(watcher: VersionWatcher) -> int:
    """The next version ``watcher`` reports (it returns None on a lost connection, so poll
    again); TimeoutError after ``TIMEOUT_S``."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        version = watcher.poll(timeout_s=1.0)
        if version is not None:
            return version
    raise TimeoutError(f"no new version within {TIMEOUT_S} s")


def reader_main(index: int, url: str, commands: mp.Queue, results: mp.Queue) -> None:
    """One actor-like reader: per command, follow a run and fetch ``versions`` versions."""
    torch.set_num_threads(1)
    client = redis.Redis.from_url(url)
    while (command := commands.get()) is not None:
        run_id, versions, chunk_bytes = command
        store = WeightReader(client, run_id, chunk_bytes=chunk_bytes)
        with VersionWatcher.of_store(store, poll_interval_s=1.0) as watcher:
            watcher.poll(timeout_s=0.0)  # subscribe now: the first announcement must not be lost
            results.put(("ready", index))
            for _ in range(versions):
                version = next_version(watcher)
                seen = time.monotonic()
                fetched, state_dict = store.fetch(version)
                done = time.monotonic()
                results.put(("fetched", index, fetched, seen, done, nbytes(state_dict)))
                del state_dict
    client.close()


# ------------------------------------------------------------------------------ learner side


class Readers(Children):
    """``count`` reader processes, started once and reused for every configuration, each
    following the commands of its own queue."""

    def __init__(self, count: int, url: str) -> None:
        super().__init__(TIMEOUT_S)
        self.commands: list[mp.Queue] = [self.ctx.Queue() for _ in range(count)]
        for i, q in enumerate(self.commands):
            self.start(reader_main, i, url, q, self.results, name=f"reader {i}")

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        super().close()


def run_config(
    client: redis.Redis,
    readers: Readers,
    label: str,
    state_dict: dict[str, torch.Tensor],
    n_readers: int,
    versions: int,
    chunk_bytes: int,
) -> dict[str, float]:
    run_id = f"bench-{label}-r{n_readers}"
    store = WeightWriter(client, run_id, chunk_bytes=chunk_bytes, retention=1)
    for q in readers.commands[:n_readers]:
        q.put((run_id, versions + 1, chunk_bytes))
    for _ in range(n_readers):
        readers.get("ready")
    size = nbytes(state_dict)
    rows: list[dict[str, float]] = []
    for version in range(versions + 1):  # version 0 warms up (allocators, connections)
        state_dict["version"] = torch.tensor(version)  # each version differs from the last
        start = time.monotonic()
        store.publish(version, state_dict)
        published = time.monotonic()
        fetches = [readers.get("fetched") for _ in range(n_readers)]
        assert all(f[2] == version for f in fetches), fetches
        assert all(f[5] == size + 8 for f in fetches), (fetches, size)
        if version == 0:
            continue
        first_start = min(f[3] for f in fetches)
        last_seen = max(f[3] for f in fetches)
        last_done = max(f[4] for f in fetches)
        rows.append(
            {
                "publish_gbps": size / (published - start) / GB,
                "fetch_gbps_per_reader": statistics.mean(
                    size / (f[4] - f[3]) / GB for f in fetches
                ),
                "fetch_gbps_aggregate": n_readers * size / (last_done - first_start) / GB,
                "seen_ms": (last_seen - start) * 1e3,
                "latency_ms": (last_done - start) * 1e3,
            }
        )
    del state_dict["version"]
    client.flushdb()  # frees Redis before the next configuration
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


# ------------------------------------------------------------------------------ delivery


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
    model.load_state_dict(state, strict=True, assign=True)  # the fetched tensors themselves
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
    publisher = Publisher(
        store,
        model,
        CharTokenizer(BUILTIN_ALPHABET),
        dtype=torch.bfloat16,
        max_inflight=1,
        upload="process",
        latest_wins=True,
        on_published=uploaded.append,
    )
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
    published = steps + 1
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


def print_table(table: list[tuple[str, int, int, dict[str, float]]]) -> None:
    """The Markdown table of (model, bytes, readers, medians) rows."""
    print()
    header = ["model", "readers", "publish GB/s", "fetch GB/s per reader"]
    header += [
        "fetch GB/s aggregate",
        "seen ms",
        "latency ms (publish start -> all readers hold it)",
    ]
    rows = [
        [f"{label} ({size / MB:.1f} MB)", n, f"{f['publish_gbps']:.2f}"]
        + [f"{f['fetch_gbps_per_reader']:.2f}", f"{f['fetch_gbps_aggregate']:.2f}"]
        + [f"{f['seen_ms']:.1f}", f"{f['latency_ms']:.0f}"]
        for label, size, n, f in table
    ]
    print(cli.table(header, rows))


def main() -> int:
    parser = cli.parser(__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="fewer versions and shorter scaling runs (smoke test)"
    )
    parser.add_argument("--full", action="store_true", help="also the 1 GB model in the table")
    parser.add_argument(
        "--chunk-mb",
        type=float,
        default=RedisConfig().chunk_bytes / 2**20,
        help="WeightStore chunk size in MiB (default: redis.chunk_bytes of the config)",
    )
    parser.add_argument("--versions", type=int, default=0, help="timed versions per config")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    labels = list(MODELS) if opts.full else ["10mb", "100mb"]
    chunk_bytes = int(opts.chunk_mb * 2**20)

    flat: dict[str, float] = {}
    table: list[tuple[str, int, int, dict[str, float]]] = []
    with RedisServer(password="specrl-bench") as server:
        client = redis.Redis.from_url(server.url)
        plain = ("100mb", make_model("100mb"))
        scaling = scaling_figures(server.url, client, opts.quick, chunk_bytes, plain)
        del plain
        delivery = delivery_figures(server.url, client, opts.quick)
        shown = {k: v for k, v in delivery.items() if k != "delivery_actors"}
        print("delivery: " + ", ".join(f"{k} {v}" for k, v in shown.items()), flush=True)
        with Readers(max(READERS), server.url) as readers:
            for label in labels:
                state_dict = make_model(label)
                size = nbytes(state_dict)
                versions = opts.versions or (3 if opts.quick or label == "1gb" else 5)
                for n in READERS:
                    figures = run_config(
                        client, readers, label, state_dict, n, versions, chunk_bytes
                    )
                    table.append((label, size, n, figures))
                    for key, value in figures.items():
                        flat[f"{key}_{label}_r{n}"] = round(value, 3)
                    print(
                        f"{label} ({size / MB:.1f} MB) x {n} reader(s): "
                        + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()),
                        flush=True,
                    )
                del state_dict
        client.close()

    print_table(table)
    # The collective byte path against the Redis path, side by side on one model and 2 actors.
    collective = weights_collective.figures(versions=2 if opts.quick else 3, quick=opts.quick)
    print(
        "collective: "
        + ", ".join(f"{k} {v}" for k, v in collective.items() if not isinstance(v, list)),
        flush=True,
    )

    fetch_100mb = flat["fetch_gbps_per_reader_100mb_r1"]
    summary = {
        **{k: scaling[k] for k in GOALS},
        "decode_stall_frac_during_delivery": delivery["decode_stall_frac_during_delivery"],
        "skipped_versions_counted": delivery["skipped_versions_counted"],
        "collective_over_redis_delivery_s": collective["collective_over_redis_delivery_s"],
        "collective": collective,
        **cli.target("fetch_gbps_100mb", fetch_100mb, TARGET_FETCH_GBPS_100MB),
        "chunk_bytes": chunk_bytes,
        "quick": opts.quick,
        "seconds": round(time.perf_counter() - started, 1),
        **scaling,
        **delivery,
        **flat,
    }
    print(
        f"\nfetch_gbps_100mb = {fetch_100mb:.2f} GB/s (target >= {TARGET_FETCH_GBPS_100MB}), "
        f"chunks of {chunk_bytes / 2**20:g} MiB, {summary['seconds']} s"
    )
    for key, (goal, how) in GOALS.items():
        print(
            f"{key} = {scaling[key]:.4g} (goal {how} {goal}): {'met' if scaling[key + '_met'] else 'NOT met'}"
        )
    stall = delivery["decode_stall_frac_during_delivery"]
    print(
        f"decode_stall_frac_during_delivery = {stall:.4g} (goal <= {STALL_GOAL}): "
        f"{'met' if delivery['decode_stall_met'] else 'NOT met'}; take() alone "
        f"{delivery['decode_stall_frac_take_only']:.4g}, the engine's load "
        f"{delivery['delivery_weight_load_s_mean']:.3g} s per version"
    )
    print(f"skipped_versions_counted = {delivery['skipped_versions_counted']}")
    ratio = collective["collective_over_redis_delivery_s"]
    print(
        f"collective_over_redis_delivery_s = {ratio:.3g} (goal <= "
        f"{collective['target_collective_over_redis_delivery_s']}): "
        f"{'met' if collective['collective_target_met'] else 'NOT met'}"
    )
    return cli.finish(summary, opts.json)


if __name__ == "__main__":
    sys.exit(main())
