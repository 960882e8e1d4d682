"""What every benchmark script shares: its command line (the module docstring as help, ``--json``),
how it ends (the run's seconds and load average added, the figures written as one JSON object
with the commit, worktree state and command that made them), and the random-weight models and
GRPO groups it measures."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROVENANCE_KEYS = ("commit", "dirty", "command")


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser showing ``doc`` (the script's docstring) as written, with ``--json``."""
    p = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json", type=Path, help="write the figures here (one JSON object)")
    return p


def finish(figures: dict[str, Any], path: Path | None, started: float | None = None) -> int:
    """Add ``seconds`` (since ``started``, a ``time.perf_counter()``) and the load average at the
    end (other work on the machine skews speed figures), write ``figures`` to ``path`` if given;
    the script's exit status (0)."""
    if started is not None:
        figures["seconds"] = round(time.perf_counter() - started, 1)
    figures["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    write_json(figures, path)
    return 0


def write_json(figures: dict[str, Any], path: Path | None) -> None:
    """``figures`` as one indented JSON object in ``path`` (its folder made), if a path is given,
    with ``commit``, ``dirty`` and ``command`` (:func:`provenance`) added where the caller has
    not set them."""
    if path is not None:
        for key, value in provenance().items():
            figures.setdefault(key, value)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(figures, indent=2, default=str) + "\n")


def provenance(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Where figures come from: ``commit`` (``git rev-parse HEAD``, None outside a checkout),
    ``dirty`` (tracked files changed since it, per ``git status --porcelain``; None when git
    cannot tell) and ``command``, the command line as run (``argv``, default ``sys.argv``)."""
    head = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "commit": head or None,
        "dirty": None if status is None or not head else bool(status),
        "command": command_line(sys.argv if argv is None else argv),
    }


def command_line(argv: Sequence[str]) -> str:
    """``argv`` as typed from the repository root: ``python -m benchmarks.x ...`` for a script,
    ``python -m benchmarks.x ...`` when the script runs as a module."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        head = ["python", "-m", spec.name.removesuffix(".__main__")]
    else:
        script = Path(argv[0]) if argv and argv[0] else Path("-")
        if script.resolve().is_relative_to(ROOT):
            script = script.resolve().relative_to(ROOT)
        head = ["python", str(script)]
    return shlex.join([*head, *argv[1:]])


def _git(*args: str) -> str | None:
    """``git args`` in the repository: its stripped output, None if git fails or is missing."""
    try:
        out = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def run_module(
    module: str, *args: str, cwd: Path = ROOT, timeout: float | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` in a child with the repository on its path and ``env`` added to
    its environment: its output captured as text, its exit status not checked."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env)
    command = [sys.executable, "-m", module, *args]
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def specrl_run(name: str, overrides: Sequence[str], run_dir: Path | None) -> tuple[Path, dict]:
    """``specrl run OVERRIDES`` in ``runs/bench/NAME`` (a fresh run named ``bench-NAME``), or
    nothing when ``run_dir`` names a finished run to read; the run directory and what to record
    of it (the command, or the directory read)."""
    if run_dir is not None:
        return run_dir, {"run_dir": str(run_dir)}
    run_dir = ROOT / "runs" / "bench" / name
    args = [*overrides, f"run.dir={run_dir}", f"run.name=bench-{name}", "learner.resume=false"]
    command = "specrl run " + " ".join(args)
    print(command, "...", flush=True)
    subprocess.run(
        [sys.executable, "-m", "ops.cli", "run", *args],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return run_dir, {"run_command": command}


def target(name: str, value: float, goal: float) -> dict[str, Any]:
    """A headline figure with its goal (a floor): ``name``, ``target_name``, ``target_met``."""
    return {name: value, f"target_{name}": goal, "target_met": value >= goal}


def table(header: Sequence[str], rows: Iterable[Sequence[object]], left: int = 1) -> str:
    """A Markdown table: the first ``left`` columns aligned left, the others right (numbers)."""
    lines = ["| " + " | ".join(header) + " |"]
    lines.append(
        "| " + " | ".join("---" if i < left else "---:" for i in range(len(header))) + " |"
    )
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def random_model(*sizes: int, seed: int = 0, device: Any = "cpu", dtype: Any = None, **fields: Any):
    """A ``Transformer`` with random weights drawn after ``torch.manual_seed(seed)``, built on
    ``device`` in ``dtype`` (default: the default dtype; no copy in another dtype on the way).
    Its ``ModelArgs``: ``sizes`` (vocab, hidden, intermediate, layers, heads, KV heads: all six
    or none) and the fields in ``fields``."""
    import torch

    from common.model import Transformer
    from common.model_args import ModelArgs

    if sizes:
        if len(sizes) != 6:
            raise TypeError(f"random_model takes six sizes by position or none, got {sizes}")
        vocab, hidden, intermediate, layers, heads, kv_heads = sizes
        fields |= dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate)
        fields |= dict(num_hidden_layers=layers, num_attention_heads=heads)
        fields |= dict(num_key_value_heads=kv_heads)
    args = ModelArgs(**fields)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or previous)
    try:
        torch.manual_seed(seed)
        with torch.device(device):
            return Transformer(args)
    finally:
        torch.set_default_dtype(previous)


def random_groups(
    vocab: int, groups: int, group_size: int, prompt: int, completion: int, seed: int, actor: str
) -> list:
    """``groups`` GRPO groups of ``group_size`` random completions (half to all of
    ``completion`` tokens) of random ``prompt``-token prompts, with random rewards and
    behaviour log-probs: a learner step's input without a model to sample from."""
    import numpy as np

    from common.link.protocol import Completion, TrajectoryGroup

    rng = np.random.default_rng(seed)
    out = []
    for i in range(groups):
        completions = []
        for _ in range(group_size):
            t = int(rng.integers(completion // 2, completion + 1))
            completions.append(
                Completion(
                    token_ids=rng.integers(3, vocab, t).astype(np.int32),
                    behaviour_logprobs=(-rng.random(t) * 3 - 1).astype(np.float32),
                    token_versions=np.zeros(t, np.int32),
                    reward=float(rng.random()),
                    finished=True,
                )
            )
        prompt_ids = rng.integers(3, vocab, prompt).astype(np.int32)
        out.append(TrajectoryGroup(actor, i, f"p{i}", prompt_ids, 0, completions))
    return out


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform.processor()`` says."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor()
