"""Freed heap memory goes back to the OS when the learner trims between steps."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common import heap
from common.config.run import RunConfig

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


# 16 MiB freed raises glibc's dynamic threshold past 5 MiB, so the 5 MiB blocks come from the
# heap; all but the last (which pins the heap's top) are freed, without a trim.
THRESHOLD_PROBE = """
import sys
from common import heap

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

fixed = heap.set_mmap_threshold(int(sys.argv[1]))
big = bytearray(16 * 2**20)
del big
before = rss_mb()
blocks = [bytearray(5 * 2**20) for _ in range(40)]
last = blocks[-1]
del blocks
print(fixed, rss_mb() - before, len(last))
"""


def _freed_blocks_held_mb(threshold: int) -> tuple[bool, float]:
    out = subprocess.run(
        [sys.executable, "-c", THRESHOLD_PROBE, str(threshold)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0] == "True", float(out[1])


@pytest.mark.skipif(heap._mallopt() is None, reason="this C library has no mallopt")
def test_a_fixed_mmap_threshold_returns_freed_blocks_as_they_are_freed():
    fixed, held = _freed_blocks_held_mb(4 * 2**20)
    assert fixed and held < 30, held  # only the kept 5 MiB block (+ noise)
    dynamic, held_dynamic = _freed_blocks_held_mb(0)
    assert not dynamic and held_dynamic > 150, held_dynamic  # 39 freed blocks stay resident


def test_a_threshold_glibc_would_ignore_is_refused_by_the_config():
    with pytest.raises(ValueError, match="run.mmap_threshold_bytes must be at most 33554432"):
        RunConfig(mmap_threshold_bytes=64 * 2**20)
    with pytest.raises(ValueError, match="run.mmap_threshold_bytes must be >= 0"):
        RunConfig(mmap_threshold_bytes=-1)
    assert RunConfig(mmap_threshold_bytes=heap.MMAP_THRESHOLD_MAX).mmap_threshold_bytes > 0


def test_no_threshold_is_set_without_mallopt(monkeypatch, caplog):
    monkeypatch.setattr(heap, "_mallopt", lambda: None)
    assert heap.set_mmap_threshold(4 * 2**20) is False
    with caplog.at_level("WARNING"):
        heap.apply_mmap_threshold(4 * 2**20, "actor")
    assert "actor: run.mmap_threshold_bytes=4194304 not applied" in caplog.text


def test_the_onednn_cache_is_bounded_unless_the_environment_says_otherwise(monkeypatch):
    monkeypatch.setenv(heap.ONEDNN_CACHE_ENV, "0")  # recorded: torn down to what it was before
    monkeypatch.delenv(heap.ONEDNN_CACHE_ENV)
    heap.cap_onednn_cache(0, "learner")
    assert heap.ONEDNN_CACHE_ENV not in os.environ  # 0: oneDNN's own default
    heap.cap_onednn_cache(128, "learner")
    assert os.environ[heap.ONEDNN_CACHE_ENV] == "128"
    monkeypatch.setenv(heap.ONEDNN_CACHE_ENV, "7")
    heap.cap_onednn_cache(128, "actor")
    assert os.environ[heap.ONEDNN_CACHE_ENV] == "7"  # the user's value wins
    with pytest.raises(ValueError, match="run.onednn_cache_capacity must be >= 0"):
        RunConfig(onednn_cache_capacity=-1)
