"""One fetch per host (docs/design.md §6.5): the actors of one machine share each fetched weights
version through a file in shared memory (``/dev/shm``), so Redis sends a version once per host.

A file holds the safetensors bytes of the *full* weights, named by run, version and the
manifest's ``weights_sha256`` (so runs or Redis servers that reuse a run name and version
cannot serve each other's weights). It appears only by ``rename`` of a finished temp file, after
the fetcher verified the bytes, so a reader sees a whole verified version or no file. Each put
deletes the run's versions older than the ``keep`` newest (a reader that opened one still reads
it whole). A read copies the file into the reader's own memory (never a mapping of the file),
and the reader hashes that copy: a later write to the file cannot change weights in use.

The learner of the node writes its versions here too, the same way (the node-local plane,
common/weights/publish/node_plane.py): :meth:`HostCache.put_tensors` lays the file out straight
from the tensors, and :meth:`HostCache.node_id` names the run's directory, so a manifest can say which
node's cache holds the version.

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
import secrets
import stat
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from common.weights.format import (
    publish_threads,
    raw_bytes,
    safetensors_layout,
    threaded_map,
)

logger = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
NODE_ID_FILE = "node-id"
WRITE_BLOCK = 64 * 2**20
"""Largest byte range one ``pwrite`` of :meth:`HostCache.put_tensors` (or one ``preadv`` of
:meth:`HostCache.get`) takes: threads share the big tensors."""


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

    def get(self, run_id: str, version: int, digest: str, threads: int = 0) -> torch.Tensor | None:
        """The cached bytes of ``version`` (uint8, a private copy read on ``threads`` threads;
        0: ``publish_threads()``), or None. Raises :class:`CacheRefused` for a file or
        directory that is not this user's alone, or one that shrank while it was read."""
        name = self._file_name(version, digest)
        with self._run_dir(run_id, create=False) as run_fd:
            if run_fd is None:
                return None
            opened = _open_owned(run_fd, name, str(self._dir(run_id) / name))
        if opened is None:
            return None
        fd, st = opened
        try:
            return _read_private(fd, st.st_size, name, threads or publish_threads())
        finally:
            os.close(fd)

    def put(self, run_id: str, version: int, digest: str, data: torch.Tensor | bytes) -> bool:
        """Publish verified bytes for the host; False (and a warning) if the disk is full.
        Raises :class:`CacheRefused` for a directory that is not this user's alone."""
        view = memoryview(data.numpy()) if isinstance(data, torch.Tensor) else memoryview(data)

        def write(fd: int) -> None:
            with os.fdopen(os.dup(fd), "wb") as f:
                f.write(view)

        return self._write_file(run_id, version, digest, write)

    def put_tensors(
        self,
        run_id: str,
        version: int,
        digest: str,
        tensors: Mapping[str, torch.Tensor],
        threads: int = 1,
    ) -> bool:
        """:meth:`put` of the safetensors file of ``tensors`` (contiguous CPU tensors of the
        dtypes ``common.weights.format`` writes), laid out straight into the file: the header,
        then byte ranges of at most ``WRITE_BLOCK`` written with ``pwrite`` on ``threads``
        threads (it releases the GIL). The caller vouches that ``digest`` is theirs."""
        order, head, body = safetensors_layout(tensors, None)
        pieces: list[tuple[memoryview, int]] = [(memoryview(head), 0)]
        offset = len(head)
        for name in order:
            raw = memoryview(raw_bytes(tensors[name]).numpy())
            for start in range(0, len(raw), WRITE_BLOCK):
                pieces.append((raw[start : start + WRITE_BLOCK], offset + start))
            offset += len(raw)

        def write(fd: int) -> None:
            os.ftruncate(fd, len(head) + body)

            def put(piece: tuple[memoryview, int]) -> None:
                view, at = piece
                while len(view):
                    done = os.pwrite(fd, view, at)
                    view, at = view[done:], at + done

            threaded_map(put, pieces, threads)

        return self._write_file(run_id, version, digest, write)

    def _write_file(
        self, run_id: str, version: int, digest: str, write: Callable[[int], None]
    ) -> bool:
        """A temp file (0600, never through a symlink) filled by ``write(fd)``, then renamed to
        the version's name (readers see the whole file or none); older versions pruned."""
        name = self._file_name(version, digest)
        tmp = f".{name}.{os.getpid()}.{threading.get_native_id()}.tmp"
        with self._run_dir(run_id, create=True) as run_fd:
            assert run_fd is not None
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=run_fd)  # left by a crashed process with our pid
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(tmp, flags, 0o600, dir_fd=run_fd)
                try:
                    write(fd)
                finally:
                    os.close(fd)
                # Atomic: readers see the whole file or none.
                os.replace(tmp, name, src_dir_fd=run_fd, dst_dir_fd=run_fd)
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=run_fd)
                logger.warning("host weight cache: cannot write %s (%s); not shared", name, e)
                return False
            self._prune(run_fd, version)
        return True

    def node_id(self, run_id: str) -> str:
        """This node's id for ``run_id``: 32 hex digits in the run's directory (``node-id``),
        made once by the first process to ask (0600, an atomic link of a finished file).
        Processes that share this directory (the same host's ``/dev/shm``, or a volume mounted
        into several containers) read the same id, so a manifest naming it tells an actor the
        version's file is in its own cache (docs/design.md §6.5); it goes with the run's
        copies (:meth:`remove_run`). Raises :class:`CacheRefused` for a directory or file that
        is not this user's alone."""
        with self._run_dir(run_id, create=True) as run_fd:
            assert run_fd is not None
            what = str(self._dir(run_id) / NODE_ID_FILE)
            text = _read_node_id(run_fd, what)
            if text is None:
                tmp = f".{NODE_ID_FILE}.{os.getpid()}.{threading.get_native_id()}.tmp"
                flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(tmp, flags, 0o600, dir_fd=run_fd)
                try:
                    os.write(fd, secrets.token_hex(16).encode())
                finally:
                    os.close(fd)
                with contextlib.suppress(FileExistsError):  # another process made it first
                    os.link(tmp, NODE_ID_FILE, src_dir_fd=run_fd, dst_dir_fd=run_fd)
                os.unlink(tmp, dir_fd=run_fd)
                text = _read_node_id(run_fd, what)
        if text is None or not re.fullmatch(r"[0-9a-f]{32}", text):
            raise CacheRefused(f"host weight cache: {what} is malformed")
        return text

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


