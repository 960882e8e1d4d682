"""Escape attempts of a hostile reward, run against the reward pool: the one list that the
hostile-reward suite (``tests/security/``) and ``python -m benchmarks.sandbox`` both run.

Each :class:`Attempt` is a function of :data:`HOSTILE_REWARD` (a reward file as model-written
code run by a reward would behave), the row it is called with, and a check, made from outside
(the actor's side), of whether it got through. :func:`run_attempt` stages what an attacker would
aim at around a real :class:`~actors.rewards.pool.RewardPool`: the actor's working directory
(holding the reward file, a Unix socket, the run directory with its metrics), a 0600 secret
under the user's home, a TCP listener on the loopback, the actor's pid and secrets in the
actor's environment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from actors.rewards.pool import RewardCall, RewardPool
from actors.rewards.sandbox import NPROC_LIMIT, ROOT
from actors.rewards.spec import RewardOutcome

MEMORY_MB = 256
SECRET = "hunter2-" + "x" * 8
SECRET_ENV = ("SPECRL_REDIS_PASSWORD", "REDIS_PASSWORD", "WANDB_API_KEY", "HF_TOKEN")

HOSTILE_REWARD = r'''
import os, signal, socket, sys, time

def attempt(prompt, completion, row):
    if "attack" not in row:  # the honest reward: 0 for every completion
        planted = sys.modules.get("sitecustomize")
        return 1.0 if getattr(planted, "PLANTED", False) else 0.0
    return float(globals()[row["attack"]](row))

def rewrite_reward_file(row):
    for path in (row["reward_path"], __file__):
        try:
            with open(path, "w") as f:
                f.write("def attempt(prompt, completion, row):\n    return 1.0\n")
        except OSError:
            pass
    return 0.0

def plant_sitecustomize(row):
    code = "PLANTED = True  # %s\nopen(%r, 'w').write('ran')\n" % (row["token"], row["marker"])
    places = [os.getcwd(), row["actor_cwd"], "/tmp"] + (sys.path if row["everywhere"] else [])
    for place in places:
        try:
            with open(os.path.join(place or ".", "sitecustomize.py"), "w") as f:
                f.write(code)
        except OSError:
            pass
    return 0.0

def read_secret_file(row):
    with open(row["secret_path"]) as f:
        return float(row["secret"] in f.read())

def connect_unix_socket(row):
    s = socket.socket(socket.AF_UNIX)
    s.connect(row["unix_socket"])
    s.sendall(b"hello from the reward")
    return 1.0

def connect_tcp(row):
    socket.create_connection(("127.0.0.1", row["tcp_port"]), timeout=2).close()
    return 1.0

def signal_actor(row):
    os.kill(row["actor_pid"], signal.SIGUSR2)
    return 1.0

def write_run_dir(row):
    with open(row["metrics_path"], "a") as f:
        f.write('{"learner/step": 999999}\n')
    return 1.0

def write_specrl_code(row):
    with open(row["code_path"], "w") as f:
        f.write("raise SystemExit('planted')\n")
    return 1.0

def setsid_survivor(row):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv("/bin/sleep", ["sleep", row["sleep_token"]])
        os._exit(0)
    time.sleep(0.2)
    return 0.0

def fork_bomb(row):
    started = 0
    for _ in range(row["forks"]):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        started += 1
    return float(started)

def shm_memory(row):
    block, written = b"\0" * (16 << 20), 0
    try:
        for i in range(row["shm_mb"] // 16):
            with open("/dev/shm/%s-%d" % (row["token"], i), "wb") as f:
                f.write(block)
            written += 16
    except OSError:
        pass
    return float(written)

def read_actor_cmdline(row):
    with open("/proc/%d/cmdline" % row["actor_pid"], "rb") as f:
        return float(f.read() == row["actor_cmdline"].encode())

def read_actor_environ(row):
    with open("/proc/%d/environ" % row["actor_pid"], "rb") as f:
        return float(len(f.read()) > 0)

def read_env_secrets(row):
    return float(any(name in os.environ for name in row["secret_env"]))

FORGER = """
import msgpack, os, struct
payload = msgpack.packb({"ok": True, "id": CALL_ID, "value": 1.0})
frame = struct.pack(">I", len(payload)) + payload
for fd in range(256):
    try:
        os.write(fd, frame)
    except OSError:
        pass
    for pid in (os.getppid(), 1, 2):
        try:
            with open("/proc/%d/fd/%d" % (pid, fd), "wb") as f:
                f.write(frame)
        except OSError:
            pass
