"""A stored version's bytes read from its chunks: streamed into one preallocated buffer, each
chunk checked against the manifest's sha256 as it lands.

Every byte is therefore verified, and a read can never assemble a torn mix: a chunk from
anything but this version fails its checksum, and a chunk that vanished mid-read means the
version was pruned (manifest gone too: ``WeightsError``) or lost (``WeightsCorrupt``).
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import redis
import torch

from common.weights.fetch.resp import raw_connection, stream_gets
from common.weights.format import WeightsCorrupt, WeightsError
from common.weights.keys import weights_chunk_key
from common.weights.manifest import sha256_of

# Chunk GETs per round trip on the fallback (plain redis-py) path.
_FALLBACK_BATCH = 8

_HUGE_PAGES_FROM = 8 * 2**20
"""Buffers at least this large ask for transparent huge pages (2 MiB on x86-64)."""

_MADV_POPULATE_WRITE = 23  # Linux's value; Python 3.11's mmap does not name it


def _new_buffer(nbytes: int) -> torch.Tensor:
    """Writable uint8 memory for one fetch, its pages mapped up front where the OS can, so the
    data does not land through a page fault per 4 KiB.

    Large buffers ask for transparent huge pages (``MADV_HUGEPAGE``) and then map them in one
    call (``MADV_POPULATE_WRITE``, Linux >= 5.14), far fewer page-table updates than
    ``MAP_POPULATE`` of small pages. Where either advice is refused the pages are mapped as the
    data lands."""
    populate = getattr(mmap, "MAP_POPULATE", 0)
    if nbytes == 0 or not populate:
        return torch.empty(nbytes, dtype=torch.uint8)
    anonymous = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    huge = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes >= _HUGE_PAGES_FROM and huge is not None:
        memory = mmap.mmap(-1, nbytes, flags=anonymous)
        with contextlib.suppress(OSError):
            memory.madvise(huge)
            memory.madvise(getattr(mmap, "MADV_POPULATE_WRITE", _MADV_POPULATE_WRITE))
    else:
        memory = mmap.mmap(-1, nbytes, flags=anonymous | populate)
    return torch.frombuffer(memory, dtype=torch.uint8)  # keeps ``memory`` alive


def _overflow(version: int, total_bytes: int) -> WeightsCorrupt:
    return WeightsCorrupt(
        f"version {version}: the chunks hold more than the manifest total ({total_bytes} bytes)"
    )


def read_chunks(
    client: redis.Redis,
    run_id: str,
    version: int,
    chunk_sha256: list[str],
    total_bytes: int,
    gone: Callable[[], bool],
) -> torch.Tensor:
    """The ``total_bytes`` bytes of ``version``'s chunks, each checked against its sha256.

    A missing chunk raises ``WeightsError`` where ``gone()`` says the version was pruned
    meanwhile, ``WeightsCorrupt`` otherwise."""
    buf = _new_buffer(total_bytes)
    out = memoryview(buf.numpy())
    num_chunks = len(chunk_sha256)
    keys = [weights_chunk_key(run_id, version, i) for i in range(num_chunks)]
    filled = 0
    # Hash each chunk on a helper thread (hashlib releases the GIL) while the next arrives.
    with ThreadPoolExecutor(1, thread_name_prefix="weights-sha256") as hasher:
        digests: list[Future[bytes]] = []
        chunks = _stream_chunks(client, version, keys, out)
        try:
            for i, view in enumerate(chunks):
                if view is None:
                    if gone():
                        raise WeightsError(f"weights version {version} expired while fetching")
                    raise WeightsCorrupt(f"version {version}: chunk {i}/{num_chunks} is missing")
                digests.append(hasher.submit(sha256_of, view))
                filled += len(view)
        finally:
            chunks.close()  # releases the connection at once, also on an error
        for i, (digest, want) in enumerate(zip(digests, chunk_sha256, strict=True)):
            got = digest.result().hex()
            if got != want:
                raise WeightsCorrupt(
                    f"version {version}: chunk {i} sha256 {got[:12]}… != manifest {want[:12]}…"
                )
    if filled != len(out):
        raise WeightsCorrupt(
            f"version {version}: {filled} bytes do not match the manifest total ({len(out)} bytes)"
        )
    return buf


def _stream_chunks(
    client: redis.Redis, version: int, keys: list[str], out: memoryview
) -> Iterator[memoryview | None]:
    """Each chunk's bytes placed in ``out`` one after the other, as a view of where it
    landed; None for a missing chunk (and nothing after it)."""
    conn = raw_connection(client)
    if conn is None:
        yield from _pipelined_chunks(client, version, keys, out)
        return
    try:
        yield from stream_gets(conn, keys, out, lambda: _overflow(version, len(out)))
    finally:
        conn.disconnect()


def _pipelined_chunks(
    client: redis.Redis, version: int, keys: list[str], out: memoryview
) -> Iterator[memoryview | None]:
    """The same through redis-py's parser (its own copies; slower, any client kind)."""
    pos = 0
    for start in range(0, len(keys), _FALLBACK_BATCH):
        pipe = client.pipeline(transaction=False)
        for key in keys[start : start + _FALLBACK_BATCH]:
            pipe.get(key)
        for chunk in pipe.execute():
            if chunk is None:
                yield None
                return
            if len(chunk) > len(out) - pos:
                raise _overflow(version, len(out))
            view = out[pos : pos + len(chunk)]
            view[:] = chunk
            pos += len(chunk)
            yield view
