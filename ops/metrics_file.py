"""Reading the metrics file (JSON lines) that :class:`common.metrics.MetricsWriter` appends to:
whole (:func:`read_metrics`), or as it grows (:class:`MetricsTail`, which reads each byte once)."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    """All complete records of a metrics file (a partially written last line is skipped)."""
    if not path.is_file():
        return []
    return _records(path.read_text(encoding="utf-8").splitlines())


def _records(lines: list[str]) -> list[dict]:
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


class MetricsTail:
    """The records appended to a metrics file since the last :meth:`new_records` call.

    Reads from where it stopped, so following a run costs what the run wrote, not the whole file
    every poll (a progress display polling twice a second over a long run). A line still being
    written waits for its newline. A file that shrank (replaced, truncated) is read again from its
    start."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def new_records(self) -> list[dict]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self._offset:
            self._offset, self._partial = 0, b""
        if size == self._offset:
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        self._offset += len(data)
        *complete, self._partial = (self._partial + data).split(b"\n")
        return _records([line.decode("utf-8", errors="replace") for line in complete])
