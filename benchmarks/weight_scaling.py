"""benchmarks/weights.py's scaling figures: bytes stored per delta version, the share of a publish
hidden behind training, Redis egress with a host cache, and a verified fetch against a plain read
(see that script's docstring for each figure's definition and goal)."""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import redis
import torch
from omegaconf import OmegaConf

from benchmarks import cli
from common.config.learner import LearnerConfig
from common.config.run import ModelConfig
from common.model import Transformer
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from common.weights.fetch.reader import WeightReader
from common.weights.format import weights_digest
from common.weights.host_cache import HostCache
from common.weights.keys import weights_chunk_key
from common.weights.publish.publisher import Publisher
from common.weights.publish.writer import WeightWriter
from common.weights.store import WeightStore

ROOT = Path(__file__).resolve().parent.parent
GB = 10**9
TIMEOUT_S = 600.0
GOALS = {  # figure -> (goal, "<=" or ">=")
    "delta_bytes_over_full": (0.1, "<="),
    "publish_hidden_frac": (0.9, ">="),
    "egress_over_model_bytes_4_actors": (1.1, "<="),
    "fetch_over_plain_read": (0.8, ">="),
}
SMALL_YAML = ROOT / "configs" / "model" / "small.yaml"
# Used only if configs/model/small.yaml is missing.
SMALL_FALLBACK = {
    "hidden_size": 256,
    "num_layers": 8,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 768,
}
LLM_LR = 1e-6


def built_in_model(fields: dict[str, int]) -> Transformer:
    """A random-weight model of the built-in character vocabulary with these config fields."""
    vocab = CharTokenizer(BUILTIN_ALPHABET).vocab_size
    keys = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")
    return cli.random_model(vocab, *(fields[k] for k in keys))


def small_fields() -> dict[str, int]:
    if not SMALL_YAML.is_file():
        return dict(SMALL_FALLBACK)
    cfg = OmegaConf.load(SMALL_YAML)
    return {key: int(cfg[key]) for key in SMALL_FALLBACK}


def demo_fields() -> dict[str, int]:
    m = ModelConfig()
    return {key: int(getattr(m, key)) for key in SMALL_FALLBACK}


def lm_step(model: Transformer, optimizer: torch.optim.Optimizer, gen: torch.Generator) -> None:
    """One AdamW step of next-token loss on random tokens (batch 8 x 64)."""
    ids = torch.randint(0, model.args.vocab_size, (8, 64), generator=gen)
    logits = model(ids)[:, :-1]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)
    )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def delta_ratio(
    client: redis.Redis, run_id: str, model: Transformer, dtype, lr: float, steps: int
) -> dict[str, float]:
    """Bytes stored per version over a full version's, publishing after each of ``steps``."""
    store = WeightWriter(client, run_id, retention=steps + 2, keyframe_every=10**6)
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    publisher = Publisher(store, model, tokenizer, dtype=dtype, max_inflight=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    publisher.publish(0)
    full = store.last_publish_bytes
    stored, deltas = [], 0
    for version in range(1, steps + 1):
        lm_step(model, optimizer, gen)
        publisher.publish(version)
        stored.append(store.last_publish_bytes)
        deltas += store.manifest(version)["kind"] == "delta"
    # A fresh reader walks keyframe + every delta and must hold the learner's weights exactly.
    _, fetched = WeightReader(client, run_id).fetch(steps)
    assert weights_digest(fetched) == weights_digest(publisher.snapshot())
    client.flushdb()
    return {
        "ratio": statistics.mean(stored) / full,
        "full_bytes": full,
        "delta_versions": deltas,
        "versions": steps,
    }


def hidden_fraction(
    client: redis.Redis, model: Transformer, rounds: int, steps_per_block: int
) -> dict[str, float]:
    """Learner step time without publishing, with synchronous publishing, and with the upload
    in the background on a thread and in a child process (the learner's default)."""
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LLM_LR, weight_decay=0.0)
    gen = torch.Generator().manual_seed(2)
    publishers = {
        mode: Publisher(
            WeightWriter(client, f"bench-hidden-{mode}", retention=3, keyframe_every=10),
            model,
            tokenizer,
            dtype=torch.bfloat16,
            max_inflight=inflight,
            optimizer=optimizer,  # as the learner does: async snapshots run on the thread
            upload=upload,
        )
        for mode, inflight, upload in (
            ("sync", 0, "thread"),
            ("thread", 1, "thread"),
            ("process", 1, "process"),
        )
    }
    times: dict[str, list[float]] = {"off": [], "sync": [], "thread": [], "process": []}
    version = 0
    modes = list(times)
    for round_ in range(rounds):
        # The order of the blocks rotates every round, so no mode always follows another.
        for mode in modes[round_ % len(modes) :] + modes[: round_ % len(modes)]:
            for _ in range(steps_per_block):
                start = time.perf_counter()
                lm_step(model, optimizer, gen)
                if mode != "off":
                    version += 1
                    publishers[mode].publish(version)
                times[mode].append(time.perf_counter() - start)
            if mode in ("thread", "process"):
                publishers[mode].flush()  # untimed: the next block starts with nothing in flight
    upload_s = publishers["sync"].last_publish_s
    for publisher in publishers.values():
        publisher.close()
    client.flushdb()
    med = {mode: statistics.median(t) for mode, t in times.items()}
    stall_sync = med["sync"] - med["off"]
    return {
        "hidden_frac": 1.0 - (med["process"] - med["off"]) / stall_sync,
        "hidden_frac_thread": 1.0 - (med["thread"] - med["off"]) / stall_sync,
        "step_s_off": med["off"],
        "step_s_sync": med["sync"],
        "step_s_thread": med["thread"],
        "step_s_process": med["process"],
        "publish_s": upload_s,
    }


