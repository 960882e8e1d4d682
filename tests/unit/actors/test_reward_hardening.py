"""The reward pool's robustness (audit M1, M4, L2, L3, L4) and run_untrusted."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from actors.rewards import run_untrusted, sandbox
from actors.rewards.pool import OUTPUT_BYTES_PER_CALL, RewardCall, RewardPool, RewardPoolError
from actors.rewards.scoring import outcome_stats
from actors.rewards.spec import FAILURE_KINDS, MAX_COMPONENTS, combine
from common.link.protocol import Completion, DecodeLimits, TrajectoryGroup, decode, encode

ROOT = Path(__file__).resolve().parents[3]


REFUSAL = sandbox.unavailable()
sandboxed = pytest.mark.skipif(REFUSAL is not None, reason=f"no sandbox: {REFUSAL}")

REWARDS = textwrap.dedent(
    """
    import os, sys, time
    FLAG = os.environ.get("FLAG_PATH") or __file__ + ".flag"
    if os.path.exists(FLAG + ".slow"):
        time.sleep(30)
    if os.path.exists(FLAG + ".broken"):
        raise ImportError("the reward's import fails now")

    def exits(prompt, completion, row):
        os._exit(3)

    def names(prompt, completion, row):
        return row["value"]

    def loud(prompt, completion, row):
        for i in range(row["lines"]):
            print("line", i, "x" * 100)
        print("to stderr", file=sys.stderr)
        return 1.0

    def hangs(prompt, completion, row):
        print("hanging", os.getpid(), flush=True)
        time.sleep(120)
    """
)


@pytest.fixture
def rewards(tmp_path) -> Path:
    path = tmp_path / "hardening_rewards.py"
    path.write_text(REWARDS)
    return path


def call(**row) -> RewardCall:
    return RewardCall("p", "c", row)


@pytest.mark.parametrize("how", ["broken", "slow"])
def test_a_worker_that_fails_to_start_later_is_a_counted_crash(rewards, how):
    """M1: the first worker started; its replacement cannot (an import error, a start past the
    start timeout): the call is `crashed`, score() never raises, no worker is left running."""
    with RewardPool(f"{rewards}:exits", workers=1, start_timeout_s=2.0) as pool:
        assert pool.score([call()])[0].failure == "crashed"  # the worker is gone
        Path(f"{rewards}.flag.{how}").touch()
        outcomes = pool.score([call(), call()])
        assert [o.failure for o in outcomes] == ["crashed", "crashed"]
        assert "could not start" in outcomes[0].detail
        assert pool.stats()["crashed"] == 3
        assert all(w.process is None for w in pool._workers)


def test_the_first_worker_that_cannot_start_still_refuses(rewards):
    Path(f"{rewards}.flag.broken").touch()
    with pytest.raises(RewardPoolError, match="the reward's import fails now"):
        RewardPool(f"{rewards}:exits")


def test_the_reward_file_is_read_once_at_start(rewards):
    """A later write to the reward file (model code, anyone) does not change the reward."""
    with RewardPool(f"{rewards}:names", workers=1) as pool:
        rewards.write_text("def names(prompt, completion, row):\n    return 1.0\n")
        assert pool.score([call(value=0.25)])[0].reward == 0.25
        pool.score([RewardCall("p", "c", {})])  # raises in the worker: KeyError, counted
        assert pool.score([call(value=0.5)])[0].reward == 0.5


@pytest.mark.parametrize(
    "value",
    [
        {f"c{i}": 1.0 for i in range(MAX_COMPONENTS + 1)},
        {"x" * 65: 1.0},
        {"a b": 1.0},
        {"reward/x": 1.0},
        {"failed": 0.5},
        {"failed_timeout": 1.0},
        {"mean": 0.9},
        {"": 1.0},
    ],
    ids=["too-many", "too-long", "space", "slash", "failed", "failed_kind", "mean", "empty"],
)
def test_bad_component_names_are_invalid(value):
    """M4, L2: count, length, characters and names that stand for specrl's own figures."""
    outcome = combine(value, {})
    assert outcome.failure == "invalid" and outcome.components == {}, outcome


