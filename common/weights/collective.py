"""The collective byte path for weights versions: the learner broadcasts each version's bytes to
the actors that joined its weights group, and Redis keeps the manifest (docs/design.md §6.7).

The weights group is a torch.distributed process group of its own, never the learner's training
group: rank 0 is the learner's sender (``common.weights.publish.collective_sender``), ranks 1..n the actors'
receivers (``common.weights.fetch.collective_feed``). Gloo on CPU; CUDA devices (NCCL) are
refused until a GPU has run the group (``check_device``, with the reasons of
``common.config.learner.weights_group_refusal``: a whole version received into GPU memory beside
vLLM, NCCL's watchdog killing the learner for a dead member, a default address other containers
cannot reach; the supported path is the Redis weight store). The sender hosts a
``TCPStore`` at ``host:port`` for the rendezvous and the membership, listening on that host only
(a loopback host unless ``learner.weights_group_allow_remote``):

- an actor joins by taking a ticket and proving it knows the run's group secret (the sender
  keeps it in Redis under ``weights:{run}:group_secret``, where actors, who hold Redis
  credentials, read it): an HMAC of its ticket and a nonce of its own under ``proof/{n}``; the
  sender answers under ``ticket/{n}`` with an epoch, a rank and the group's size, signed for that
  nonce, or refuses a wrong proof (``common.weights.group_join``, which says what a local
  process that reaches the store can still do); every member of an epoch builds the group from
  the store under ``epoch/{e}/`` (gloo listening beside the store, :func:`gloo_host`), and then
  every rank proves the secret again over the group itself (an HMAC of the epoch and its rank,
  all-gathered) before any version is sent, so a peer that took a member's place in the
  rendezvous is found and the epoch dropped;
- new joiners make a new epoch: the sender announces it to the current members (a ``REGROUP``
  header), who rebuild with their ranks, and the new ones take the next ranks;
- a member that fails an operation (a peer gone, a timeout) drops the group, and the sender
  forms the next epoch from whoever asks again; an actor outside a group takes versions from
  Redis.

Each operation starts with a header broadcast from rank 0 (``NOOP``: a heartbeat, ``VERSION``,
``REGROUP``, ``LEAVE``). A version is its tensors in one flat byte payload (floats cast to
bfloat16, the wire dtype; other tensors as they are; each tensor 64-byte aligned), preceded by
its layout as JSON, then broadcast in buckets of ``bucket_bytes``. Both sides hash each bucket
(sha256) while the next one travels. The sender then writes the version's collective manifest
to Redis (``weights:{run}:{version}:collective``: the layout and the bucket digests); a receiver
hands a version on only once its layout and every bucket digest match that manifest, and keeps
its current version otherwise.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import redis
import torch
import torch.distributed as dist

from common.config.learner import is_loopback_host, weights_group_refusal
from common.weights.format import (
    DTYPE_NAMES,
    WeightsCorrupt,
    WeightsError,
    WeightsNonFinite,
    dtype_name,
)
from common.weights.manifest import check_format, digest_of_digests, parse_manifest

log = logging.getLogger(__name__)

COLLECTIVE_FORMAT = 1
WIRE_DTYPE = torch.bfloat16
"""What floating tensors travel as."""
DEFAULT_BUCKET_BYTES = 256 * 2**20
HEARTBEAT_S = 2.0
"""The sender broadcasts a ``NOOP`` header after this long without a version (it finds gone
members and lets the others know the learner is there)."""
IDLE_TIMEOUT_S = 30.0
"""A receiver that gets no header for this long drops the group (the learner hangs or left)."""
MANIFEST_TTL_S = 600
_ALIGN = 64

OP_NOOP, OP_VERSION, OP_REGROUP, OP_LEAVE = 0, 1, 2, 3

_DTYPES = {dtype_name(d): d for d in DTYPE_NAMES}


class CollectiveError(WeightsError):
    """The weights group failed: a peer went away, an operation timed out, or no group formed."""


class CollectiveLeft(CollectiveError):
    """The learner closed the weights group."""


def collective_manifest_key(run_id: str, version: int) -> str:
    """The collective manifest of ``version``: its layout and bucket digests (JSON)."""
    return f"weights:{run_id}:{version}:collective"


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` of the weights group's store, checked."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"weights group address must be HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def backend_for(device: torch.device) -> str:
    """``nccl`` for a CUDA device, else ``gloo``."""
    return "nccl" if device.type == "cuda" else "gloo"


def check_device(device: torch.device) -> None:
    """Refuse a device whose backend has not been run (``CollectiveError``, with the reason of
    ``weights_group_refusal``): NCCL until a GPU has run the group (docs/design.md §6.7)."""
    refusal = weights_group_refusal(device, backend_for(device))
    if refusal is not None:
        raise CollectiveError(refusal)


# ---------------------------------------------------------------------------- epoch proof


def epoch_proof(secret: str, run_id: str, epoch: int, rank: int) -> bytes:
    """Rank ``rank``'s proof of the secret in ``epoch`` (32 bytes), all-gathered over the group."""
    message = f"specrl-weights-group/epoch/{run_id}/{epoch}/{rank}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


