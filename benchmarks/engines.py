"""The torch engine against vLLM on the same model and prompts, side by side in one process.

    python benchmarks/engines.py [--quick] [--json PATH]      (needs vLLM: SPECRL_WITH_VLLM=1 setup)

Model: the RL-trained demo model (benchmarks/rollout.py trains and caches it). Engines: torch
plain and torch with its best drafting method here (ngram), vLLM plain and vLLM with its n-gram
speculative decoding. Every engine gets one warm-up epoch over the prompts (which also gives the
torch n-gram drafter earlier completions, as a multi-epoch RL run would), then one timed epoch.
Batch = rows per call: prompts x 8 samples.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from actors.engines.torch_engine import TorchEngine  # noqa: E402
from benchmarks.rollout import demo_model  # noqa: E402
from common.config import SpecConfig, load_config  # noqa: E402
from common.model import load_pretrained, save_pretrained  # noqa: E402
from common.tasks import task_from_config  # noqa: E402
from common.tokenizer import encode_prompt, load_tokenizer  # noqa: E402

GROUP = 8


def timed_epoch(engine, prompts: list[list[int]], per_call: int, max_new: int) -> float:
    chunks = [prompts[i : i + per_call] for i in range(0, len(prompts), per_call)]
    for chunk in chunks:  # warm-up
        engine.generate(chunk, GROUP, max_new)
    started = time.perf_counter()
    tokens = 0
    for chunk in chunks:
        tokens += sum(len(r.token_ids) for g in engine.generate(chunk, GROUP, max_new) for r in g)
    return tokens / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    from actors.engines.vllm_engine import VllmEngine

    torch.set_num_threads(1)
    ckpt = demo_model(150 if opts.quick else 400)
    model = load_pretrained(ckpt).eval()
    tokenizer = load_tokenizer(ckpt)
    task = task_from_config(load_config([]).task)
    prompts = [
        encode_prompt(tokenizer, p.prompt)
        for p in task.sample(random.Random(1), 16 if opts.quick else 64)
    ]
    model_dir = Path(tempfile.mkdtemp(prefix="specrl-engines-"))
    save_pretrained(model, model_dir)
    max_len = model.args.max_position_embeddings

    engines = {
        "torch plain": lambda: TorchEngine(model, tokenizer.eos_id, tokenizer.pad_id, seed=0),
        "torch ngram (k=8)": lambda: TorchEngine(
            model, tokenizer.eos_id, tokenizer.pad_id, seed=0, spec=SpecConfig(method="ngram", k=8)
        ),
        "vllm plain": lambda: VllmEngine(
            model_dir, tokenizer.eos_id, seed=0, max_model_len=max_len
        ),
        "vllm ngram (k=4)": lambda: VllmEngine(
            model_dir,
            tokenizer.eos_id,
            seed=0,
            max_model_len=max_len,
            speculative_config={
                "method": "ngram",
                "num_speculative_tokens": 4,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 1,
            },
        ),
    }
    batches = (8,) if opts.quick else (8, 32)
    results: dict[str, float] = {}
    print("| engine | batch | tokens/s |\n| --- | ---: | ---: |")
    for name, make in engines.items():
        engine = make()
        for batch in batches:
            speed = timed_epoch(engine, prompts, batch // GROUP, task.max_new_tokens)
            results[f"{name}|{batch}"] = speed
            print(f"| {name} | {batch} | {speed:,.0f} |", flush=True)
        del engine
    b = batches[0]
    torch_best = max(results[f"torch plain|{b}"], results[f"torch ngram (k=8)|{b}"])
    summary = {
        "torch_best_over_vllm_plain": round(torch_best / results[f"vllm plain|{b}"], 3),
        "batch": b,
        **{k.replace(" ", "_"): round(v, 1) for k, v in results.items()},
    }
    print(f"\ntorch_best_over_vllm_plain (batch {b}) = {summary['torch_best_over_vllm_plain']:.2f}")
    if opts.json:
        opts.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
