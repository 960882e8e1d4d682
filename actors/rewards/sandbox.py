"""The confinement of sandboxed reward calls (``task.reward_sandbox=true``) and of
:func:`actors.rewards.run_untrusted`: bubblewrap (``bwrap``) around a process, with the
environment reward workers start from.

A confined process sees a filesystem made of read-only binds of ``/usr`` (and the ``/bin``,
``/lib*`` links to it), the Python installation, the virtual environment and the specrl packages
it imports, plus a fresh ``/dev``, private tmpfs mounts of ``/tmp`` (its working directory and
``HOME``) and ``/dev/shm`` of :data:`TMPFS_BYTES` each, and (for reward workers) its own
``/proc``. Nothing else of the host exists there: not the user's home, not the actor's working
or run directory, not a Unix socket. It runs in its own pid, network, IPC, UTS and cgroup
namespaces (it cannot see or signal a process outside, and a kill of its first process takes
every descendant), in a new session, with ``no_new_privs``, killed with the process that started
it, as uid 65534: an unprivileged actor gets a user namespace; an actor running as root drops to
uid and gid 65534 (``setpriv``) so that the process limit binds. The worker then caps its own
address space, CPU time, file size and process count (:mod:`actors.rewards.worker`).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

SANDBOX_UID = 65534
"""The uid and gid confined code runs as (``nobody`` on Debian)."""
TMPFS_BYTES = 64 << 20
"""The size of each writable tmpfs (``/tmp``, ``/dev/shm``): memory that ``RLIMIT_AS`` misses."""
NPROC_LIMIT = 64
"""``RLIMIT_NPROC`` of a confined process: processes and threads of its uid, itself included."""
FILE_SIZE_LIMIT = 64 << 20
"""``RLIMIT_FSIZE``: the largest file a confined process writes."""
ENV_ALLOWED = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "LC_NUMERIC", "TZ")
"""The variables of the actor's environment a reward worker starts with (all others are not
passed; add names with ``SPECRL_REWARD_ENV=NAME,NAME``, never a ``SPECRL_*`` one)."""
EXTRA_ENV = "SPECRL_REWARD_ENV"
UNCONFINED_ENV_ALLOWED = ("HOME", "USER", "LOGNAME", "TMPDIR", "VIRTUAL_ENV")
"""Also passed to an unsandboxed worker, which runs as the actor's user anyway."""
ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime")
ROOT = Path(__file__).resolve().parents[2]
SPECRL_PACKAGES = ("actors", "common")
"""The specrl packages a worker imports (the worker, the built-in rewards)."""


class SandboxUnavailable(RuntimeError):
    """This host cannot confine reward code (no bwrap, user namespaces refused)."""


def worker_env(confined: bool, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a reward worker (or untrusted program) starts with: an allow-list."""
    environ = os.environ if environ is None else environ
    names = list(ENV_ALLOWED) + ([] if confined else list(UNCONFINED_ENV_ALLOWED))
    extra = [n.strip() for n in environ.get(EXTRA_ENV, "").split(",") if n.strip()]
    names += [n for n in extra if not n.startswith("SPECRL_")]
    env = {n: environ[n] for n in names if n in environ}
    env.setdefault("PATH", "/usr/bin:/bin")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if confined:  # the host's PATH would name directories the sandbox does not have
        env["PATH"] = os.pathsep.join([f"{sys.prefix}/bin", "/usr/local/bin", "/usr/bin", "/bin"])
        env.update(HOME="/tmp", TMPDIR="/tmp", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        env["MKL_NUM_THREADS"] = "1"
    return env


@functools.cache
def bwrap_path() -> str:
    path = shutil.which("bwrap") or next(
        (p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.access(p, os.X_OK)), None
    )
    if path is None:
        raise SandboxUnavailable(
            "the reward sandbox needs bubblewrap (bwrap), which is not installed: "
            "apt-get install bubblewrap (scripts/setup.sh does it as root)"
        )
    return path


@functools.cache
def backend() -> str:
    """``bubblewrap <version>``, the confinement in use."""
    out = subprocess.run([bwrap_path(), "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or "bubblewrap (unknown version)"


def python_binds() -> list[str]:
    """The host directories a confined Python needs, read-only: ``/usr``, the interpreter's
    installation and the virtual environment (each as found and as its real path)."""
    found = [
        "/usr",
        sys.base_prefix,
        os.path.realpath(sys.base_prefix),
        sys.prefix,
        os.path.realpath(sys.prefix),
        str(Path(os.path.realpath(sys.executable)).parents[1]),
    ]
    return _outermost(found)


def specrl_binds() -> list[str]:
    return [str(ROOT / p) for p in SPECRL_PACKAGES if (ROOT / p).is_dir()]


def _outermost(paths: Sequence[str]) -> list[str]:
    """``paths`` that exist, without those inside another one."""
    kept: list[str] = []
    for path in sorted({os.path.normpath(p) for p in paths if os.path.isdir(p)}, key=len):
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def command(
    argv: Sequence[str],
    binds: Sequence[str],
    *,
    proc: bool = True,
    env: Mapping[str, str] | None = None,
) -> list[str]:
    """``argv`` run under bwrap with ``binds`` read-only (host directories, shown at the same
    path) beside the system's. ``proc`` mounts its own ``/proc`` (impossible in a nested
    sandbox, which gets none)."""
    privileged = os.geteuid() == 0
    args = [bwrap_path(), "--die-with-parent", "--new-session", "--clearenv"]
    if privileged:  # no user namespace: the process drops to uid 65534 itself (setpriv below)
        args += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
        args += ["--unshare-cgroup-try", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-all", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    for name, value in (env or {}).items():
        args += ["--setenv", name, value]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if proc:
        args += ["--proc", "/proc"]
    args += ["--dev", "/dev"]
    for path in ("/tmp", "/dev/shm"):  # before the binds, which may lie under /tmp
        args += ["--perms", "1777", "--size", str(TMPFS_BYTES), "--tmpfs", path]
    shown = _outermost([*binds, *python_binds()])
    made = [*shown, *ETC_FILES]
    parents = sorted({str(a) for p in made for a in PurePosixPath(p).parents if str(a) != "/"})
    for parent in parents:
        args += ["--perms", "0755", "--dir", parent]
    for path in shown:
        args += ["--ro-bind", path, path]
    for path in ETC_FILES:
        args += ["--ro-bind-try", path, path]
    args += ["--chdir", "/tmp", "--"]
    if privileged:
        setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        uid = str(SANDBOX_UID)
        args += [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        args += ["--inh-caps=-all", "--bounding-set=-all", "--"]
    return args + list(argv)


def unavailable() -> str | None:
    """Why this host cannot confine (:func:`check`'s reason), or None where it can."""
    try:
        check()
    except SandboxUnavailable as err:
        return str(err)
    return None


def check() -> None:
    """Raise :class:`SandboxUnavailable` with the reason if this host cannot confine: a trivial
    confined Python must start and see itself confined."""
    probe = f"import os; assert os.getuid() == {SANDBOX_UID} and os.getpid() < 10"
    env = worker_env(True)
    argv = command([sys.executable, "-I", "-c", probe], [], env=env)
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, env=env, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise SandboxUnavailable(f"the reward sandbox could not start: {err}") from err
    if done.returncode != 0:
        why = (done.stderr.strip() or f"exit {done.returncode}")[-600:]
        raise SandboxUnavailable(
            f"the reward sandbox ({backend()}) cannot confine on this host: {why}. It needs "
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, "
            "user.max_user_namespaces > 0; not Docker's default seccomp profile) or root; "
            "the actor refuses to run the reward unconfined"
        )
