"""Weight sync through Redis: the scaling figures of deltas, async publish and one fetch per
host, then publish and fetch throughput and how long until every reader holds a new version,
for several model sizes and reader counts side by side in one run.

    python -m benchmarks.weights [--quick] [--full] [--stages-only] [--json PATH] [--chunk-mb MB]

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

Publish stages (benchmarks/publish_stages.py, first in the run; ``--stages-only``: these alone):

  publish_stage_gbps         GB/s of bf16 state through each stage of a version on this machine
                             (cast fp32 -> bf16, the 2-rank gloo streamed gather, the copy into
                             the shared-memory slot, finite check, digest, serialise, the Redis
                             write with chunk hashes), on a 256 MB bf16 state, medians of 3.
  publish_7b_projected_s_redis
                             Qwen2.5-7B (15.2 GB bf16) on a 4-GPU learner through Redis from
                             those rates: the stages run one after another, so the sum of
                             15.2 GB / rate (the cast a quarter each, on 4 ranks at once);
                             details under ``publish_stages_redis``.
  publish_7b_projected_s     the node-local path (benchmarks/node_stages.py): the finite check,
                             the digest and the write of the version's file into /dev/shm,
                             each timed per core here and projected on 16 cores, plus the copy
                             into the slot; the formula and the cores beside it in
                             ``publish_7b_projected_formula``; goal <= 5 s.

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
import statistics
import sys
import time
from pathlib import Path

import redis
import torch

from benchmarks import cli, weights_collective
from benchmarks._procs import ChildFailed, Children
from benchmarks.node_stages import node_figures
from benchmarks.publish_stages import stage_figures
from benchmarks.weight_delivery import STALL_GOAL, TIMEOUT_S, delivery_figures, next_version
from benchmarks.weight_scaling import GOALS, scaling_figures
from common.config.run import RedisConfig
from common.weights.fetch.reader import WeightReader
from common.weights.fetch.watcher import VersionWatcher
from common.weights.publish.writer import WeightWriter
from ops.redis_server import RedisServer
from testing.shapes import shape, tensor_shapes

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


def model_shapes(target_bytes: int, d: int, vocab: int) -> dict[str, tuple[int, ...]]:
    """Llama-style tensor shapes whose fp32 size is close to ``target_bytes``."""
    kv = d // 4  # grouped-query attention: 4 query heads per KV head
    ffn = (8 * d // 3 + 63) // 64 * 64
    per_layer = 2 * d * d + 2 * kv * d + 3 * ffn * d + 2 * d
    fixed = 2 * vocab * d + d
    layers = max(1, round((target_bytes / 4 - fixed) / per_layer))
    return tensor_shapes(shape(vocab, d, ffn, layers, 4, 1, head_dim=kv, tie_word_embeddings=False))


def make_model(label: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(shape, generator=generator)
        for name, shape in model_shapes(*MODELS[label]).items()
    }


def nbytes(state_dict: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state_dict.values())


# ------------------------------------------------------------------------------ reader side


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


def reader_table(url: str, client, labels: list[str], opts, chunk_bytes: int):
    """Every model size x reader count of READERS: the flat figures and the table's rows."""
    flat: dict[str, float] = {}
    table: list[tuple[str, int, int, dict[str, float]]] = []
    with Readers(max(READERS), url) as readers:
        for label in labels:
            state_dict = make_model(label)
            size = nbytes(state_dict)
            versions = opts.versions or (3 if opts.quick or label == "1gb" else 5)
            for n in READERS:
                figures = run_config(client, readers, label, state_dict, n, versions, chunk_bytes)
                table.append((label, size, n, figures))
                for key, value in figures.items():
                    flat[f"{key}_{label}_r{n}"] = round(value, 3)
                print(
                    f"{label} ({size / MB:.1f} MB) x {n} reader(s): "
                    + ", ".join(f"{k} {v:.3g}" for k, v in figures.items()),
                    flush=True,
                )
            del state_dict
    return flat, table


