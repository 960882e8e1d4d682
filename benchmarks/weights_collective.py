"""Weights delivery over the learner's weights group against Redis, side by side in one run.

    python -m benchmarks.weights_collective [--json PATH] [--versions N] [--bucket-mb MB] [--quick]

A random model of Qwen2.5-0.5B's shape (494 M parameters, tied embedding, bf16: 988 MB) goes to
2 actor processes (spawn) by both paths, one version after another, alternating:

  redis_delivery_s        start of ``WeightWriter.publish`` -> both actors hold the version: each
                          follows a ``VersionWatcher`` and ``WeightReader.fetch``es it (chunks
                          read and checked, tensors built, finite check); no host cache, so each
                          actor reads its own copy, as actors on separate hosts do
  collective_delivery_s   start of ``CollectiveSender.send`` -> both actors' ``CollectiveFeed``
                          hand the version out: packed (a copy into one payload), finite-checked,
                          broadcast in buckets over gloo on loopback, every bucket hashed on
                          both sides, the collective manifest written to and read from Redis,
                          the layout and digests checked
  collective_over_redis_delivery_s
                          the ratio of the two medians (goal <= 0.5: ``collective_target_met``)
  *_bytes_per_s           the version's bytes / its delivery time (each actor receives all of
                          them, at the same time)
  collective_broadcast_s  the sender's last version: header to manifest written
  sha256_bytes_per_s      sha256 on one core here (what each side spends per byte on checks)

One warm-up version per path, then ``--versions`` timed versions per path (medians). A private
redis-server (ops.redis_server.RedisServer) holds the versions (retention 1). ``--quick``: a
small model, a smoke test, not the figures. The actors' process function, ``actor_main``, is
also what tests/integration/test_weights_group.py runs.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import os
import queue
import signal
import statistics
import time
from typing import Any

import redis
import torch

from benchmarks import cli
from common.config.run import RedisConfig
from common.weights.collective import bucket_sha256
from common.weights.fetch.collective_feed import CollectiveFeed
from common.weights.fetch.reader import WeightReader
from common.weights.fetch.watcher import VersionWatcher
from common.weights.format import weights_digest
from common.weights.publish.collective_sender import CollectiveSender
from common.weights.publish.writer import WeightWriter
from ops.redis_server import RedisServer, find_free_port
from testing.shapes import QWEN25_05B, shape, tensor_shapes

QUICK = shape(4096, 256, 768, 2, 4, 2, tie_word_embeddings=True, attention_bias=True)
"""``--quick``'s model: small, laid out as Qwen2 is (q/k/v biases, a tied embedding)."""
GOAL = 0.5
ACTORS = 2
TIMEOUT_S = 600.0


def random_state(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded random bf16 tensors of these shapes (drawn in bf16 directly: no fp32 copy)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        name: torch.empty(shape, dtype=torch.bfloat16).uniform_(-0.05, 0.05, generator=generator)
        for name, shape in shapes.items()
    }


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ------------------------------------------------------------------------------- actor side


