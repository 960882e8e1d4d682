"""One fetch per host (docs/design.md §6.5): the actors of one machine share each fetched weights
version through a file in shared memory (``/dev/shm``), so Redis sends a version once per host.

A file holds the safetensors bytes of the *full* weights, named by run, version and the
manifest's ``weights_sha256`` (so runs or Redis servers that reuse a run name and version
cannot serve each other's weights). It appears only by ``rename`` of a finished temp file, after
the fetcher verified the bytes, so a reader sees a whole verified version or no file. Each put
deletes the run's versions older than the ``keep`` newest (a reader that mapped one keeps its
mapping). Reads are ``mmap`` copy-on-write: a writer never changes the shared file.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


class HostCache:
    """Full weight versions shared by the processes of one host (see the module docstring)."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = Path(root) / f"specrl-weights-{os.getuid()}"
        self.keep = keep

    def _dir(self, run_id: str) -> Path:
        # Run ids are free text; keep the name readable and unambiguous (the digest is in it too).
        name = _SAFE.sub("_", run_id)[:80] + "-" + format(hash_name(run_id), "08x")
        return self.root / name

    def path(self, run_id: str, version: int, digest: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ValueError(f"weights digest must be 64 hex digits, got {digest!r}")
        return self._dir(run_id) / f"v{version:012d}-{digest}.safetensors"

    def get(self, run_id: str, version: int, digest: str) -> torch.Tensor | None:
        """The cached bytes of ``version`` (uint8, copy-on-write mapping), or None."""
        try:
            fd = os.open(self.path(run_id, version, digest), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return torch.empty(0, dtype=torch.uint8)
            memory = mmap.mmap(
                fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)
        return torch.frombuffer(memory, dtype=torch.uint8)  # keeps ``memory`` alive

    def put(self, run_id: str, version: int, digest: str, data: torch.Tensor | bytes) -> bool:
        """Publish verified bytes for the host; False (and a warning) if the disk is full."""
        final = self.path(run_id, version, digest)
        final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        view = memoryview(data.numpy()) if isinstance(data, torch.Tensor) else memoryview(data)
        try:
            with open(tmp, "wb") as f:
                f.write(view)
            os.replace(tmp, final)  # atomic: readers see the whole file or none
        except OSError as e:
            tmp.unlink(missing_ok=True)
            logger.warning("host weight cache: cannot write %s (%s); not shared", final, e)
            return False
        self._prune(run_id, version)
        return True

    def _prune(self, run_id: str, newest: int) -> None:
        """Delete the files and locks of the run's versions older than the ``keep`` newest."""
        directory = self._dir(run_id)
        for path in [*directory.glob("v*-*.safetensors"), *directory.glob("v*.lock")]:
            try:
                version = int(path.name[1:13])
            except ValueError:
                continue
            if version <= newest - self.keep:
                path.unlink(missing_ok=True)

    def remove_run(self, run_id: str) -> int:
        """Delete every cached version of ``run_id`` (a run that has ended); bytes freed.
        Processes that still map a file keep their mapping."""
        directory = self._dir(run_id)
        freed = 0
        for path in directory.glob("*"):
            with contextlib.suppress(OSError):
                freed += path.stat().st_size
                path.unlink()
        with contextlib.suppress(OSError):
            directory.rmdir()
        return freed

    @contextlib.contextmanager
    def lock(self, run_id: str, version: int) -> Iterator[None]:
        """Exclusive per (run, version) among this host's processes: the fetcher holds it while
        it reads from Redis and writes the file; the others wait on it, then read the file."""
        directory = self._dir(run_id)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(directory / f"v{version:012d}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock


def hash_name(text: str) -> int:
    """A stable 32-bit hash of ``text`` (Python's ``hash`` is salted per process)."""
    value = 2166136261
    for byte in text.encode():
        value = ((value ^ byte) * 16777619) & 0xFFFFFFFF
    return value