"""

def forge_reply(row):
    from actors.rewards import run_untrusted
    result = run_untrusted(FORGER.replace("CALL_ID", str(row["call_id"])), timeout_s=5)
    if not result.ok:  # it must have run: a failure here would hide a forgery
        raise RuntimeError("run_untrusted failed: %r" % (result,))
    return 0.0
'''


@dataclass
class Stage:
    """What an attacker aims at, set up on the actor's side in a temporary directory."""

    root: Path
    token: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    signals: list[int] = field(default_factory=list)

    @property
    def actor_cwd(self) -> Path:
        return self.root / "actor"

    @property
    def reward_path(self) -> Path:
        return self.actor_cwd / "hostile_reward.py"

    @property
    def metrics_path(self) -> Path:
        return self.actor_cwd / "runs" / "demo" / "metrics.jsonl"

    @property
    def secret_path(self) -> Path:
        return self.root / "home" / ".netrc"

    @property
    def marker(self) -> Path:
        return self.root / "planted-ran"

    @property
    def code_path(self) -> Path:
        return ROOT / "actors" / f"planted_{self.token}.py"

    @property
    def sleep_token(self) -> str:
        return f"{60 + int(self.token[:4], 16) % 1000}.{int(self.token[4:8], 16) % 1000:03d}7"


@dataclass(frozen=True)
class Attempt:
    """One way out: the hostile function, what its row holds beyond the stage's, how many
    honest calls follow it, and whether it got through (seen from the actor's side)."""

    name: str
    what: str
    escaped: Callable[[Stage, list[RewardOutcome]], bool]
    sandbox: bool = True
    row: Callable[[Stage], dict] = lambda stage: {}
    honest_calls: int = 0
    attack: str = ""
    """The hostile function, when it is not ``name``."""


def _succeeded(stage: Stage, outcomes: list[RewardOutcome]) -> bool:
    """The attack's own call returned what only success gives (1.0)."""
    return outcomes[0].failure is None and outcomes[0].reward >= 1.0


def _reward_changed(stage: Stage, outcomes: list[RewardOutcome]) -> bool:
    return stage.reward_path.read_text() != HOSTILE_REWARD or any(
        o.reward != 0.0 for o in outcomes[1:]
    )


def _planted(stage: Stage, outcomes: list[RewardOutcome]) -> bool:
    planted = False
    for place in {str(stage.actor_cwd), "/tmp", *sys.path}:
        path = Path(place or ".") / "sitecustomize.py"
        with contextlib.suppress(OSError, UnicodeDecodeError):
            if stage.token in path.read_text():
                path.unlink()  # never leave it where another Python would run it
                planted = True
    return planted or stage.marker.exists() or any(o.reward != 0.0 for o in outcomes[1:])


def _survivor(stage: Stage, outcomes: list[RewardOutcome]) -> bool:
    time.sleep(0.3)
    found = False
    for pid in _pids_with_argument(stage.sleep_token):
        found = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return found


