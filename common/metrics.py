"""Namespaced metrics (``learner/reward_mean``, ``actor/tokens_per_s``) written as JSON lines."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO


class MetricsWriter:
    """Appends one JSON object per record to ``path``; flushed per line so a reader can tail it."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] = path.open("a", encoding="utf-8")
        self._t0 = time.time()

    def write(self, record: Mapping[str, float | int | str]) -> None:
        row = {"time": time.time(), "elapsed_s": time.time() - self._t0}
        for key, value in record.items():
            # NaN/inf are not JSON; keep the key so a gap in a curve is visible.
            row[key] = None if isinstance(value, float) and not math.isfinite(value) else value
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
