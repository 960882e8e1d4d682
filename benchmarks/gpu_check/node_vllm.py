"""The node check's vLLM stage (benchmarks/gpu_check/node.py), one runner configuration per
process: version tags under weight swaps and prompt-log-prob scoring on ``VllmEngine``.

    python -m benchmarks.gpu_check.node_vllm --runner v1|v2_async --out FILE

Two versions that differ in the LM head only, its rows rolled by one: the body, hence every KV
entry, is the same under both, so a request that keeps its KV across a swap (``inflight=keep``)
decodes exactly what a fresh forward would, and each greedy token is the argmax of the head of
the version it is tagged with, a different token under each version. A token tagged with the
wrong version (one computed before a swap but tagged after it, as a scheduler running a step
ahead could) therefore shows as a mismatch. Greedy rows swap 0 -> 1 -> 2 (2 = 0's weights) while
decoding; every token is checked against the torch model. Then version 3 (= 1) is loaded and
vLLM's prompt log-probs of each finished sequence are compared with the torch model's.
``v2_async``: vLLM's V2 model runner with async scheduling (GPU only); ``v1``: the V1 runner."""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from common import metric_names as mn

VOCAB, NO_EOS = 64, 999  # NO_EOS is outside the vocabulary: every row runs to its budget
PROMPTS = [[1, 4, 5, 4], [7, 3, 9], [11, 12, 13, 14, 15], [2, 8]]
MAX_NEW = 12
SWAP_POLLS = {3: 1, 7: 2}  # poll number -> version loaded there


def versions() -> tuple[torch.nn.Module, torch.nn.Module]:
    """Version 0 (peaky, untied head) and version 1 (its head's rows rolled by one)."""
    from testing.models import random_model

    old = random_model(VOCAB, 1, tie_word_embeddings=False)
    with torch.no_grad():
        old.lm_head.weight.mul_(20.0)
        old.model.embed_tokens.weight.mul_(3.0)
    new = copy.deepcopy(old)
    with torch.no_grad():
        new.lm_head.weight.copy_(old.lm_head.weight.roll(1, dims=0))
    return old, new


def open_engine(path: Path, runner: str):
    from actors.engines.vllm.engine import VllmEngine
    from common.config.actor import EngineConfig

    kwargs: dict[str, Any] = {}
    if runner == "v2_async":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        kwargs["async_scheduling"] = True
    else:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = 0.3
    config = EngineConfig(vllm_max_model_len=64, vllm_dtype="float32", vllm_kwargs=kwargs)
    return VllmEngine(path, NO_EOS, config, inflight="keep", temperature=0.0, version=0)


@torch.no_grad()
def check_tags(rollouts, by_version: dict[int, torch.nn.Module], tol: float) -> dict[str, Any]:
    """Each token against its tagged version's torch model on its prefix: the token's logit
    within ``tol`` of the largest (the argmax up to rounding) is right; otherwise it is mistagged
    where another version's argmax explains it, unexplained where none does."""
    wrong, unexplained, checked, margins, mixed = 0, 0, 0, [], 0
    for prompt, r in zip(PROMPTS, rollouts, strict=True):
        seq = torch.tensor([prompt + r.token_ids.tolist()])
        logits = {v: m(seq)[0, len(prompt) - 1 : -1].float() for v, m in by_version.items()}
        tags = r.token_versions.tolist()
        mixed += len(set(tags)) > 1
        for i, (token, tag) in enumerate(zip(r.token_ids.tolist(), tags, strict=True)):
            deficit = {v: float(row[i].max() - row[i][token]) for v, row in logits.items()}
            top2 = logits[tag][i].topk(2).values
            margins.append(float(top2[0] - top2[1]))
            checked += 1
            if deficit[tag] <= tol:
                continue
            if any(d <= tol for d in deficit.values()):
                wrong += 1
            else:
                unexplained += 1
    return {
        "tokens_checked": checked,
        "tokens_mistagged": wrong,
        "tokens_unexplained": unexplained,
        "logit_tolerance": tol,
        "rows_spanning_swaps": mixed,
        "min_argmax_margin": round(min(margins), 4),
        "tags": [r.token_versions.tolist() for r in rollouts],
    }


@torch.no_grad()
def check_scoring(engine, rollouts, model: torch.nn.Module) -> dict[str, Any]:
    """vLLM's prompt log-prob of every token of every finished sequence against the model's."""
    from vllm import SamplingParams

    seqs = [p + r.token_ids.tolist() for p, r in zip(PROMPTS, rollouts, strict=True)]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    outs = engine.llm.generate([engine._prompt(s) for s in seqs], params, use_tqdm=False)
    diff, scored = 0.0, 0
    for seq, out in zip(seqs, outs, strict=True):
        ref = torch.log_softmax(model(torch.tensor([seq]))[0].double(), -1)
        for i in range(1, len(seq)):
            got = out.prompt_logprobs[i][seq[i]].logprob
            diff = max(diff, abs(got - float(ref[i - 1, seq[i]])))
            scored += 1
    return {"scored_tokens": scored, "max_abs_logprob_diff": diff}


def run(runner: str) -> dict[str, Any]:
    from common.model import save_pretrained

    gpu = torch.cuda.is_available()
    old, new = versions()
    by_version = {0: old, 1: new, 2: old}
    with tempfile.TemporaryDirectory(prefix="node-vllm-") as tmp:
        save_pretrained(old, Path(tmp))
        started = time.perf_counter()
        engine = open_engine(Path(tmp), runner)
        start_s = time.perf_counter() - started
        polls = {"n": 0}

        def source():
            polls["n"] += 1
            version = SWAP_POLLS.get(polls["n"])
            return None if version is None else (version, by_version[version].state_dict())

        groups = engine.generate(PROMPTS, 1, MAX_NEW, weight_source=source)
        rollouts = [g[0] for g in groups]
        tags = check_tags(rollouts, by_version, 5e-2 if gpu else 1e-3)
        engine.load_weights(3, new.state_dict())
        scoring = check_scoring(engine, rollouts, new)
    tol = 2e-2 if gpu else 1e-3
    tags_ok = (
        tags["tokens_mistagged"] == tags["tokens_unexplained"] == 0
        and tags["rows_spanning_swaps"] > 0
    )
    return {
        "runner": runner,
        "engine_start_s": round(start_s, 2),
        "swaps": int(engine.stats().get(mn.VERIFY_SWAPS, 0.0)),
        "version_tags_exact": tags_ok,
        **tags,
        **scoring,
        "logprob_tolerance": tol,
        "scoring_exact": scoring["max_abs_logprob_diff"] <= tol,
        "passed": tags_ok and scoring["max_abs_logprob_diff"] <= tol,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--runner", choices=("v1", "v2_async"), required=True)
    p.add_argument("--out", type=Path, required=True)
    opts = p.parse_args()
    torch.set_num_threads(1)
    opts.out.write_text(json.dumps(run(opts.runner)))  # scratch, read back by node.py


if __name__ == "__main__":
    main()
