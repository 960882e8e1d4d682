"""Learner memory and throughput: the old training step against the new one, and 1 against 2
FSDP2 ranks.

    python -m benchmarks.learner --json benchmarks/results/learner.json [--quick]

Models (random weights, built in memory): ``small`` (the built-in preset of
configs/model/small.yaml: 8 layers, width 192, character vocabulary) and ``vocab32k`` (4 layers,
width 256, a 32,000-token vocabulary). Both paths train on the same batch (rows x length below).

- ``old``: the naive step: fp32 logits [B, S, V] at every position, a full
  ``log_softmax``, the whole batch in one forward/backward, no activation checkpointing.
- ``new``: ``learner.step.Trainer.step`` with log-probs of the chosen tokens at completion
  positions only (chunks of ``logprob_chunk_tokens``), micro-batches of
  ``max_tokens_per_microbatch`` tokens and activation checkpointing (fp32, so the comparison
  isolates the memory plan, not precision).

Peak memory: each configuration runs in a fresh process; peak = the process's peak RSS
(``ru_maxrss``) minus its RSS before the model was built, so it counts weights, gradients, AdamW
state and activations (children run with ``MALLOC_MMAP_THRESHOLD_=131072`` so freed tensors
leave RSS). tokens/s: completion tokens per second of step time, best of the measured
steps; old and new run alternately (cores are shared, so the ratio is the robust figure).

Ranks: ``torch.multiprocessing`` spawns 1 and 2 gloo ranks (FSDP2); per-rank state memory is the
bytes of this rank's parameter, gradient (read just before the optimizer step) and AdamW tensors
(local shards of the DTensors), the largest over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

from benchmarks import cli
from common.config.learner import LearnerConfig
from common.config.run import SamplingConfig
from common.model import Transformer
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from learner.batch import TrainBatch, collate
from learner.loss import ppo_clip_loss
from testing.models import token_logprobs

CHAR_VOCAB = CharTokenizer(BUILTIN_ALPHABET).vocab_size
MODELS = {
    # name: (vocab, hidden, layers, heads, kv heads, intermediate)
    "small": (CHAR_VOCAB, 192, 8, 6, 2, 512),
    "vocab32k": (32_000, 256, 4, 4, 2, 688),
}
# Batch: GROUPS x GROUP_SIZE rows of PROMPT + up to COMPLETION tokens.
GROUPS, GROUP_SIZE, PROMPT, COMPLETION = 8, 8, 32, 96
NEW = dict(max_tokens_per_microbatch=2048, logprob_chunk_tokens=256, activation_checkpointing=True)


def build_model(name: str) -> Transformer:
    vocab, hidden, layers, heads, kv, inter = MODELS[name]
    return cli.random_model(
        vocab, hidden, inter, layers, heads, kv, max_position_embeddings=PROMPT + COMPLETION
    )


def build_batch(vocab: int, groups: int, seed: int = 0) -> TrainBatch:
    out = cli.random_groups(vocab, groups, GROUP_SIZE, PROMPT, COMPLETION, seed, "bench")
    return collate(out, 0, 0, torch.device("cpu"))


def old_step(model: Transformer, optimizer, batch: TrainBatch, cfg: LearnerConfig) -> None:
    """The naive training step the new one is compared with (policy loss; no KL, no early
    exit)."""
    model.train()
    L = model.args.num_hidden_layers
    x = model.model.embed_tokens(batch.input_ids)
    logits = model.head(model.run_layers(x, None, None, 0, L))[:, :-1]  # [B, S-1, V] fp32
    logprobs = token_logprobs(logits, batch.targets, 1.0, 1.0)
    usable = (batch.mask > 0) & torch.isfinite(logprobs)
    out = ppo_clip_loss(
        logprobs.masked_fill(~usable, 0.0),
        batch.behaviour_logprobs,
        batch.advantages,
        usable.float(),
        cfg.clip_eps,
        cfg.dual_clip,
    )
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child_step(model_name: str, path: str, steps: int, groups: int) -> dict:
    """One configuration in this (fresh) process: peak memory and tokens/s."""
    from learner.optim import make_optimizer
    from learner.step import Trainer

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    batch = build_batch(MODELS[model_name][0], groups)
    base = _rss_bytes()
    model = build_model(model_name)
    cfg = LearnerConfig(lr=1e-5, **(NEW if path == "new" else {}))
    optimizer = make_optimizer(model, cfg)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if path == "old":
            old_step(model, optimizer, batch, cfg)
        else:
            Trainer(model, optimizer, cfg, SamplingConfig()).step(batch)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {
        "peak_mem_bytes": peak,
        "tokens_per_s": batch.num_tokens / min(times),
        "step_s": min(times),
        "tokens": batch.num_tokens,
        "rows": int(batch.input_ids.shape[0]),
        "seq_len": int(batch.input_ids.shape[1]),
    }


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def _rank_worker(rank: int, world: int, port: int, model_name: str, out: str, groups: int) -> None:
    from learner.distributed import init_from_env, local_rank_env, shard, shutdown
    from learner.optim import make_optimizer
    from learner.step import Trainer

    os.environ.update(local_rank_env(rank, world, port))
    torch.set_num_threads(1)
    ctx = init_from_env(timeout_s=600) if world > 1 else None
    try:
        model = build_model(model_name)
        module = shard(model) if ctx is not None else model
        cfg = LearnerConfig(lr=1e-5, **NEW)
        optimizer = make_optimizer(module, cfg)
        grads = {"bytes": 0}
        step = optimizer.step

        def measured_step(*a, **kw):
            grads["bytes"] = sum(
                _local_bytes(p.grad) for p in module.parameters() if p.grad is not None
            )
            return step(*a, **kw)

        optimizer.step = measured_step
        batch = build_batch(MODELS[model_name][0], groups)
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            Trainer(module, optimizer, cfg, SamplingConfig(), dist=ctx).step(batch)
            times.append(time.perf_counter() - t0)
        params = sum(_local_bytes(p) for p in module.parameters())
        optim = sum(
            _local_bytes(v) for s in optimizer.state.values() for v in s.values() if v.dim() > 0
        )
        result = {
            "param_bytes": params,
            "grad_bytes": grads["bytes"],
            "optimizer_bytes": optim,
            "state_bytes": params + grads["bytes"] + optim,
            "tokens_per_s": batch.num_tokens / min(times),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        if ctx is not None:
            shutdown()


def child_ranks(model_name: str, world: int, groups: int) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    from ops.redis_server import find_free_port

    with tempfile.TemporaryDirectory() as tmp:
        args = (world, find_free_port(), model_name, tmp, groups)
        mp.spawn(_rank_worker, args=args, nprocs=world)
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    worst = max(per_rank, key=lambda r: r["state_bytes"])
    return {**worst, "tokens_per_s": per_rank[0]["tokens_per_s"], "world": world}


def _run_child(*argv: str) -> dict:
    # Large blocks straight from mmap and back on free, so RSS follows the live tensors instead of
    # glibc's heap high-water mark (same setting for every configuration).
    proc = cli.run_module("benchmarks.learner", "--child", *argv, MALLOC_MMAP_THRESHOLD_="131072")
    if proc.returncode != 0:
        raise RuntimeError(f"child {argv} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def plan_check(name: str, measured: dict) -> dict:
    """``specrl plan``'s estimate (ops/memory_plan.py) for this model and the new settings,
    next to what was measured: state (1 and 2 ranks) and the new path's peak."""
    from ops.memory_plan import Shape, learner_plan

    model = build_model(name)
    shape = Shape.from_hf_config(model.args.to_hf_config())
    out = {}
    for gpus in (1, 2):
        plan = learner_plan(
            shape,
            gpus=gpus,
            precision="fp32",
            max_tokens=NEW["max_tokens_per_microbatch"],
            chunk=NEW["logprob_chunk_tokens"],
            checkpointing=NEW["activation_checkpointing"],
        )
        state = plan["weights"] + plan["gradients"] + plan["optimizer"]
        got = measured[f"ranks_{gpus}"]["state_bytes"]
        out[f"state_{gpus}_rank_plan_over_measured"] = state / got
        if gpus == 1:
            out["peak_plan_bytes"] = plan["total"]
            out["peak_plan_over_measured_new"] = plan["total"] / measured["new"]["peak_mem_bytes"]
    return out


