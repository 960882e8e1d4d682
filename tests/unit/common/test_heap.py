"""Freed heap memory goes back to the OS when the learner trims between steps."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common import heap

PROBE = """
import gc, sys
from common import heap

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

# 400 MB in 100 KB blocks (below glibc's mmap threshold: they come from the heap), every
# 50th kept so the freed ones cannot all be handed back by shrinking the heap's top.
blocks = [bytearray(100_000) for _ in range(4000)]
kept = blocks[::50]
del blocks
gc.collect()
before = rss_mb()
released = heap.trim()
print(before, rss_mb(), released, len(kept))
"""


@pytest.mark.skipif(heap._malloc_trim() is None, reason="this C library has no malloc_trim")
def test_trim_returns_the_free_pages_of_the_heap():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True
    ).stdout.split()
    before, after, released = float(out[0]), float(out[1]), out[2] == "True"
    assert released and before - after > 200, (before, after)  # most of the 392 MB freed


def test_trim_is_a_no_op_without_malloc_trim(monkeypatch):
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    assert heap.trim() is False
