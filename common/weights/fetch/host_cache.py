"""One fetch per host (docs/design.md §6.5): the actors of one machine share each fetched weights
version through a file in shared memory (``/dev/shm``), so Redis sends a version once per host.

A file holds the safetensors bytes of the *full* weights, named by run, version and the
manifest's ``weights_sha256`` (so runs or Redis servers that reuse a run name and version
cannot serve each other's weights). It appears only by ``rename`` of a finished temp file, after
the fetcher verified the bytes, so a reader sees a whole verified version or no file. Each put
deletes the run's versions older than the ``keep`` newest (a reader that opened one still reads
it whole). A read copies the file into the reader's own memory (never a mapping of the file),
and the reader hashes that copy: a later write to the file cannot change weights in use.

The cache trusts nothing it did not make (``/dev/shm`` is writable by every user): its
directories (``{root}/specrl-weights-{uid}`` and one per run) are created 0700 and used only
while they are directories owned by this user that no one else may write; a file is opened only
if it is a regular file owned by this user that no one else may write (never through a symlink:
every name is opened with ``O_NOFOLLOW`` relative to its checked directory's descriptor).
Anything else raises :class:`CacheRefused`, and the reader fetches from Redis instead. The
reader also hashes its copy against the manifest's ``weights_sha256`` before it uses it
(:meth:`common.weights.fetch.reader.WeightReader.fetch`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class CacheRefused(OSError):
    """A host-cache directory or file is not this user's alone (owner, mode, or a symlink)."""


def _check_owned(st: os.stat_result, what: str, is_dir: bool) -> None:
    """Raise :class:`CacheRefused` unless ``st`` is this user's directory (mode 0700 or
    narrower) or regular file (no group or other write), as ``is_dir`` says."""
    kind = "directory" if is_dir else "regular file"
    if not (stat.S_ISDIR(st.st_mode) if is_dir else stat.S_ISREG(st.st_mode)):
        raise CacheRefused(f"host weight cache: {what} is not a {kind}")
    if st.st_uid != os.getuid():
        raise CacheRefused(
            f"host weight cache: {what} belongs to uid {st.st_uid}, not this user "
            f"(uid {os.getuid()}); remove it or set redis.host_cache_dir elsewhere"
        )
    loose = st.st_mode & (0o077 if is_dir else 0o022)
    if loose:
        raise CacheRefused(
            f"host weight cache: {what} has mode {stat.S_IMODE(st.st_mode):04o}: others may "
            f"{'enter or change it' if is_dir else 'write it'} (want "
            f"{'0700' if is_dir else 'no group/other write'}); remove it or chmod it"
        )


