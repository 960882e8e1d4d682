"""Weight sync through Redis: the scaling figures of deltas, async publish and one fetch per
host, then publish and fetch throughput and how long until every reader holds a new version,
for several model sizes and reader counts side by side in one run.

    python benchmarks/weights.py [--quick] [--full] [--json PATH] [--chunk-mb MB]

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

A private redis-server (ops.redis_server.RedisServer, as the tests use) holds the versions;
the learner side is this process, with a real `learner.weight_writer.WeightWriter`. Models are random
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
    flock /tmp/specrl-bench.lock python benchmarks/weights.py --json weights.json
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import statistics
import sys
import time
from pathlib import Path

import redis
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from actors.weight_reader import WeightReader  # noqa: E402
from actors.weight_watcher import VersionWatcher  # noqa: E402
from benchmarks import cli  # noqa: E402
from benchmarks.weight_scaling import GOALS, scaling_figures  # noqa: E402
from common.config.run import RedisConfig  # noqa: E402
from learner.weight_writer import WeightWriter  # noqa: E402
from ops.redis_server import RedisServer  # noqa: E402

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
                deadline = time.monotonic() + TIMEOUT_S
                version = None
                while version is None and time.monotonic() < deadline:
                    version = watcher.poll(timeout_s=1.0)
                if version is None:
                    results.put(("error", index, "no new version within the timeout"))
                    return
                seen = time.monotonic()
                fetched, state_dict = store.fetch(version)
                done = time.monotonic()
                results.put(("fetched", index, fetched, seen, done, nbytes(state_dict)))
                del state_dict
    client.close()


# ------------------------------------------------------------------------------ learner side


class Readers:
    """``count`` reader processes, started once and reused for every configuration."""

    def __init__(self, count: int, url: str) -> None:
        ctx = mp.get_context("spawn")
        self.results: mp.Queue = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(count)]
        self.procs = [
            ctx.Process(target=reader_main, args=(i, url, q, self.results), daemon=True)
            for i, q in enumerate(self.commands)
        ]
        for proc in self.procs:
            proc.start()

    def get(self, kind: str) -> tuple:
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                message = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [p.pid for p in self.procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"reader process(es) {dead} died") from None
                continue
            if message[0] == "error":
                raise RuntimeError(f"reader {message[1]}: {message[2]}")
            assert message[0] == kind, message
            return message
        raise TimeoutError(f"no {kind!r} from the readers within {TIMEOUT_S} s")

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


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
        readers = Readers(max(READERS), server.url)
        try:
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
        finally:
            readers.close()
            client.close()

    print_table(table)

    fetch_100mb = flat["fetch_gbps_per_reader_100mb_r1"]
    summary = {
        **{k: scaling[k] for k in GOALS},
        **cli.target("fetch_gbps_100mb", fetch_100mb, TARGET_FETCH_GBPS_100MB),
        "chunk_bytes": chunk_bytes,
        "quick": opts.quick,
        "seconds": round(time.perf_counter() - started, 1),
        **scaling,
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
    return cli.finish(summary, opts.json)


if __name__ == "__main__":
    sys.exit(main())
