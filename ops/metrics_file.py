"""Reading the metrics file (JSON lines) that :class:`common.metrics.MetricsWriter` appends to."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    """All complete records of a metrics file (a partially written last line is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
