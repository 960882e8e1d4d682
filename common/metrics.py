"""Namespaced metrics (``learner/reward_mean``, ``actor/tokens_per_s``) written as JSON lines."""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO


class MetricsWriter:
    """Appends one JSON object per record to ``path``; flushed per line so a reader can tail it.
    The file is this user's alone (0600, an existing one made so; a directory it creates 0700),
    whatever the process umask: records hold held-out results and the run's figures."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = path
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        # Not ours to change (another user's file we may write): left as it is.
        with contextlib.suppress(OSError):
            os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) & 0o700)
        self._file: IO[str] = os.fdopen(fd, "a", encoding="utf-8")
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