def test_good_names_pass_and_their_stats_fit_the_learners_frame_limits():
    value = {f"test_{i:02d}_{'y' * 50}": 0.5 for i in range(MAX_COMPONENTS)}
    outcome = combine(value, {})
    assert outcome.failure is None and len(outcome.components) == MAX_COMPONENTS
    stats = outcome_stats([outcome, combine(1.0, {}), combine("x", {})])
    assert len(stats) == MAX_COMPONENTS + 1 + len(FAILURE_KINDS)
    ids = np.arange(3, dtype=np.int32)
    completion = Completion(ids, np.zeros(3, np.float32), np.zeros(3, np.int32), 0.5, True)
    group = TrajectoryGroup("actor-0", 1, "p:1", ids, 0, [completion], stats)
    decoded = decode(encode(group), DecodeLimits(vocab_size=16))
    assert decoded.stats == stats  # the learner takes the group: no refusal, no resend loop


def test_a_pool_accepts_a_bounded_number_of_distinct_names(rewards):
    """L2: random names would grow the learner's metric families for ever."""
    with RewardPool(f"{rewards}:names", workers=1) as pool:
        first = [call(value={f"n{i}": 1.0}) for i in range(MAX_COMPONENTS)]
        assert all(o.failure is None for o in pool.score(first))
        again = pool.score([call(value={"n0": 0.5}), call(value={"another": 1.0})])
        assert again[0].failure is None and again[1].failure == "invalid"
        assert pool.stats()["invalid"] == 1


def _stderr_to(path: Path):
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
    return saved


@sandboxed
def test_sandboxed_prints_reach_the_log_bounded_even_with_a_huge_actor_log(
    rewards, tmp_path, caplog
):
    """L3: stdout and stderr of a sandboxed reward reach the actor's log (the pool forwards
    them), at most OUTPUT_BYTES_PER_CALL a call; an actor log past the sandbox's file-size
    limit does not make the reward fail."""
    huge = tmp_path / "actor.log"
    with open(huge, "wb") as f:
        f.truncate(sandbox.FILE_SIZE_LIMIT + (1 << 20))
    saved = _stderr_to(huge)
    try:
        with (
            caplog.at_level(logging.INFO, logger="actors.rewards.output"),
            RewardPool(f"{rewards}:loud", sandbox=True, workers=1) as pool,
        ):
            few, many = pool.score([call(lines=3), call(lines=5000)])
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    assert few.reward == 1.0 and many.reward == 1.0, (few, many)
    lines = [r.getMessage() for r in caplog.records if r.name == "actors.rewards.output"]
    assert any("line 2 " in m for m in lines) and any("to stderr" in m for m in lines)
    assert any("dropped" in m for m in lines)
    assert sum(len(m) for m in lines) < 3 * OUTPUT_BYTES_PER_CALL


ACTOR = """
import logging, sys
logging.basicConfig(level=logging.INFO)
sys.path.insert(0, sys.argv[1])
from actors.rewards.pool import RewardCall, RewardPool
pool = RewardPool(sys.argv[2], sandbox=sys.argv[3] == "1", workers=1, timeout_s=100)
pool.score([RewardCall("p", "c", {})])
"""


