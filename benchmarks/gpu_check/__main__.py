"""``python -m benchmarks.gpu_check``: the packages the GPU machine lacks made unimportable, then
the check (benchmarks/gpu_check/run.py)."""

from __future__ import annotations

import sys

from benchmarks.gpu_check import ABSENT_ON_DEVICE


def main() -> int:
    for name in ABSENT_ON_DEVICE:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    from benchmarks.gpu_check.run import main as run

    return run()


if __name__ == "__main__":
    sys.exit(main())