def actor_main(
    index: int,
    url: str,
    run_id: str,
    address: str | None,
    options: dict[str, Any],
    commands: mp.Queue,
    results: mp.Queue,
) -> None:
    """One actor: a ``CollectiveFeed`` (group at ``address``, or Redis only where None) and,
    with ``options["redis_path"]``, a plain ``VersionWatcher`` + ``WeightReader`` beside it.
    Reports ``("held", index, version, path, monotonic time, digest, group stats)`` for every
    version it gets (``digest``: ``weights_digest`` of the state with ``options["digest"]``);
    answers ``"stats"`` with ``("stats", index, group stats)`` (``CollectiveFeed.group_stats``);
    stops on None. ``options["log_level"]``: the feed's log level on stderr (default WARNING);
    SIGUSR1 dumps every thread's stack to stderr (what :meth:`Actors.get` asks for when the
    actors say nothing in time)."""
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    logging.basicConfig(
        level=options.get("log_level", "WARNING"),
        format=f"actor {index} %(asctime)s %(name)s: %(message)s",
    )
    client = redis.Redis.from_url(url)
    feed = CollectiveFeed(
        WeightReader(client, run_id),
        address,
        join_timeout_s=options.get("join_timeout_s", 10.0),
        rejoin_s=options.get("rejoin_s", 10.0),
        timeout_s=options.get("timeout_s", 60.0),
        idle_timeout_s=options.get("idle_timeout_s", 30.0),
        poll_interval_s=0.2,
    )
    plain = WeightReader(client, run_id) if options.get("redis_path") else None
    watcher = VersionWatcher.of_store(plain, poll_interval_s=0.2) if plain is not None else None
    if watcher is not None:
        watcher.poll(timeout_s=0.0)  # subscribed now: the first announcement is not lost

    def report(version: int, state: dict[str, torch.Tensor], path: str) -> None:
        held = time.monotonic()
        digest = weights_digest(state) if options.get("digest") else ""
        results.put(("held", index, version, path, held, digest, feed.group_stats()))

    results.put(("started", index))
    try:
        while True:
            try:
                command = commands.get_nowait()
            except queue.Empty:
                command = ""
            if command is None:
                break
            if command == "stats":
                results.put(("stats", index, feed.group_stats()))
            if watcher is not None and plain is not None:
                version = watcher.poll(timeout_s=0.0)
                if version is not None:
                    report(*plain.fetch(version), "redis")
            got = feed.wait(0.002)
            if got is not None:
                report(*got, "feed")
    finally:
        if watcher is not None:
            watcher.close()
        feed.close()
        client.close()


class Actors:
    """Actor processes running :func:`actor_main`."""

    def __init__(
        self,
        count: int,
        url: str,
        run_id: str,
        addresses: list[str | None],
        options: dict[str, Any],
    ) -> None:
        ctx = mp.get_context("spawn")
        self.results: mp.Queue = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(count)]
        self.procs = [
            ctx.Process(
                target=actor_main,
                args=(i, url, run_id, addresses[i], options, q, self.results),
                daemon=True,
            )
            for i, q in enumerate(self.commands)
        ]
        self.killed: set[int] = set()
        for proc in self.procs:
            proc.start()
        for _ in range(count):
            self.get("started")

    def get(self, kind: str, timeout_s: float = TIMEOUT_S) -> tuple:
        """The next message of ``kind`` (others of kind ``held`` may not come first)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                message = self.results.get(timeout=0.5)
            except queue.Empty:
                dead = [
                    p.pid
                    for i, p in enumerate(self.procs)
                    if i not in self.killed and not p.is_alive() and p.exitcode
                ]
                if dead:
                    raise RuntimeError(f"actor process(es) {dead} died") from None
                continue
            if message[0] != kind:
                raise AssertionError(f"expected {kind!r}, got {message}")
            return message
        self._dump_stacks()
        raise TimeoutError(f"no {kind!r} from the actors within {timeout_s} s")

    def _dump_stacks(self) -> None:
        """Every live actor's threads' stacks to stderr (where the test's report shows them)."""
        for i, proc in enumerate(self.procs):
            if i not in self.killed and proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)

    def kill(self, index: int) -> None:
        """SIGKILL actor ``index`` (it leaves no goodbye)."""
        self.killed.add(index)
        self.procs[index].kill()
        self.procs[index].join(timeout=10)

    def stats(self, index: int) -> dict[str, float]:
        self.commands[index].put("stats")
        return self.get("stats")[2]

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=15)
            if proc.is_alive():
                proc.kill()