def _pids_with_argument(argument: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if argument.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
    return found


def _too_many_forks(stage: Stage, outcomes: list[RewardOutcome]) -> bool:
    return outcomes[0].failure is not None or outcomes[0].reward > NPROC_LIMIT


def _shm_over_limit(stage: Stage, outcomes: list[RewardOutcome]) -> bool:
    for leftover in Path("/dev/shm").glob(f"{stage.token}-*"):
        leftover.unlink()
    return outcomes[0].failure is not None or outcomes[0].reward > MEMORY_MB


def _forged(stage: Stage, outcomes: list[RewardOutcome]) -> bool:
    return outcomes[0].failure is not None or outcomes[0].reward != 0.0


ATTEMPTS: tuple[Attempt, ...] = (
    Attempt("rewrite_reward_file", "rewrite the reward file", _reward_changed, honest_calls=2),
    Attempt("plant_sitecustomize", "plant sitecustomize.py", _planted, honest_calls=2),
    Attempt("read_secret_file", "read a 0600 file of the user", _succeeded),
    Attempt("connect_unix_socket", "connect to the actor's Unix socket", _succeeded),
    Attempt("connect_tcp", "connect to a loopback TCP port", _succeeded),
    Attempt("signal_actor", "signal the actor", lambda s, o: bool(s.signals) or _succeeded(s, o)),
    Attempt(
        "write_run_dir",
        "append to the run's metrics",
        lambda s, o: _succeeded(s, o) or s.metrics_path.read_text() != "{}\n",
    ),
    Attempt(
        "write_specrl_code",
        "plant code in specrl's package",
        lambda s, o: _succeeded(s, o) or s.code_path.exists(),
    ),
    Attempt("setsid_survivor", "fork + setsid, outlive the kill", _survivor),
    Attempt(
        "fork_bomb",
        f"fork bomb (more than {NPROC_LIMIT} processes)",
        _too_many_forks,
        row=lambda s: {"forks": 4 * NPROC_LIMIT},
    ),
    Attempt(
        "shm_memory",
        f"/dev/shm past the {MEMORY_MB} MiB memory limit",
        _shm_over_limit,
        row=lambda s: {"shm_mb": 4 * MEMORY_MB},
    ),
    Attempt("read_actor_cmdline", "read /proc/<actor>/cmdline", _succeeded),
    Attempt("read_actor_environ", "read /proc/<actor>/environ", _succeeded),
    Attempt("forge_reply", "forge the worker's reply from run_untrusted code", _forged),
    Attempt("read_env_secrets", "read secrets in the environment, sandboxed", _succeeded),
    Attempt(
        "read_env_secrets_unsandboxed",
        "read REDIS_PASSWORD in an unsandboxed worker's environment",
        _succeeded,
        sandbox=False,
        attack="read_env_secrets",
    ),
)


@contextlib.contextmanager
def staged() -> Iterator[Stage]:
    """A :class:`Stage` in a fresh temporary directory, the process's working directory (the
    actor's) and environment (its secrets) set for the attempts, all restored after."""
    with tempfile.TemporaryDirectory(prefix="specrl-escape-") as tmp:
        stage = Stage(Path(tmp))
        stage.metrics_path.parent.mkdir(parents=True)
        stage.metrics_path.write_text("{}\n")
        stage.reward_path.write_text(HOSTILE_REWARD)
        stage.secret_path.parent.mkdir()
        stage.secret_path.write_text(f"machine api.wandb.ai password {SECRET}\n")
        stage.secret_path.chmod(0o600)
        saved_env = {name: os.environ.get(name) for name in SECRET_ENV}
        os.environ.update(dict.fromkeys(SECRET_ENV, SECRET))
        handler = None
        if threading.current_thread() is threading.main_thread():
            handler = signal.signal(signal.SIGUSR2, lambda n, f: stage.signals.append(n))
        try:
            with contextlib.chdir(stage.actor_cwd):
                yield stage
        finally:
            if handler is not None:
                signal.signal(signal.SIGUSR2, handler)
            for name, value in saved_env.items():
                os.environ.pop(name, None) if value is None else os.environ.update({name: value})
            stage.code_path.unlink(missing_ok=True)


def run_attempt(attempt: Attempt, stage: Stage, sandbox: bool = True) -> tuple[bool, str]:
    """Whether ``attempt`` got through a pool (sandboxed unless the attempt is about an
    unsandboxed worker, or ``sandbox`` is False), and the outcome of its call."""
    with socket.socket(socket.AF_UNIX) as unix, socket.create_server(("127.0.0.1", 0)) as tcp:
        unix_path = stage.actor_cwd / f"s-{stage.token[:6]}.sock"
        unix.bind(str(unix_path))
        unix.listen()
        row = {
            "attack": attempt.attack or attempt.name,
            "answer": "",
            "reward_path": str(stage.reward_path),
            "actor_cwd": str(stage.actor_cwd),
            "marker": str(stage.marker),
            "secret_path": str(stage.secret_path),
            "secret": SECRET,
            "unix_socket": str(unix_path),
            "tcp_port": tcp.getsockname()[1],
            "actor_pid": os.getpid(),
            "actor_cmdline": Path("/proc/self/cmdline").read_bytes().decode("utf-8", "replace"),
            "metrics_path": str(stage.metrics_path),
            "code_path": str(stage.code_path),
            "sleep_token": stage.sleep_token,
            "token": stage.token,
            "secret_env": list(SECRET_ENV),
            "call_id": 1,
            **attempt.row(stage),
        }
        confined = sandbox and attempt.sandbox
        row["everywhere"] = confined  # unconfined, only where the stage cleans up
        spec = f"{stage.reward_path}:attempt"
        with RewardPool(spec, workers=1, timeout_s=15, sandbox=confined, memory_mb=MEMORY_MB) as p:
            outcomes = p.score([RewardCall("p", "c", row)])
            honest = {"answer": ""}
            for _ in range(attempt.honest_calls):
                outcomes += p.score([RewardCall("p", "c", honest)])
        escaped = attempt.escaped(stage, outcomes) or _accepted(unix) or _accepted(tcp)
        unix_path.unlink(missing_ok=True)
    first = outcomes[0]
    return escaped, f"{first.failure or 'ok'}: {first.reward} {first.detail[:160]}"


def _accepted(listener: socket.socket) -> bool:
    """Whether anything connected to ``listener`` (the attempt reached it)."""
    listener.setblocking(False)
    try:
        listener.accept()[0].close()
    except (BlockingIOError, OSError):
        return False
    return True
