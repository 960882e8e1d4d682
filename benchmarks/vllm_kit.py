"""What the vLLM engine benchmarks share (benchmarks/engines.py and its real-model section,
benchmarks/engines_real.py): the group size, vLLM's built-in n-gram settings, an engine over a
model directory, a timed epoch, and speed rows timed in a child process."""

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


def make_vllm(model_dir: Path, eos: int, max_len: int, speculative_config=None, **kwargs):
    from actors.engines.vllm_engine import VllmEngine

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
