"""``specrl plan``: memory per GPU of the learner and of an actor, estimated from an HF config.

Learner: :func:`common.config.memory_fit.learner_plan`, the estimate the learner itself checks at
start (``learner.profile``); its docstring gives the formulas. ``--memory-gib M`` also prints
the settings ``learner.profile=auto`` picks on devices of M GiB, or why nothing fits.

Actor: weights in the serving dtype plus the KV cache (2 x layers x kv heads x head dim x bytes
x sequence length x concurrent sequences; an upper bound for models with sliding-window layers).
The plan also names the rollout engines that run the model: both for the built-in layouts
(Llama, Qwen2, Qwen3), ``engine=vllm`` alone for any other ``transformers`` causal LM.

Any architecture's ``config.json`` with the usual keys (vocab_size, hidden_size,
intermediate_size, num_hidden_layers, num_attention_heads; num_key_value_heads, head_dim
optional): per-layer norms beyond two, such as Gemma 3's and OLMo 2's, are left out (under 1%
of the parameters).

Estimates, not guarantees: allocator caching, CUDA context (~0.5-1 GiB), NCCL buffers and
fragmentation come on top. ``benchmarks/learner.py`` checks the estimate against CPU
measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.config import SpecRLConfig
from common.config.memory_fit import FitError, GiB, Shape, Workload, choose, describe, learner_plan
from common.config.modes import ENGINE_NAMES, PRECISIONS
from common.model_args import HFLayout, layout_from_hf_config

__all__ = ["Shape", "actor_plan", "learner_plan", "main"]


def actor_plan(
    shape: Shape, seq_len: int = 4096, sequences: int = 64, dtype_bytes: int = 2
) -> dict[str, float]:
    weights = shape.params() * dtype_bytes
    kv = 2 * shape.layers * shape.kv_heads * shape.head_dim * dtype_bytes * seq_len * sequences
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


def read_config(path: Path) -> dict:
    """``config.json`` with the defaults of its architecture filled in by ``transformers``
    (``save_pretrained`` leaves out values equal to them, such as Gemma 3's tied LM head); as
    written when ``transformers`` does not know its ``model_type``."""
    raw = json.loads(path.read_text())
    model_type = raw.get("model_type")
    if not isinstance(model_type, str):
        return raw
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return raw
    return {**raw, **CONFIG_MAPPING[model_type].from_dict(raw).to_dict()}


def read_shape(config: dict, where: str) -> Shape:
    """The shape of the model that ``config`` (read from ``where``) describes."""
    try:
        return Shape.from_hf_config(config)
    except KeyError as e:
        raise ValueError(
            f"{where} has no {e.args[0]!r}: `specrl plan` reads a transformers causal LM's "
            "config.json (vocab_size, hidden_size, intermediate_size, num_hidden_layers, "
            "num_attention_heads)"
        ) from None


def rollout_engines(config: dict) -> dict[str, object]:
    """The engines whose actors run this model, and why the others cannot (empty if none)."""
    try:
        layout = layout_from_hf_config(config)
    except ValueError as e:
        return {"engines": [], "refused": str(e)}
    if isinstance(layout, HFLayout):
        return {"engines": ["vllm"], "refused": f"engine=torch: {layout.reason}"}
    return {"engines": list(ENGINE_NAMES), "refused": ""}


def _fmt(n: float) -> str:
    return f"{n / GiB:9.2f} GiB"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specrl plan",
        description="Estimated memory per GPU of the learner and of an actor for an HF model.",
    )
    parser.add_argument("model", type=Path, help="a model directory or its config.json")
    parser.add_argument("--gpus", type=int, default=1, help="learner ranks (FSDP2)")
    parser.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    parser.add_argument(
        "--max-tokens", type=int, default=8192, help="learner.max_tokens_per_microbatch"
    )
    parser.add_argument("--chunk", type=int, default=1024, help="learner.logprob_chunk_tokens")
    parser.add_argument(
        "--no-checkpointing", action="store_true", help="learner.activation_checkpointing=false"
    )
    parser.add_argument(
        "--kl", action="store_true", help="learner.kl_coef > 0: a reference replica per GPU"
    )
    parser.add_argument("--actor-seq-len", type=int, default=4096, help="prompt + completion")
    parser.add_argument("--actor-sequences", type=int, default=64, help="concurrent sequences")
    parser.add_argument("--actor-dtype-bytes", type=int, default=2, help="2: bf16, 1: fp8")
    parser.add_argument(
        "--memory-gib",
        type=float,
        default=0.0,
        help="also print what learner.profile=auto picks on --gpus devices of this many GiB "
        "(the learner's other settings at their defaults)",
    )
    parser.add_argument(
        "--max-seq-tokens", type=int, default=0, help="learner.max_seq_tokens (for --memory-gib)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    path = args.model / "config.json" if args.model.is_dir() else args.model
    config = read_config(path)
    try:
        shape = read_shape(config, str(path))
    except ValueError as e:
        print(f"specrl plan: {e}", file=sys.stderr)
        return 1
    engines = rollout_engines(config)
    learner = learner_plan(
        shape,
        args.gpus,
        args.precision,
        args.max_tokens,
        args.chunk,
        not args.no_checkpointing,
        args.kl,
    )
    actor = actor_plan(shape, args.actor_seq_len, args.actor_sequences, args.actor_dtype_bytes)
    fit = _auto_fit(shape, args, str(args.model)) if args.memory_gib > 0 else None
    if args.json:
        print(
            json.dumps(
                {"learner": learner, "actor": actor, "auto": fit, "rollout": engines}, indent=2
            )
        )
        return 0
    print(f"model: {path}  ({shape.params() / 1e9:.2f}B parameters)")
    names = ", ".join(f"engine={e}" for e in engines["engines"]) or "none"
    print(f"rollout engines: {names}" + (f"  ({engines['refused']})" if engines["refused"] else ""))
    print(
        f"learner per GPU ({args.gpus} GPU(s), {args.precision}, {args.max_tokens} tokens/"
        f"micro-batch, chunk {args.chunk}, checkpointing {not args.no_checkpointing}):"
    )
    for key in ("weights", "gradients", "optimizer", "fsdp_gathered", "reference", "activations"):
        print(f"  {key:<16}{_fmt(learner[key])}")
    print(f"  {'lm_head_chunk':<16}{_fmt(learner['lm_head_chunk'])}")
    print(f"  {'total':<16}{_fmt(learner['total'])}")
    print(
        f"actor per GPU ({args.actor_sequences} sequences x {args.actor_seq_len} tokens, "
        f"{args.actor_dtype_bytes}-byte weights and KV):"
    )
    for key in ("weights", "kv_cache", "total"):
        print(f"  {key:<16}{_fmt(actor[key])}")
    if fit is not None:
        print(f"learner.profile=auto on {args.gpus} device(s) of {args.memory_gib:g} GiB:")
        print(f"  {fit['overrides'] or fit['refused']}")
        if fit["overrides"]:
            print(f"  needs {fit['needs']}")
    print("(estimates: add ~1 GiB for the CUDA context and allocator slack)")
    return 0


def _auto_fit(shape: Shape, args: argparse.Namespace, model: str) -> dict[str, str]:
    """What the learner's start-up check picks for this model on ``--gpus`` devices of
    ``--memory-gib`` (the run's other settings at their defaults), or its refusal."""
    cfg = SpecRLConfig()
    cfg.learner.max_seq_tokens = args.max_seq_tokens
    work = Workload.of(cfg, shape, args.gpus)
    try:
        fit = choose(shape, work, cfg.learner, args.memory_gib * GiB, "--memory-gib", model)
    except FitError as e:
        return {"overrides": "", "needs": "", "refused": str(e)}
    return {"overrides": fit.profile.overrides(), "needs": describe(fit.plan), "refused": ""}