@pytest.mark.parametrize("confined", [True, False], ids=["sandboxed", "unsandboxed"])
def test_a_call_in_progress_dies_with_a_killed_actor(rewards, tmp_path, confined):
    """L4: SIGKILL the actor mid-call: its worker (and, sandboxed, everything it started) goes
    too, and nothing is left in the temporary directory."""
    if confined and REFUSAL is not None:
        pytest.skip(f"no sandbox: {REFUSAL}")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    actor = subprocess.Popen(
        [sys.executable, "-c", ACTOR, str(ROOT), f"{rewards}:hangs", str(int(confined))],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert actor.stderr is not None
    line = ""
    while "hanging" not in line:
        line = actor.stderr.readline()
        assert line or actor.poll() is None, "the actor ended before its reward call"
    worker_pid = int(line.split("hanging", 1)[1].split()[0])
    os.kill(actor.pid, signal.SIGKILL)
    actor.wait()
    deadline = time.monotonic() + 10
    while _running(f"{rewards}:hangs") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(f"{rewards}:hangs"), f"a worker outlived the actor (pid {worker_pid})"
    assert list(tmp.iterdir()) == []


def _running(argument: str) -> bool:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if argument.encode() in cmdline and state != "Z":
                return True
    return False


@sandboxed
def test_run_untrusted_confines_and_kills_the_whole_tree():
    quick = run_untrusted("print(input()[::-1])", stdin="olleh\n")
    assert quick.ok and quick.stdout == b"hello\n"
    token = "41.9375"
    code = textwrap.dedent(
        f"""
        import os, time
        if os.fork() == 0:
            os.setsid()
            os.execv("/bin/sleep", ["sleep", "{token}"])
        time.sleep(60)
        """
    )
    started = time.monotonic()
    hung = run_untrusted(code, timeout_s=1.0)
    assert hung.timed_out and not hung.ok and time.monotonic() - started < 10
    time.sleep(0.3)
    assert not _running(token)
    big = run_untrusted("b = bytearray(600 << 20)", memory_bytes=256 << 20)
    assert big.returncode != 0 and b"MemoryError" in big.stderr
    loud = run_untrusted("print('x' * 100_000)", max_output_bytes=1000)
    assert loud.ok and len(loud.stdout) == 1000
    seen = run_untrusted("import os; print(sorted(os.listdir('/')), os.getcwd(), os.getuid())")
    assert b"'home'" not in seen.stdout and b"'proc'" not in seen.stdout
    assert b"/tmp 65534" in seen.stdout


@sandboxed
def test_the_example_code_reward_runs_the_program_confined():
    """examples/code_reward.py: a correct program passes, a wrong one fails, and one that
    forges a reply of 1.0 on every descriptor (the audit's reward_forge) gets 0."""
    forger = textwrap.dedent(
        """
        import msgpack, os, struct
        for call_id in range(1, 5):
            payload = msgpack.packb({"ok": True, "id": call_id, "value": {"passed": 1.0}})
            for fd in range(256):
                try:
                    os.write(fd, struct.pack(">I", len(payload)) + payload)
                except OSError:
                    pass
        def add(a, b):
            return a - b
        """
    )
    completions = [
        "```python\ndef add(a, b):\n    return a + b\n```",
        "```python\ndef add(a, b):\n    return a * b\n```",
        "def add(a, b) return",
        f"```python\n{forger}```",
    ]
    spec = f"{ROOT / 'examples' / 'code_reward.py'}:score"
    row = {"tests": "assert add(2, 3) == 5"}
    for confined in (True, False):
        with RewardPool(spec, sandbox=confined, weights={"compiles": 0.0}) as pool:
            outcomes = pool.score([RewardCall("p", c, row) for c in completions])
        assert [o.reward for o in outcomes] == [1.0, 0.0, 0.0, 0.0], outcomes
        assert all(o.failure is None for o in outcomes), outcomes


@sandboxed
def test_sandboxed_module_rewards_load_from_the_path_and_the_package(tmp_path, monkeypatch):
    """A module on PYTHONPATH (copied at start) or in a package there (shown read-only), and
    specrl's built-in rewards, all load in the sandbox; nothing else of that directory does."""
    (tmp_path / "one_file_reward.py").write_text(
        "import os\ndef score(prompt, completion, row):\n"
        "    return float(not os.path.exists(row['elsewhere']))\n"
    )
    package = tmp_path / "reward_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "inner.py").write_text(
        "from reward_pkg import helper\ndef score(prompt, completion, row):\n"
        "    return helper.VALUE\n"
    )
    (package / "helper.py").write_text("VALUE = 0.75\n")
    elsewhere = tmp_path / "not_shown.txt"
    elsewhere.write_text("x")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    row = {"elsewhere": str(elsewhere), "answer": "4"}
    for spec, reward in [
        ("one_file_reward:score", 1.0),
        ("reward_pkg.inner:score", 0.75),
        ("actors.rewards.builtin:numeric_answer", 1.0),
    ]:
        with RewardPool(spec, sandbox=True, workers=1) as pool:
            (outcome,) = pool.score([RewardCall("p", "so 4", row)])
        assert outcome.reward == reward and outcome.failure is None, (spec, outcome)


FORGES = """
import msgpack, os, struct

def score(prompt, completion, row):
    if row.get("forge"):
        payload = msgpack.packb({"ok": True, "id": row["forge"], "value": 1.0})
        for fd in range(3, 32):
            try:
                os.write(fd, struct.pack(">I", len(payload)) + payload)
            except OSError:
                pass
    return 0.0
"""


def test_a_reply_of_another_call_is_never_taken_for_this_one(tmp_path):
    """Code in the reward's own process that writes a reply for a later call (the audit's
    reward_forge left it in the pipe for the next call) makes this call invalid and the worker
    replaced; the next call gets its own reply."""
    reward = tmp_path / "forges.py"
    reward.write_text(FORGES)
    with RewardPool(f"{reward}:score", workers=1) as pool:
        forged, after = pool.score([call(forge=2), call()])
        assert forged.failure == "invalid" and forged.reward == 0.0, forged
        assert after.failure is None and after.reward == 0.0, after