# ----------------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in a version's payload."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def wire_layout(
    state: Mapping[str, torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> dict[str, Any]:
    """The layout of ``state``'s payload (floats in the wire dtype), as the JSON both sides use:
    ``total_bytes``, ``bucket_bytes``, ``wire_dtype`` and ``tensors`` (name -> dtype, shape,
    offset, nbytes)."""
    if bucket_bytes < _ALIGN:
        raise ValueError(f"bucket_bytes must be >= {_ALIGN}, got {bucket_bytes}")
    tensors: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, t in state.items():
        dtype = WIRE_DTYPE if t.is_floating_point() else t.dtype
        if dtype not in DTYPE_NAMES:
            raise WeightsError(f"tensor {name}: dtype {dtype} cannot travel on the weights group")
        nbytes = t.numel() * dtype.itemsize
        tensors[name] = {
            "dtype": dtype_name(dtype),
            "shape": list(t.shape),
            "offset": offset,
            "nbytes": nbytes,
        }
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return {
        "total_bytes": offset,
        "bucket_bytes": int(bucket_bytes),
        "wire_dtype": dtype_name(WIRE_DTYPE),
        "tensors": tensors,
    }


def slots(layout: Mapping[str, Any]) -> list[Slot]:
    """The layout's tensors, checked: known dtypes, sizes that match their shapes, inside the
    payload and not overlapping (``WeightsCorrupt`` otherwise)."""
    try:
        total = int(layout["total_bytes"])
        entries = [
            Slot(
                str(name),
                str(spec["dtype"]),
                tuple(int(d) for d in spec["shape"]),
                int(spec["offset"]),
                int(spec["nbytes"]),
            )
            for name, spec in layout["tensors"].items()
        ]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise WeightsCorrupt(f"weights group layout is malformed: {e!r}") from e
    end = 0
    for s in sorted(entries, key=lambda s: s.offset):
        dtype = _DTYPES.get(s.dtype)
        if (
            dtype is None
            or any(d < 0 for d in s.shape)
            or s.nbytes != math.prod(s.shape) * dtype.itemsize
            or s.offset < end
            or s.offset % _ALIGN
            or s.offset + s.nbytes > total
        ):
            raise WeightsCorrupt(f"weights group layout: tensor {s.name!r} does not fit: {s}")
        end = s.offset + s.nbytes
    return entries


def bucket_ranges(total: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` byte ranges of the payload's buckets."""
    return [(a, min(a + bucket_bytes, total)) for a in range(0, total, bucket_bytes)]


def views(payload: torch.Tensor, entries: list[Slot]) -> dict[str, torch.Tensor]:
    """The tensors of a payload: views into its bytes, no copy."""
    return {
        s.name: payload[s.offset : s.offset + s.nbytes].view(_DTYPES[s.dtype]).view(s.shape)
        for s in entries
    }


def pack(
    state: Mapping[str, torch.Tensor], layout: Mapping[str, Any], device: torch.device
) -> torch.Tensor:
    """``state`` as one uint8 payload on ``device`` (floats cast to the wire dtype; the padding
    between tensors zeroed, so the digests depend on the tensors alone)."""
    entries = slots(layout)
    payload = torch.empty(int(layout["total_bytes"]), dtype=torch.uint8, device=device)
    ends = [s.offset + s.nbytes for s in entries]
    starts = [s.offset for s in entries[1:]] + [payload.numel()]
    with torch.no_grad():
        for view, t in zip(views(payload, entries).values(), state.values(), strict=True):
            view.copy_(t.detach().reshape(view.shape))
        for end, start in zip(ends, starts, strict=True):
            payload[end:start].zero_()
    return payload


def hash_threads() -> int:
    """Threads hashing buckets on each side: half the cores, 1 to 4 (hashlib releases the GIL,
    so buckets that arrive faster than one core hashes them are hashed side by side)."""
    return max(1, min(4, (os.cpu_count() or 1) // 2))


def bucket_sha256(bucket: torch.Tensor) -> str:
    """sha256 of one bucket's bytes (copied to the CPU first when it lives on a GPU)."""
    raw = bucket if bucket.device.type == "cpu" else bucket.to("cpu")
    return hashlib.sha256(memoryview(raw.numpy())).hexdigest()


def new_manifest(
    run_id: str, version: int, layout: Mapping[str, Any], digests: list[str]
) -> dict[str, Any]:
    """The collective manifest of ``version``: its layout and bucket digests."""
    return {
        "format": COLLECTIVE_FORMAT,
        "run_id": run_id,
        "version": version,
        **layout,
        "bucket_sha256": digests,
        "buckets_sha256": digest_of_digests(digests),
        "created_at": time.time(),
    }


def check_received(
    run_id: str,
    version: int,
    layout: Mapping[str, Any],
    digests: list[str],
    manifest: Mapping[str, Any] | None,
) -> None:
    """Raise unless ``manifest`` is the collective manifest of what was received: the same run,
    version, layout and bucket digests (``WeightsCorrupt``); ``WeightsNonFinite`` where the
    sender found a non-finite float; ``WeightsError`` where there is none."""
    missing = f"version {version}: no collective manifest in Redis"
    manifest = check_format(
        manifest,
        COLLECTIVE_FORMAT,
        missing,
        lambda found: (
            f"version {version}: collective manifest format {found!r}, this reader reads "
            f"{COLLECTIVE_FORMAT}"
        ),
    )
    if manifest.get("run_id") != run_id or manifest.get("version") != version:
        raise WeightsCorrupt(
            f"version {version}: collective manifest is of run {manifest.get('run_id')!r} "
            f"version {manifest.get('version')!r}"
        )
    if manifest.get("refused"):
        raise WeightsNonFinite(f"version {version}: the sender refused it: {manifest['refused']}")
    for key in ("total_bytes", "bucket_bytes", "wire_dtype", "tensors"):
        if manifest.get(key) != layout.get(key):
            raise WeightsCorrupt(
                f"version {version}: the received {key} differs from the collective manifest's"
            )
    listed = manifest.get("bucket_sha256")
    if not isinstance(listed, list) or len(listed) != len(digests):
        raise WeightsCorrupt(f"version {version}: collective manifest lists another bucket count")
    if digest_of_digests([str(h) for h in listed]) != manifest.get("buckets_sha256"):
        raise WeightsCorrupt(f"version {version}: collective manifest's bucket list is damaged")
    for i, (got, want) in enumerate(zip(digests, listed, strict=True)):
        if got != want:
            raise WeightsCorrupt(
                f"version {version}: bucket {i} hashes to {got[:12]}…, the collective manifest "
                f"says {str(want)[:12]}…"
            )


def read_manifest(
    client: redis.Redis, run_id: str, version: int, timeout_s: float
) -> dict[str, Any] | None:
    """The collective manifest of ``version``, waiting up to ``timeout_s`` for the sender to
    write it (it does once the version's bytes are out); None if it does not come."""
    key = collective_manifest_key(run_id, version)
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        raw = client.get(key)
        if raw is not None:
            return parse_manifest(raw, f"version {version}: collective manifest")
        if time.monotonic() >= deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


# ------------------------------------------------------------------------------------ group


def store_client(address: str, timeout_s: float) -> dist.TCPStore:
    """A client of the sender's store at ``address`` (``CollectiveError`` if none answers)."""
    host, port = parse_address(address)
    try:
        return dist.TCPStore(
            host, port, is_master=False, wait_for_workers=False, timeout=_td(timeout_s)
        )
    except (RuntimeError, OSError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
        raise CollectiveError(f"no weights group at {address}: {e}") from e


def store_server(address: str, timeout_s: float, allow_remote: bool = False) -> dist.TCPStore:
    """The sender's store, listening on ``address``'s host and port only.

    ``TCPStore`` binds every interface given a port, so the listening socket is bound here, to
    the host's address, and handed over (``master_listen_fd``; the store owns it then). A host
    that is not loopback (or resolves to an address that is not) is refused unless
    ``allow_remote``: the store has no authentication of its own, and whoever reaches it can
    read and write its keys."""
    host, port = parse_address(address)
    if not allow_remote and not is_loopback_host(host):
        raise CollectiveError(
            f"weights group address {address!r} is not a loopback host; the group's store and "
            "broadcasts are not encrypted: set learner.weights_group_allow_remote=true to serve "
            "actors on other machines over a network you trust"
        )
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise CollectiveError(f"cannot host the weights group at {address}: {e}") from e
    if not allow_remote:
        for info in infos:
            if not ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback:
                raise CollectiveError(
                    f"weights group host {host!r} resolves to {info[4][0]}, not loopback; set "
                    "learner.weights_group_allow_remote=true to allow it"
                )
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
        sock.listen(512)
    except OSError as e:
        sock.close()
        raise CollectiveError(f"cannot host the weights group at {address}: {e}") from e
    fd = sock.detach()
    try:
        return dist.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=_td(timeout_s),
            master_listen_fd=fd,
            use_libuv=True,
        )
    except (RuntimeError, OSError) as e:
        with contextlib.suppress(OSError):  # unless the store closed it already
            os.close(fd)
        raise CollectiveError(f"cannot host the weights group at {address}: {e}") from e


def gloo_host(address: str, sender: bool) -> str | None:
    """Where a member's gloo pairs listen: beside the store, not on the address this machine's
    hostname resolves to (which can be a public one while the store is on loopback). The
    sender: the store's host (gloo's default for a wildcard host, which no peer can dial). A
    receiver: the store's host when it is loopback, else this machine's address that routes to
    it (found by a UDP ``connect``, which sends nothing)."""
    host, port = parse_address(address)
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        ip = None  # a name
    if sender:
        return None if ip is not None and ip.is_unspecified else host
    if is_loopback_host(host):
        return host
    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return str(probe.getsockname()[0])
    except OSError:
        return None  # gloo's default; the store connect reports the real problem


def _td(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


class WeightsGroup:
    """One epoch of the weights group: ``size`` ranks (0: the sender), built from the store
    under ``epoch/{epoch}/``; the constructor returns once every rank has connected."""

    def __init__(
        self,
        store: dist.Store,
        epoch: int,
        rank: int,
        size: int,
        device: torch.device,
        connect_timeout_s: float,
        bind_host: str | None = None,
    ) -> None:
        """``bind_host``: the address gloo listens on (:func:`gloo_host`); None: gloo's
        default, the address this machine's hostname resolves to."""
        self.epoch, self.rank, self.size, self.device = epoch, rank, size, device
        check_device(device)
        prefixed = dist.PrefixStore(f"epoch/{epoch}/", store)
        try:
            if bind_host is None:
                self.pg = dist.ProcessGroupGloo(prefixed, rank, size, _td(connect_timeout_s))
                return
            options = dist.ProcessGroupGloo._Options()
            options._timeout = _td(connect_timeout_s)
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
            self.pg = dist.ProcessGroupGloo(prefixed, rank, size, options)
            return
        except (RuntimeError, OSError) as e:
            failure = str(e)
        raise CollectiveError(
            f"weights group epoch {epoch} did not form (rank {rank} of {size}): {failure}"
        )

    def authenticate(self, secret: str, run_id: str, timeout_s: float) -> None:
        """Every rank proves it knows ``secret`` to every other, over the group itself: each
        broadcasts an HMAC of the epoch and its rank. ``CollectiveError`` if a rank's proof is
        wrong (a peer that took a member's place in the store's rendezvous) or the exchange
        fails."""
        wrong = []
        for rank in range(self.size):
            want = epoch_proof(secret, run_id, self.epoch, rank)
            t = torch.frombuffer(bytearray(want), dtype=torch.uint8).to(self.device)
            if rank != self.rank:
                t.zero_()
            self.broadcast(t, timeout_s, root=rank)
            if not hmac.compare_digest(t.cpu().numpy().tobytes(), want):
                wrong.append(rank)
        if wrong:
            raise CollectiveError(
                f"weights group epoch {self.epoch}: rank(s) {wrong} do not know the run's secret"
            )

    def broadcast(self, tensor: torch.Tensor, timeout_s: float, root: int = 0) -> None:
        """Rank ``root``'s ``tensor`` into every rank's (in place); ``CollectiveError`` on
        failure."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        options.rootTensor = 0
        options.timeout = _td(timeout_s)
        try:
            self.pg.broadcast([tensor], options).wait()
            return
        except (RuntimeError, OSError) as e:
            failure = str(e)
        # Raised outside the handler: an error chained to the original would keep this frame,
        # and so the group and its sockets, alive in a reference cycle until the next garbage
        # collection, and the other members would not see this one leave.
        raise CollectiveError(f"weights group epoch {self.epoch}: broadcast failed: {failure}")

    def header(self, values: list[int] | None, timeout_s: float) -> list[int]:
        """Broadcast a 4-int header from rank 0 (``values`` there; None elsewhere)."""
        t = torch.tensor(values or [0, 0, 0, 0], dtype=torch.int64, device=self.device)
        self.broadcast(t, timeout_s)
        return [int(v) for v in t.tolist()]