def cache_fetcher(url: str, run_id: str, root: str, version: int, barrier, results) -> None:
    """One actor-like process: fetch ``version`` through the host cache (None: no cache)."""
    torch.set_num_threads(1)
    cache = HostCache(root) if root else None
    store = WeightReader(redis.Redis.from_url(url), run_id, host_cache=cache)
    barrier.wait()
    got, state_dict = store.fetch(version)
    results.put((got, weights_digest(state_dict)))


def egress_of_fetches(url: str, client: redis.Redis, run_id: str, root: str, n: int) -> int:
    version = WeightStore(client, run_id).latest_version()
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n + 1), ctx.Queue()
    procs = [
        ctx.Process(target=cache_fetcher, args=(url, run_id, root, version, barrier, results))
        for _ in range(n)
    ]
    for proc in procs:
        proc.start()
    barrier.wait()  # every process imported torch and connected: count from here
    before = int(client.info("stats")["total_net_output_bytes"])
    digests = {results.get(timeout=TIMEOUT_S) for _ in procs}
    after = int(client.info("stats")["total_net_output_bytes"])
    for proc in procs:
        proc.join(timeout=30)
    assert len(digests) == 1, digests
    return after - before


def egress_figures(url: str, client: redis.Redis, model: Transformer) -> dict[str, float]:
    """Redis egress per version with 4 fetching processes on one host, over the model bytes."""
    run_id = "bench-egress"
    store = WeightWriter(client, run_id, retention=3, keyframe_every=10)
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    publisher = Publisher(store, model, tokenizer, dtype=torch.bfloat16, max_inflight=0)
    publisher.publish(1)
    model_bytes = sum(t.numel() * t.element_size() for t in publisher.snapshot().values())
    with tempfile.TemporaryDirectory(prefix="specrl-bench-shm-", dir=shm_root()) as root:
        shared = egress_of_fetches(url, client, run_id, root, 4)
        private = egress_of_fetches(url, client, run_id, "", 4)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LLM_LR, weight_decay=0.0)
        lm_step(model, optimizer, torch.Generator().manual_seed(3))
        publisher.publish(2)
        assert store.manifest(2)["kind"] == "delta"
        delta = egress_of_fetches(url, client, run_id, root, 4)
    client.flushdb()
    return {
        "shared": shared / model_bytes,
        "private": private / model_bytes,
        "delta": delta / model_bytes,
        "model_bytes": model_bytes,
    }


def shm_root() -> str | None:
    return "/dev/shm" if Path("/dev/shm").is_dir() else None