def measure(name: str, quick: bool, groups: int, steps: str) -> dict:
    """Old against new step and 1 against 2 ranks on model ``name``, each in a fresh process."""
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for _ in range(1 if quick else 2):  # alternate old/new: shared cores drift
        for path in ("old", "new"):
            runs[path].append(_run_child("step", name, path, steps, str(groups)))
    old = min(runs["old"], key=lambda r: r["peak_mem_bytes"])
    new = min(runs["new"], key=lambda r: r["peak_mem_bytes"])
    old_tps = max(r["tokens_per_s"] for r in runs["old"])
    new_tps = max(r["tokens_per_s"] for r in runs["new"])
    one = _run_child("ranks", name, "1", str(groups))
    two = _run_child("ranks", name, "2", str(groups))
    vocab, hidden, layers, heads, kv, inter = MODELS[name]
    params = sum(p.numel() for p in build_model(name).parameters())
    measured = {
        "config": dict(
            vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv, mlp=inter
        ),
        "params": params,
        "old": {**old, "tokens_per_s": old_tps},
        "new": {**new, "tokens_per_s": new_tps},
        "peak_mem_new_over_old": new["peak_mem_bytes"] / old["peak_mem_bytes"],
        "tokens_per_s_new_over_old": new_tps / old_tps,
        "ranks_1": one,
        "ranks_2": two,
        "per_rank_state_mem_2_over_1": two["state_bytes"] / one["state_bytes"],
        "tokens_per_s_2_over_1": two["tokens_per_s"] / one["tokens_per_s"],
    }
    measured["plan"] = plan_check(name, measured)
    print(
        f"{name}: peak new/old {measured['peak_mem_new_over_old']:.3f} "
        f"({new['peak_mem_bytes'] / 2**20:.0f} / {old['peak_mem_bytes'] / 2**20:.0f} MiB), "
        f"tokens/s new/old {new_tps / old_tps:.2f}, per-rank state 2/1 "
        f"{measured['per_rank_state_mem_2_over_1']:.3f}",
        flush=True,
    )
    return measured


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="a smaller batch, fewer steps")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument(
        "--plan-only", action="store_true", help="add the plan check to an existing --json file"
    )
    args = parser.parse_args(argv)
    if args.plan_only:
        results = json.loads(args.json.read_text())
        for name, measured in results["models"].items():
            measured["plan"] = plan_check(name, measured)
        cli.write_json(results, args.json)
        return 0
    groups = 2 if args.quick else GROUPS
    if args.child:
        kind, model_name, *rest = args.child
        if kind == "step":
            out = child_step(model_name, rest[0], int(rest[1]), int(rest[2]))
        else:
            out = child_ranks(model_name, int(rest[0]), int(rest[1]))
        print(json.dumps(out))
        return 0
    steps = "2" if args.quick else "3"
    results: dict = {
        "batch": {
            "rows": groups * GROUP_SIZE,
            "prompt_tokens": PROMPT,
            "completion_tokens_max": COMPLETION,
        },
        "new_settings": NEW,
        "models": {},
    }
    for name in MODELS:
        results["models"][name] = measure(name, args.quick, groups, steps)
    results["goals"] = {
        "peak_mem_new_over_old<=0.5": all(
            m["peak_mem_new_over_old"] <= 0.5 for m in results["models"].values()
        ),
        "per_rank_state_mem_2_over_1<=0.6": all(
            m["per_rank_state_mem_2_over_1"] <= 0.6 for m in results["models"].values()
        ),
    }
    cli.write_json(results, args.json)
    print(json.dumps(results["goals"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