def wait_members(sender: CollectiveSender, members: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sender.members < members:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{members} actor(s) did not join the weights group")
        time.sleep(0.05)


# ----------------------------------------------------------------------------- the learner


def sha256_rate(nbytes: int = 256 * 2**20) -> float:
    """Bytes/s of sha256 on one core here (what each side spends per byte checking buckets)."""
    data = torch.ones(nbytes, dtype=torch.uint8)
    started = time.perf_counter()
    bucket_sha256(data)
    return nbytes / (time.perf_counter() - started)


def figures(versions: int = 3, bucket_mb: float = 256.0, quick: bool = False) -> dict[str, Any]:
    """Delivery times of both paths (medians of ``versions`` versions each, after one warm-up
    version each) and their ratio."""
    shapes = tensor_shapes(QUICK if quick else QWEN25_05B)
    state = random_state(shapes)
    size = nbytes(state)
    bucket_bytes = int(bucket_mb * 2**20)
    run_id = "bench-collective"
    times: dict[str, list[float]] = {"redis": [], "feed": []}
    with RedisServer(password="specrl-bench") as server:
        client = redis.Redis.from_url(server.url)
        writer = WeightWriter(client, run_id, chunk_bytes=RedisConfig().chunk_bytes, retention=1)
        address = f"127.0.0.1:{find_free_port()}"
        sender = CollectiveSender(client, run_id, address, bucket_bytes=bucket_bytes)
        actors = Actors(ACTORS, server.url, run_id, [address] * ACTORS, {"redis_path": True})
        try:
            wait_members(sender, ACTORS)
            deadline = time.monotonic() + 60
            for i in range(ACTORS):  # members on their side too: no Redis fetch by the feeds
                while not actors.stats(i)["member"]:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"actor {i} is not a member of the weights group")
                    time.sleep(0.05)
            version = 0
            for round_ in range(versions + 1):  # round 0 warms up
                for path in ("redis", "feed"):
                    version += 1
                    start = time.monotonic()
                    if path == "redis":
                        writer.publish(version, state, snapshot=False)
                    else:
                        sender.send(version, state)
                    held = [actors.get("held") for _ in range(ACTORS)]
                    if any(h[2] != version or h[3] != path for h in held):
                        raise AssertionError(f"{path} version {version}: actors report {held}")
                    if round_:
                        times[path].append(max(h[4] for h in held) - start)
            send_s = sender.last_send_s
        finally:
            actors.close()
            sender.close()
            client.close()
    redis_s = statistics.median(times["redis"])
    collective_s = statistics.median(times["feed"])
    ratio = collective_s / redis_s
    return {
        "model": "Qwen2.5-0.5B shape (random, bf16)" if not quick else "quick (small, bf16)",
        "model_bytes": size,
        "actors": ACTORS,
        "bucket_bytes": bucket_bytes,
        "versions": versions,
        "collective_over_redis_delivery_s": round(ratio, 3),
        "target_collective_over_redis_delivery_s": GOAL,
        "collective_target_met": ratio <= GOAL,
        "redis_delivery_s": round(redis_s, 3),
        "collective_delivery_s": round(collective_s, 3),
        "redis_bytes_per_s": round(size / redis_s),
        "collective_bytes_per_s": round(size / collective_s),
        "collective_broadcast_s": round(send_s, 3),
        "sha256_bytes_per_s": round(sha256_rate()),
        "redis_delivery_s_each": [round(t, 3) for t in times["redis"]],
        "collective_delivery_s_each": [round(t, 3) for t in times["feed"]],
    }


def main() -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--versions", type=int, default=3, help="timed versions per path")
    parser.add_argument("--bucket-mb", type=float, default=256.0, help="bucket size in MiB")
    parser.add_argument("--quick", action="store_true", help="a small model (smoke test)")
    opts = parser.parse_args()
    if opts.versions < 1 or opts.bucket_mb <= 0:
        parser.error("--versions must be >= 1 and --bucket-mb > 0")
    torch.set_num_threads(1)
    started = time.perf_counter()
    result = figures(opts.versions, opts.bucket_mb, opts.quick)
    for key, value in result.items():
        print(f"{key}: {value}")
    return cli.finish(result, opts.json, started)


if __name__ == "__main__":
    raise SystemExit(main())
