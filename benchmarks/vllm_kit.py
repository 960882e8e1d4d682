"""What the vLLM engine benchmarks share (benchmarks/engines.py and its real-model sections,
benchmarks/engines_real.py and engines_eagle.py): the group size, vLLM's built-in n-gram
settings, an engine over a model directory, a timed epoch, the real preset's timed chunks decoded
by every engine in turn, and speed rows timed in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common.config.actor import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
GROUP = 8

BUILTIN_NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 1,
}


def epoch(engine, prompts: list[list[int]], per_call: int, max_new: int) -> tuple[int, float]:
    started = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), per_call):
        out = engine.generate(prompts[i : i + per_call], GROUP, max_new)
        tokens += sum(len(r.token_ids) for g in out for r in g)
    return tokens, time.perf_counter() - started


def warmed_chunks(engines: dict, cfg, tokenizer, task, batch: int, quick: bool) -> list:
    """The real preset's timed chunks at ``batch`` (its training prompts from the first on,
    ``batch // GROUP`` of them, twice that without ``quick``), once each of ``engines`` has decoded
    the chunks of other prompts (from the 500th on) and its stats were reset."""
    from benchmarks.real_preset import chunks_of, preset_prompts

    per_epoch = batch // GROUP * (1 if quick else 2)
    timed = chunks_of(preset_prompts(cfg, tokenizer, task, per_epoch, 0), batch)
    warm = chunks_of(preset_prompts(cfg, tokenizer, task, batch // GROUP, 500), batch)
    for engine in engines.values():
        for chunk in warm:
            engine.generate(chunk, GROUP, task.max_new_tokens)
        engine.stats()
    return timed


def interleaved(engines: dict, chunks: list, repeats: int, max_new: int) -> tuple[dict, dict]:
    """The tokens and seconds of each of ``engines`` decoding ``chunks`` ``repeats`` times, each
    chunk by every engine in turn (the first moves each time, so a change in the machine's load
    hits every engine alike)."""
    order = list(engines)
    tokens, seconds = dict.fromkeys(engines, 0), dict.fromkeys(engines, 0.0)
    for _ in range(repeats):
        for chunk in chunks:
            for name in order:
                started = time.perf_counter()
                out = engines[name].generate(chunk, GROUP, max_new)
                seconds[name] += time.perf_counter() - started
                tokens[name] += sum(len(r.token_ids) for g in out for r in g)
            order = order[1:] + order[:1]
    return tokens, seconds


def make_vllm(model_dir: Path, eos: int, max_len: int, speculative_config=None, **kwargs):
    from actors.engines.vllm.engine import VllmEngine

    kwargs.setdefault("inflight", "keep")
    engine = EngineConfig(vllm_max_model_len=max_len, vllm_speculative=speculative_config or {})
    return VllmEngine(model_dir, eos, engine, seed=0, **kwargs)


def child_speed(label: str, rows: tuple[str, ...], batches, repeats: int, env=None) -> dict:
    """Speed rows timed in a child process (``--speed-only``): the figures it writes."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.engines",
            "--only",
            label,
            "--speed-only",
            "--rows",
            ",".join(rows),
        ]
        cmd += ["--batches", ",".join(map(str, batches)), "--repeats", str(repeats)]
        cmd += ["--json", out.name]
        print(f"child: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, env=env, cwd=ROOT, check=True)
        return json.loads(Path(out.name).read_text())
