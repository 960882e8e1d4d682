"""Rollout speed of plain vs self-speculative decoding, side by side in one process.

    python benchmarks/rollout.py [--quick] [--json PATH] [--device cpu|cuda]

Models:
  demo    the built-in task's tiny model after an RL run with spec=early_exit (so the early exit
          is co-trained); trained here with `specrl run` unless cached under runs/bench/.
  medium  a 20-50M-parameter model of the same architecture, trained briefly on the task with an
          early-exit loss (LayerSkip-style), so both drafts have something to agree with.

For every model, method and batch size the same prompt set is generated twice: a warm-up epoch
(which also gives the n-gram drafter earlier completions of each prompt, as a multi-epoch RL
run would) and a timed epoch; the timed epoch is repeated and the median taken. `lossless` is
true only if, in this same run, every method's complete sampled sequences passed a chi-square
test against the exact plain sampling distribution (tiny-vocabulary model, enumerated outputs).
Batch = rows per generate call: 1 = one prompt x 1 sample, otherwise prompts x 8 samples (GRPO).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from actors.engines.torch_engine import TorchEngine  # noqa: E402
from actors.lossless_check import peaky_model, sequence_pvalue  # noqa: E402
from common.config import SpecConfig, load_config  # noqa: E402
from common.model import ModelArgs, Transformer, load_pretrained  # noqa: E402
from common.tasks import task_from_config  # noqa: E402
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer, encode_prompt, load_tokenizer  # noqa: E402
from common.warm_start import supervised_batch  # noqa: E402
from learner.checkpoint import latest_checkpoint  # noqa: E402

BATCHES = (1, 8, 32)
GROUP = 8


def methods_for(num_layers: int) -> dict[str, SpecConfig]:
    exit_layer = max(1, num_layers // 4)
    return {
        "none": SpecConfig(method="none"),
        "early_exit": SpecConfig(method="early_exit", k=4, exit_layer=exit_layer),
        "ngram": SpecConfig(method="ngram", k=8),
    }


@dataclass
class Figure:
    tokens_per_s: float
    acceptance: float
    mean_len: float


def demo_model(steps: int) -> Path:
    """The RL-trained demo model: the newest checkpoint of a cached `specrl run`."""
    run_dir = ROOT / "runs" / "bench" / f"demo-rl-{steps}"
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is not None and ckpt.name.endswith(f"{steps:08d}"):
        return ckpt
    print(f"training the demo model: specrl run spec=early_exit run.steps={steps} ...", flush=True)
    cmd = [
        sys.executable,
        "-m",
        "common.cli",
        "run",
        f"run.name=bench-demo-{steps}",
        f"run.dir={run_dir}",
        f"run.steps={steps}",
        "spec=early_exit",
        "learner.resume=false",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None, f"no checkpoint in {run_dir}"
    return ckpt


def medium_model(steps: int, device: torch.device) -> Transformer:
    """~25M parameters, trained on the task with CE on the full model and on its early exit."""
    cfg = load_config([])
    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    task = task_from_config(cfg.task)
    torch.manual_seed(0)
    args = ModelArgs(
        vocab_size=tokenizer.vocab_size,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = Transformer(args).to(device)
    exit_layer = methods_for(args.num_hidden_layers)["early_exit"].exit_layer
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
    rng = random.Random(0)
    for _ in range(steps):
        ids, mask = supervised_batch(task, tokenizer, rng, 32)
        ids, mask = ids.to(device), mask.to(device)
        h_exit = model.run_layers(model.model.embed_tokens(ids), None, None, 0, exit_layer)
        h_full = model.run_layers(h_exit, None, None, exit_layer, args.num_hidden_layers)
        loss = 0.0
        for h in (h_full, h_exit):
            logits = model.head(h)[:, :-1]
            nll = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
            ).view_as(mask)
            loss = loss + (nll * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model.eval()


def measure(
    model: Transformer,
    prompts: list[list[int]],
    spec: SpecConfig,
    batch: int,
    max_new: int,
    repeats: int,
    eos_id: int,
    pad_id: int,
) -> Figure:
    n = 1 if batch == 1 else GROUP
    per = max(1, batch // n)
    chunks = [prompts[i : i + per] for i in range(0, len(prompts), per)]
    engine = TorchEngine(model, eos_id, pad_id, temperature=1.0, seed=0, spec=spec)
    for chunk in chunks:  # warm-up epoch: kernels, and earlier completions for history drafts
        engine.generate(chunk, n, max_new)
    engine.stats()
    speeds, accept, length = [], [], []
    for _ in range(repeats):
        for chunk in chunks:
            engine.generate(chunk, n, max_new)
        stats = engine.stats()
        speeds.append(stats["actor/tokens_per_s"])
        accept.append(stats.get("spec/acceptance_rate", float("nan")))
        length.append(stats.get("spec/mean_accepted_len", float("nan")))
    return Figure(statistics.median(speeds), statistics.median(accept), statistics.median(length))


def lossless_check(quick: bool) -> tuple[bool, dict[str, float]]:
    """Every method's sampled sequences against the exact plain distribution (chi-square)."""
    model = peaky_model(vocab=6, seed=1, scale=8.0, layers=4)
    pvalues = {}
    for name, spec in methods_for(model.args.num_hidden_layers).items():
        for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
            engine = TorchEngine(model, 2, 0, temperature, top_p, seed=7, spec=spec)
            p = sequence_pvalue(engine, [1, 4, 5, 4], 3, 2000 if quick else 6000)
            pvalues[f"pvalue_{name}_t{temperature}_p{top_p}"] = p
    return all(p > 1e-3 for p in pvalues.values()), pvalues