def _open_owned(dir_fd: int, name: str, what: str) -> tuple[int, os.stat_result] | None:
    """``name`` in the checked directory ``dir_fd``, opened for reading without following a
    symlink, with its stat, once it is a regular file of this user's alone (None: there is none).
    Raises :class:`CacheRefused` for a symlink or a file someone else owns or may write."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CacheRefused(f"host weight cache: {what} is a symlink") from e
        raise
    try:
        st = os.fstat(fd)
        _check_owned(st, what, is_dir=False)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _read_node_id(dir_fd: int, what: str) -> str | None:
    """The text of ``node-id`` in the checked directory ``dir_fd`` (None: there is none)."""
    opened = _open_owned(dir_fd, NODE_ID_FILE, what)
    if opened is None:
        return None
    try:
        return os.read(opened[0], 64).decode(errors="replace").strip()
    finally:
        os.close(opened[0])


def _read_private(fd: int, size: int, name: str, threads: int = 1) -> torch.Tensor:
    """The ``size`` bytes of file ``fd`` copied into this process's own memory (uint8), in
    ranges of at most ``WRITE_BLOCK`` read with ``preadv`` on ``threads`` threads.

    Never a mapping of the file: unwritten pages of even a ``MAP_PRIVATE`` mapping show later
    writes to the file, so a same-user process could change weights after they were hashed.
    The caller hashes this copy, which no one else can reach."""
    out = torch.empty(size, dtype=torch.uint8)
    view = memoryview(out.numpy())

    def read(start: int) -> None:
        done, end = start, min(size, start + WRITE_BLOCK)
        while done < end:
            got = os.preadv(fd, [view[done:end]], done)
            if got == 0:
                raise CacheRefused(f"host weight cache: {name} shrank while it was read")
            done += got

    threaded_map(read, list(range(0, size, WRITE_BLOCK)), threads)
    return out  # bytes written past ``size`` meanwhile are not read: the hash decides


def hash_name(text: str) -> int:
    """A stable 32-bit hash of ``text`` (Python's ``hash`` is salted per process)."""
    value = 2166136261
    for byte in text.encode():
        value = ((value ^ byte) * 16777619) & 0xFFFFFFFF
    return value
