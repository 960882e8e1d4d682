"""Hosts made of private network namespaces, for the multi-host test and the chaos benchmark.

One namespace is the learner's host (the learner and its Redis), one more per actor. The learner's
host holds a bridge with ``LEARNER_IP``; each actor host is joined to it by a veth pair (the
bridge's port ``p{i}`` on the learner's side, ``eth0`` with ``actor_ip(i)`` on the actor's).
Every address is inside these namespaces: nothing is added to the machine's own network, and no
route leads out of them, so no packet of a test can leave them.

Processes go into a host by a ``setns`` of the starting thread (:func:`entered`): a child forked
then lives in that namespace (``ip netns exec`` does the same before its exec), and anything the
thread connects or binds meanwhile does too. Needs root (``CAP_SYS_ADMIN``), iproute2 and a kernel
with veth and bridge support; :func:`unavailable` says why not where they are missing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from ops.processes import Process

PREFIX = "specrl-nt-"
"""Every namespace made here is named ``{PREFIX}{pid}-{n}-{role}`` (pid: the process that made it)."""
SUBNET = "10.200.0"
LEARNER_IP = f"{SUBNET}.1"
NETNS_DIR = Path("/run/netns")
IP_TIMEOUT_S = 10.0
_CLONE_NEWNET = 0x40000000
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_made = 0


class NetnsError(RuntimeError):
    """A namespace, link or address could not be made or changed."""


def ip(*args: str, tool: str = "ip") -> str:
    """Run ``ip ARGS`` (or ``tc ARGS``); its stdout, NetnsError with its stderr on failure."""
    try:
        done = subprocess.run(
            [tool, *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsError(f"{tool} {' '.join(args)}: {e}") from e
    if done.returncode != 0:
        raise NetnsError(f"{tool} {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be used here (None: they can): not Linux, not root, no iproute2, or
    the kernel refuses a namespace, a veth pair, a bridge or a ``setns`` (tried on a probe, then
    removed)."""
    if _LIBC is None:
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    remove_stale()
    try:
        with Hosts.create(actors=1) as probe, entered(probe.learner):
            pass
    except (NetnsError, OSError) as e:
        return f"cannot make or enter network namespaces here: {e}"
    return None


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces named ``{prefix}{pid}-...`` whose process is gone (a run that was
    killed before it could clean up); the names deleted."""
    try:
        names = [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]
    except NetnsError:
        return []
    removed = []
    for name in names:
        match = re.fullmatch(rf"{re.escape(prefix)}(\d+)-.*", name)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            with contextlib.suppress(NetnsError):
                ip("netns", "del", name)
                removed.append(name)
    return removed


def _setns(fd: int) -> None:
    assert _LIBC is not None
    if _LIBC.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


@contextlib.contextmanager
def entered(name: str) -> Iterator[None]:
    """The calling thread inside namespace ``name`` (children it starts and sockets it makes
    meanwhile stay there), back in its own namespace afterwards. Other threads are not moved."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(NETNS_DIR / name, os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def reachable(netns: str, host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection from namespace ``netns`` to ``host:port`` opens in time."""
    with entered(netns):
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError:
            return False
    return True


def listening(pid: int) -> set[tuple[str, int]]:
    """The TCP ``(address, port)`` pairs process ``pid`` listens on (IPv4 and IPv6, read from
    its namespace's tables, matched to its own socket descriptors)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table, width in (("tcp", 4), ("tcp6", 16)):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address, port = local.split(":")
            raw = bytes.fromhex(address)
            # /proc shows the address as 32-bit words in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            family = socket.AF_INET if width == 4 else socket.AF_INET6
            found.add((socket.inet_ntop(family, raw), int(port, 16)))
    return found


class Hosts:
    """The learner's host and ``actors`` actor hosts (see the module's docstring); a context
    manager that deletes them all."""

    def __init__(self, tag: str, actors: int) -> None:
        self.tag = tag
        self.learner = f"{tag}-L"
        self.actors = [f"{tag}-A{i}" for i in range(actors)]

    @classmethod
    def create(cls, actors: int) -> Hosts:
        """Make the namespaces, the bridge and the links, all up; NetnsError (with whatever was
        made removed again) when the machine does not allow it."""
        global _made
        _made += 1
        hosts = cls(f"{PREFIX}{os.getpid()}-{_made}", actors)
        try:
            hosts._build()
        except BaseException:
            hosts.close()
            raise
        return hosts

    def _build(self) -> None:
        for name in (self.learner, *self.actors):
            ip("netns", "add", name)
            ip("-n", name, "link", "set", "lo", "up")
        ip("-n", self.learner, "link", "add", "br0", "type", "bridge")
        ip("-n", self.learner, "addr", "add", f"{LEARNER_IP}/24", "dev", "br0")
        ip("-n", self.learner, "link", "set", "br0", "up")
        for i, name in enumerate(self.actors):
            port = f"p{i}"
            ip("-n", self.learner, "link", "add", port, "type", "veth", "peer", "name", "eth0",
               "netns", name)  # fmt: skip
            ip("-n", self.learner, "link", "set", port, "master", "br0")
            ip("-n", self.learner, "link", "set", port, "up")
            ip("-n", name, "addr", "add", f"{self.actor_ip(i)}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")

    @staticmethod
    def actor_ip(index: int) -> str:
        return f"{SUBNET}.{10 + index}"

    def partition(self, index: int) -> None:
        """Cut actor ``index``'s host off: its link is taken down on the learner's side (a pulled
        cable: the actor's packets go nowhere, and nothing tells either end)."""
        ip("-n", self.learner, "link", "set", f"p{index}", "down")

    def heal(self, index: int) -> None:
        ip("-n", self.learner, "link", "set", f"p{index}", "up")

    def delay(self, index: int, delay_ms: float) -> str | None:
        """``netem`` delay on both ends of actor ``index``'s link; None, or why the kernel
        refused it (no ``sch_netem``), in which case the link is left as it was."""
        ends = ((self.learner, f"p{index}"), (self.actors[index], "eth0"))
        try:
            for name, dev in ends:
                ip("-n", name, "qdisc", "add", "dev", dev, "root", "netem", "delay",
                   f"{delay_ms}ms", tool="tc")  # fmt: skip
        except NetnsError as e:
            for name, dev in ends:
                with contextlib.suppress(NetnsError):
                    ip("-n", name, "qdisc", "del", "dev", dev, "root", tool="tc")
            return str(e)
        return None

    def close(self) -> None:
        """Delete every namespace (a namespace lives on until its last process has gone: stop
        the processes first)."""
        for name in (*self.actors, self.learner):
            with contextlib.suppress(NetnsError):
                ip("netns", "del", name)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NetnsProcess(Process):
    """A pipeline process (ops/processes.py) that starts, and restarts, inside namespace
    ``netns``."""

    def __init__(self, netns: str, proc: Process) -> None:
        super().__init__(proc.name, proc.module, proc.args, proc.log_path, proc.env, proc.cwd)
        self.netns = netns

    def start(self) -> NetnsProcess:
        with entered(self.netns):
            super().start()
        return self