def print_goals(summary: dict, scaling: dict, delivery: dict, collective: dict) -> None:
    """The headline figures against their goals."""
    fetch_100mb, chunk_bytes = summary["fetch_gbps_100mb"], summary["chunk_bytes"]
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
    if ratio is None:
        print(f"collective_over_redis_delivery_s: not measured ({collective['error']})")
        return
    print(
        f"collective_over_redis_delivery_s = {ratio:.3g} (goal <= "
        f"{collective['target_collective_over_redis_delivery_s']}): "
        f"{'met' if collective['collective_target_met'] else 'NOT met'}"
    )


def collective_figures(quick: bool) -> dict:
    """``weights_collective.figures``; where its run fails (a version not delivered), the
    failure instead of the figure, so the other figures of the run are still written."""
    try:
        return weights_collective.figures(versions=2 if quick else 3, quick=quick)
    except (AssertionError, TimeoutError, ChildFailed) as e:
        log_line = str(e).splitlines()[0][:500]
        print(f"collective run failed: {log_line}", flush=True)
        return {"collective_over_redis_delivery_s": None, "error": log_line}


def publish_figures(url: str) -> dict:
    """The publish stages of both paths and their Qwen2.5-7B projections: the node-local
    path's at the top level, the Redis path's under ``publish_stages_redis``."""
    stages = stage_figures(url)
    return {**node_figures(stages), "publish_stages_redis": stages}


def print_stages(figures: dict) -> None:
    """Each publish stage's rate and the projected seconds per version for Qwen2.5-7B."""
    stages = figures["publish_stages_redis"]
    projected = stages["publish_7b_projected_stage_s"]
    for stage, gbps in stages["publish_stage_gbps"].items():
        print(f"publish stage {stage}: {gbps} GB/s, 7B via Redis: {projected.get(stage, '-')} s")
    node = figures["publish_7b_projected_node_stage_s"]
    per_core = figures["node_stage_gbps_per_core"]
    for stage, gbps in figures["node_stage_gbps_wall"].items():
        print(f"node-local stage {stage}: {gbps} GB/s, per core {per_core.get(stage, '-')}")
    print(
        f"publish_7b_projected_s = {figures['publish_7b_projected_s']} (node-local, goal <= "
        f"{stages['publish_7b_projected_goal_s']}, {figures['publish_7b_projected_cores']} "
        f"cores: {node}): {'met' if figures['publish_7b_projected_met'] else 'NOT met'}; "
        f"publish_7b_projected_s_redis = {figures['publish_7b_projected_s_redis']}",
        flush=True,
    )


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
    parser.add_argument(
        "--stages-only", action="store_true", help="only the publish stages and their projection"
    )
    opts = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    if opts.stages_only:
        with RedisServer(password="specrl-bench") as server:
            stages = publish_figures(server.url)
        print_stages(stages)
        return cli.finish(stages, opts.json, started)
    labels = list(MODELS) if opts.full else ["10mb", "100mb"]
    chunk_bytes = int(opts.chunk_mb * 2**20)

    with RedisServer(password="specrl-bench") as server:
        stages = publish_figures(server.url)
        print_stages(stages)
        client = redis.Redis.from_url(server.url)
        plain = ("100mb", make_model("100mb"))
        scaling = scaling_figures(server.url, client, opts.quick, chunk_bytes, plain)
        del plain
        delivery = delivery_figures(server.url, client, opts.quick)
        shown = {k: v for k, v in delivery.items() if k != "delivery_actors"}
        print("delivery: " + ", ".join(f"{k} {v}" for k, v in shown.items()), flush=True)
        flat, table = reader_table(server.url, client, labels, opts, chunk_bytes)
        client.close()

    print_table(table)
    # The collective byte path against the Redis path, side by side on one model and 2 actors.
    collective = collective_figures(opts.quick)
    print(
        "collective: "
        + ", ".join(f"{k} {v}" for k, v in collective.items() if not isinstance(v, list)),
        flush=True,
    )

    fetch_100mb = flat["fetch_gbps_per_reader_100mb_r1"]
    summary = {
        "publish_7b_projected_s": stages["publish_7b_projected_s"],
        "publish_7b_projected_s_redis": stages["publish_7b_projected_s_redis"],
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
        **stages,
    }
    print_goals(summary, scaling, delivery, collective)
    return cli.finish(summary, opts.json)


if __name__ == "__main__":
    sys.exit(main())