def run_model(
    label: str,
    model: Transformer,
    prompts: list[list[int]],
    max_new: int,
    repeats: int,
    eos_id: int,
    pad_id: int,
    batches: tuple[int, ...],
) -> dict[str, float]:
    methods = methods_for(model.args.num_hidden_layers)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(
        f"\n### {label} model ({params:.1f}M parameters, {model.args.num_hidden_layers} layers)\n"
    )
    print("| batch | method | tokens/s | vs none | acceptance | mean accepted len |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    flat: dict[str, float] = {}
    for batch in batches:
        figures = {
            name: measure(model, prompts, spec, batch, max_new, repeats, eos_id, pad_id)
            for name, spec in methods.items()
        }
        base = figures["none"].tokens_per_s
        for name, f in figures.items():
            spec = methods[name]
            shown = (
                f"{name} (k={spec.k}"
                + (f", exit {spec.exit_layer}" if name == "early_exit" else "")
                + ")"
            )
            shown = "none" if name == "none" else shown
            acc = "–" if name == "none" else f"{f.acceptance:.2f}"
            mlen = "–" if name == "none" else f"{f.mean_len:.2f}"
            print(
                f"| {batch} | {shown} | {f.tokens_per_s:,.0f} | {f.tokens_per_s / base:.2f}x | {acc} | {mlen} |"
            )
            flat[f"{label}_{name}_b{batch}_tokens_per_s"] = round(f.tokens_per_s, 1)
            flat[f"{label}_{name}_b{batch}_speedup"] = round(f.tokens_per_s / base, 3)
            if name != "none":
                flat[f"{label}_{name}_b{batch}_acceptance"] = round(f.acceptance, 3)
                flat[f"{label}_{name}_b{batch}_mean_accepted_len"] = round(f.mean_len, 3)
    return flat


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small prompt set, short RL run, no medium model training (< 60 s)",
    )
    parser.add_argument("--json", type=Path, help="write flat figures here")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--demo-steps",
        type=int,
        default=0,
        help="RL steps of the demo model (default 400, quick 150)",
    )
    opts = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(opts.device)
    started = time.perf_counter()
    quick = opts.quick
    demo_steps = opts.demo_steps or (150 if quick else 400)

    lossless, pvalues = lossless_check(quick)
    print(
        f"lossless (chi-square, every method, T=1 and T=0.7/top-p 0.9): {lossless}  min p = {min(pvalues.values()):.3g}"
    )

    ckpt = demo_model(demo_steps)
    model = load_pretrained(ckpt, device=device).eval()
    tokenizer = load_tokenizer(ckpt)
    task = task_from_config(load_config([]).task)
    problems = task.sample(random.Random(1), 32 if quick else 128)
    prompts = [encode_prompt(tokenizer, p.prompt) for p in problems]
    repeats = 1 if quick else 3
    flat = run_model(
        "demo",
        model,
        prompts,
        task.max_new_tokens,
        repeats,
        tokenizer.eos_id,
        tokenizer.pad_id,
        BATCHES,
    )

    if not quick:
        medium = medium_model(150, device)
        flat.update(
            run_model(
                "medium",
                medium,
                prompts[:32],
                task.max_new_tokens,
                1,
                tokenizer.eos_id,
                tokenizer.pad_id,
                BATCHES,
            )
        )

    best = max(
        (
            k
            for k in flat
            if k.startswith("demo_") and k.endswith("_b8_speedup") and "_none_" not in k
        ),
        key=flat.get,
    )
    summary = {
        "speedup_best_b8": flat[best],
        "best_method_b8": best.removeprefix("demo_").removesuffix("_b8_speedup"),
        "lossless": lossless,
        "min_pvalue": min(pvalues.values()),
        "demo_rl_steps": demo_steps,
        "device": str(device),
        "quick": quick,
        "seconds": round(time.perf_counter() - started, 1),
        **pvalues,
        **flat,
    }
    print(
        f"\nspeedup_best_b8 = {summary['speedup_best_b8']:.2f}x ({summary['best_method_b8']}), lossless = {lossless}, {summary['seconds']} s"
    )
    if opts.json:
        opts.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