def _open_dir(name: str, parent_fd: int | None, what: str, create: bool) -> int | None:
    """A descriptor of directory ``name`` (relative to ``parent_fd``), checked to be this user's
    alone; created 0700 first when ``create``; None when it does not exist (not ``create``)."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent_fd)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CacheRefused(f"host weight cache: {what} is not a directory (a symlink?)") from e
        raise
    try:
        _check_owned(os.fstat(fd), what, is_dir=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class HostCache:
    """Full weight versions shared by the processes of one host (see the module docstring)."""

    def __init__(self, root: str | Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.parent = Path(root)
        self.root = self.parent / f"specrl-weights-{os.getuid()}"
        self.keep = keep

    def _dir_name(self, run_id: str) -> str:
        # Run ids are free text; keep the name readable and unambiguous (the digest is in it too).
        return _SAFE.sub("_", run_id)[:80] + "-" + format(hash_name(run_id), "08x")

    def _dir(self, run_id: str) -> Path:
        return self.root / self._dir_name(run_id)

    @staticmethod
    def _file_name(version: int, digest: str) -> str:
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise ValueError(f"weights digest must be 64 hex digits, got {digest!r}")
        return f"v{version:012d}-{digest}.safetensors"

    def path(self, run_id: str, version: int, digest: str) -> Path:
        return self._dir(run_id) / self._file_name(version, digest)

    @contextlib.contextmanager
    def _run_dir(self, run_id: str, create: bool) -> Iterator[int | None]:
        """A checked descriptor of the run's directory (None: it does not exist); every name in
        it is opened relative to this descriptor, so a directory swapped after the check is not
        followed. Raises :class:`CacheRefused` for a directory that is not this user's alone."""
        if create:
            self.parent.mkdir(parents=True, exist_ok=True)
        root_fd = run_fd = None
        try:
            root_fd = _open_dir(str(self.root), None, str(self.root), create)
            if root_fd is not None:
                run_fd = _open_dir(self._dir_name(run_id), root_fd, str(self._dir(run_id)), create)
            yield run_fd
        finally:
            for fd in (run_fd, root_fd):
                if fd is not None:
                    os.close(fd)

    def get(self, run_id: str, version: int, digest: str) -> torch.Tensor | None:
        """The cached bytes of ``version`` (uint8, a private copy), or None. Raises
        :class:`CacheRefused` for a file or directory that is not this user's alone, or one that
        shrank while it was read."""
        name = self._file_name(version, digest)
        with self._run_dir(run_id, create=False) as run_fd:
            if run_fd is None:
                return None
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=run_fd)
            except FileNotFoundError:
                return None
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise CacheRefused(f"host weight cache: {name} is a symlink") from e
                raise
        try:
            st = os.fstat(fd)
            _check_owned(st, str(self._dir(run_id) / name), is_dir=False)
            return _read_private(fd, st.st_size, name)
        finally:
            os.close(fd)

    def put(self, run_id: str, version: int, digest: str, data: torch.Tensor | bytes) -> bool:
        """Publish verified bytes for the host; False (and a warning) if the disk is full.
        Raises :class:`CacheRefused` for a directory that is not this user's alone."""
        name = self._file_name(version, digest)
        tmp = f".{name}.{os.getpid()}.tmp"
        view = memoryview(data.numpy()) if isinstance(data, torch.Tensor) else memoryview(data)
        with self._run_dir(run_id, create=True) as run_fd:
            assert run_fd is not None
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=run_fd)  # left by a crashed process with our pid
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                with os.fdopen(os.open(tmp, flags, 0o600, dir_fd=run_fd), "wb") as f:
                    f.write(view)
                # Atomic: readers see the whole file or none.
                os.replace(tmp, name, src_dir_fd=run_fd, dst_dir_fd=run_fd)
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=run_fd)
                logger.warning("host weight cache: cannot write %s (%s); not shared", name, e)
                return False
            self._prune(run_fd, version)
        return True

    def _prune(self, run_fd: int, newest: int) -> None:
        """Delete the files and locks of the run's versions older than the ``keep`` newest."""
        for name in os.listdir(run_fd):
            if not re.fullmatch(r"v\d{12}(-[0-9a-f]{64}\.safetensors|\.lock)", name):
                continue
            if int(name[1:13]) <= newest - self.keep:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=run_fd)

    def remove_run(self, run_id: str) -> int:
        """Delete every cached version of ``run_id`` (a run that has ended); bytes freed.
        Processes that still have a file open read it whole. A directory that is not this
        user's alone is left as it is (a warning)."""
        freed = 0
        try:
            with self._run_dir(run_id, create=False) as run_fd:
                if run_fd is None:
                    return 0
                for name in os.listdir(run_fd):
                    with contextlib.suppress(OSError):
                        freed += os.stat(name, dir_fd=run_fd, follow_symlinks=False).st_size
                        os.unlink(name, dir_fd=run_fd)
            with contextlib.suppress(OSError):
                os.rmdir(self._dir(run_id))  # only if empty
        except CacheRefused as e:
            logger.warning("%s; not removing it", e)
        return freed

    @contextlib.contextmanager
    def lock(self, run_id: str, version: int) -> Iterator[None]:
        """Exclusive per (run, version) among this host's processes: the fetcher holds it while
        it reads from Redis and writes the file; the others wait on it, then read the file.
        Raises :class:`CacheRefused` for a directory that is not this user's alone."""
        name = f"v{version:012d}.lock"
        with self._run_dir(run_id, create=True) as run_fd:
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                fd = os.open(name, flags, 0o600, dir_fd=run_fd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise CacheRefused(f"host weight cache: {name} is a symlink") from e
                raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock


def _read_private(fd: int, size: int, name: str) -> torch.Tensor:
    """The ``size`` bytes of file ``fd`` copied into this process's own memory (uint8).

    Never a mapping of the file: unwritten pages of even a ``MAP_PRIVATE`` mapping show later
    writes to the file, so a same-user process could change weights after they were hashed.
    The caller hashes this copy, which no one else can reach."""
    out = torch.empty(size, dtype=torch.uint8)
    view = memoryview(out.numpy())
    done = 0
    while done < size:
        got = os.readv(fd, [view[done:]])
        if got == 0:
            raise CacheRefused(f"host weight cache: {name} shrank while it was read")
        done += got
    return out  # bytes written past ``size`` meanwhile are not read: the hash decides


def hash_name(text: str) -> int:
    """A stable 32-bit hash of ``text`` (Python's ``hash`` is salted per process)."""
    value = 2166136261
    for byte in text.encode():
        value = ((value ^ byte) * 16777619) & 0xFFFFFFFF
    return value