def fetch_vs_plain(
    client: redis.Redis, state_dict: dict[str, torch.Tensor], chunk_bytes: int, repeats: int
) -> dict[str, float]:
    """Verified fetch against a plain read of the same chunk keys, interleaved."""
    run_id = "bench-plain"
    store = WeightWriter(client, run_id, chunk_bytes=chunk_bytes, retention=1)
    store.publish(1, state_dict)
    manifest = store.manifest(1)
    keys = [weights_chunk_key(run_id, 1, i) for i in range(manifest["num_chunks"])]
    assert client.exists(keys[0]), keys[0]
    size = manifest["total_bytes"]

    def plain_pipelined() -> int:
        got = 0
        for start in range(0, len(keys), 8):
            pipe = client.pipeline(transaction=False)
            for key in keys[start : start + 8]:
                pipe.get(key)
            got += sum(len(v) for v in pipe.execute())
        return got

    def plain_loop() -> int:
        return sum(len(client.get(key)) for key in keys)

    def verified() -> int:
        _, sd = WeightReader(client, run_id, chunk_bytes=chunk_bytes).fetch(1)
        return size if sd else 0

    times: dict[str, list[float]] = {"pipelined": [], "loop": [], "fetch": []}
    runs = {"pipelined": plain_pipelined, "loop": plain_loop, "fetch": verified}
    for _ in range(repeats + 1):
        for name, action in runs.items():
            start = time.perf_counter()
            assert action() == size
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t[1:]) for name, t in times.items()}  # first: warm-up
    plain = min(med["pipelined"], med["loop"])
    client.flushdb()
    return {
        "ratio": plain / med["fetch"],
        "fetch_gbps": size / med["fetch"] / GB,
        "plain_pipelined_gbps": size / med["pipelined"] / GB,
        "plain_loop_gbps": size / med["loop"] / GB,
        "bytes": size,
    }


def scaling_figures(
    url: str,
    client: redis.Redis,
    quick: bool,
    chunk_bytes: int,
    plain: tuple[str, dict[str, torch.Tensor]],
) -> dict[str, float]:
    """The four scaling figures with their goals; ``plain`` is the (label, state dict) of the
    model the verified fetch is compared on."""
    plain_label, plain_model = plain
    steps = 5 if quick else 20
    small = small_fields() if not quick else demo_fields()
    out: dict[str, float] = {}
    d = delta_ratio(
        client, "bench-delta-small", built_in_model(small), torch.bfloat16, LLM_LR, steps
    )
    out |= {
        "delta_bytes_over_full": d["ratio"],
        "delta_full_bytes_small": d["full_bytes"],
        "delta_versions_small": d["delta_versions"],
        "delta_lr": LLM_LR,
        "delta_steps": steps,
    }
    print(f"delta (small, bf16, lr {LLM_LR:g}, {steps} steps): {d}", flush=True)
    demo = demo_fields()
    d = delta_ratio(
        client, "bench-delta-demo", built_in_model(demo), None, LearnerConfig().lr, steps
    )
    out |= {
        "delta_bytes_over_full_demo": d["ratio"],
        "delta_versions_demo": d["delta_versions"],
        "delta_lr_demo": LearnerConfig().lr,
    }
    print(f"delta (demo defaults, fp32, lr {LearnerConfig().lr:g}): {d}", flush=True)
    h = hidden_fraction(client, built_in_model(small), 2 if quick else 12, 3 if quick else 5)
    out |= {"publish_hidden_frac": h["hidden_frac"]} | {
        f"hidden_{k}": v for k, v in h.items() if k != "hidden_frac"
    }
    print(f"publish hidden: {h}", flush=True)
    e = egress_figures(url, client, built_in_model(small))
    out |= {
        "egress_over_model_bytes_4_actors": e["shared"],
        "egress_over_model_bytes_4_actors_no_cache": e["private"],
        "egress_over_model_bytes_4_actors_delta": e["delta"],
        "egress_model_bytes": e["model_bytes"],
    }
    print(f"egress per version, 4 processes on one host: {e}", flush=True)
    f = fetch_vs_plain(client, plain_model, chunk_bytes, 3 if quick else 7)
    out |= {"fetch_over_plain_read": f["ratio"]} | {
        f"plain_{k}": v for k, v in f.items() if k != "ratio"
    }
    print(f"verified fetch vs plain read ({plain_label}): {f}", flush=True)
    for key, (goal, how) in GOALS.items():
        value = out[key]
        out[f"{key}_goal"] = goal
        out[f"{key}_met"] = value <= goal if how == "<=" else value >= goal
    # Ratios and times to 4 decimals; learning rates as they are (1e-6 would round to 0).
    return {
        k: round(v, 4) if isinstance(v, float) and not k.startswith("delta_lr") else v
        for k, v in out.items()
    }
