"""Freed heap memory handed back to the OS: between steps (glibc's ``malloc_trim``), and as it
is freed (a fixed mmap threshold, ``run.mmap_threshold_bytes``).

A training step allocates and frees gigabytes of CPU tensors (activations, gradients, the
gathered state of a version); glibc keeps the freed pages of its arenas mapped, so a process's
resident memory stays near its peak between steps. ``malloc_trim(0)`` returns the free pages
of every arena: in a probe on the real-model preset (SmolLM2-135M, bf16-mixed, 16 completions a
step) the learner's resident memory between steps went from 3.2-3.45 GB to 2.0-2.1 GB. Where
the C library has no ``malloc_trim`` (musl, macOS) :func:`trim` does nothing.

Trimming between steps does not lower a step's peak. glibc's mmap threshold is dynamic: once a
mapped block is freed, blocks up to its size (at most 32 MiB) come from the heap, so a step's
freed activations and gradients of a few MiB stay in the heap beside the live ones, and the
peak holds both. :func:`set_mmap_threshold` fixes the threshold: blocks of at least that size
get their own mapping and leave resident memory when freed. The price is a page fault per page
of every such block.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger(__name__)


M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameter number for the mmap threshold (``malloc.h``)."""

MMAP_THRESHOLD_MAX = 32 * 2**20
"""glibc's largest mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``)."""


@functools.cache
def _libc():
    """The C library, or None where it cannot be found."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


@functools.cache
def _int_function(name: str, *argtypes: type):
    """The C library's function ``name`` (returning an int, taking ``argtypes``), or None where
    it has none."""
    fn = getattr(_libc(), name, None)
    if fn is None:
        return None
    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none."""
    return _int_function("malloc_trim", ctypes.c_size_t)


def _mallopt():
    """glibc's ``mallopt``, or None where the C library has none."""
    return _int_function("mallopt", ctypes.c_int, ctypes.c_int)


def trim() -> bool:
    """Return the heap's free pages to the OS; True when some memory was released."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix the C library's mmap threshold at ``nbytes`` (``run.mmap_threshold_bytes``, at most
    glibc's ceiling of 32 MiB on 64-bit, which the config checks: glibc ignores a larger value
    without saying so; 0: leave the dynamic threshold); True when it was set. False where there
    is no ``mallopt`` (musl, macOS) or the library refused the value."""
    if nbytes <= 0:
        return False
    fn = _mallopt()
    return bool(fn(M_MMAP_THRESHOLD, nbytes)) if fn is not None else False


def apply_mmap_threshold(nbytes: int, role: str) -> None:
    """:func:`set_mmap_threshold` for ``role``'s process at its start, logged; where it cannot
    be set, warned about (the threshold stays dynamic)."""
    if nbytes <= 0:
        return
    if set_mmap_threshold(nbytes):
        log.info("%s: mmap threshold fixed at %d bytes (run.mmap_threshold_bytes)", role, nbytes)
    else:
        log.warning(
            "%s: run.mmap_threshold_bytes=%d not applied: this C library has no mallopt "
            "(glibc's); the threshold stays dynamic",
            role,
            nbytes,
        )


ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def cap_onednn_cache(capacity: int, role: str) -> None:
    """Bound oneDNN's primitive cache at ``capacity`` entries (``run.onednn_cache_capacity``;
    0: oneDNN's default of 1024) in ``role``'s process, before its first CPU matmul: the cache
    is made on first use and reads this variable then. Each bf16 matmul shape the CPU meets
    (a step's rows x tokens vary) adds an entry that holds memory, so over a run the default
    cache grew a learner's resident memory by about 13 MB a step on SmolLM2-135M. A value the
    environment already sets wins."""
    if capacity <= 0 or ONEDNN_CACHE_ENV in os.environ:
        return
    os.environ[ONEDNN_CACHE_ENV] = str(capacity)
    log.info("%s: oneDNN primitive cache bounded at %d entries", role, capacity)
