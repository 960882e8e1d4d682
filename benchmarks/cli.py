"""What every benchmark script shares: its command line (the module docstring as help, ``--json``)
and how it ends (the run's seconds and load average added, the figures written as one JSON
object)."""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


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
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    return 0


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
