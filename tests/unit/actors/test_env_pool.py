"""Environment worker processes (actors/episodes/pool.py, env_worker.py), real processes: a
worker that cannot start stops the start; a crash, a hang, an oversize or invalid answer and an
environment that raises each end only their sessions with their kind, counted; a worker killed
for a crash, a timeout or an oversize reply is replaced and the pool keeps serving; the sandbox
refuses to run unconfined; nothing is left running after close; the episode runner on
``env.workers=2`` gives the episodes it gives in-process."""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest

from actors.episodes.env import EnvFailure
from actors.episodes.pool import EnvPool, EnvPoolError
from actors.rewards import sandbox

ENVS = '''
import ctypes, os, subprocess, time


class Faulty:
    """Does what the action says: exit, segfault, sleep, huge, not_text, nan, not_bool,
    too_big, raise, spawn (a grandchild, its pid), random (not deterministic), whoami; else
    echoes it (done on "done")."""

    def __init__(self, tag="t"):
        self.tag, self.n = tag, 0

    def reset(self, *, seed, options):
        self.n = 0
        return f"start {seed}", {"sibling": options.get("sibling", -1)}

    def step(self, action):
        self.n += 1
        if action == "exit":
            os._exit(3)
        if action == "segfault":
            ctypes.string_at(0)
        if action == "sleep":
            time.sleep(60)
        if action == "huge":
            return "x" * (2 << 20), 0.0, False, False, {}
        if action == "not_text":
            return 42, 0.0, False, False, {}
        if action == "nan":
            return "ok", float("nan"), False, False, {}
        if action == "not_bool":
            return "ok", 0.0, 1, False, {}
        if action == "too_big":
            return "ok", 1e9, False, False, {}
        if action == "raise":
            raise RuntimeError("the environment broke")
        if action == "spawn":
            child = subprocess.Popen(["sleep", "60"])
            return str(child.pid), 0.0, False, False, {}
        if action == "random":
            return os.urandom(8).hex(), 0.0, False, False, {}
        if action == "whoami":
            return f"{os.getuid()} {os.getpid()}", 0.0, False, False, {}
        info = {"n": self.n, "odd": object(), "tag": self.tag}
        return f"{self.tag} {self.n} {action}", 1.0, action == "done", False, info


class Broken:
    def __init__(self):
        raise ValueError("no such board")

    def reset(self, *, seed, options):
        return "", {}

    def step(self, action):
        return "", 0.0, True, False, {}
'''


@pytest.fixture
def envs(tmp_path):
    path = tmp_path / "faulty_envs.py"
    path.write_text(ENVS)
    return path


def make_pool(envs, cls="Faulty", **kwargs) -> EnvPool:
    kwargs.setdefault("step_timeout_s", 5.0)
    kwargs.setdefault("max_abs_reward", 10.0)
    return EnvPool(f"{envs}:{cls}", **kwargs)


def started(pool: EnvPool, n: int):
    """``n`` sessions, each reset."""
    sessions = [pool.session() for _ in range(n)]
    for i, s in enumerate(sessions):
        assert s.reset(seed=i, options={"sibling": i}) == (f"start {i}", {"sibling": i})
    return sessions


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def fails(session, action: str) -> EnvFailure:
    with pytest.raises(EnvFailure) as info:
        session.step(action)
    return info.value


@pytest.mark.parametrize(
    ("cls", "kwargs", "why"),
    [
        ("Missing", {}, "has no class 'Missing'"),
        ("Broken", {}, "no such board"),
        ("Faulty", {"colour": "red"}, "do not fit Faulty"),
    ],
)
def test_a_worker_that_cannot_start_stops_the_start(envs, cls, kwargs, why):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(EnvPoolError, match=why):
        EnvPool(f"{envs}:{cls}", kwargs)
    after = {p.pid for p in psutil.Process().children(recursive=True) if alive(p.pid)}
    assert after <= before


def test_an_import_error_and_a_bad_spec_stop_the_start(tmp_path):
    bad = tmp_path / "bad_envs.py"
    bad.write_text("import no_such_module_here\n")
    with pytest.raises(EnvPoolError, match="no_such_module_here"):
        EnvPool(f"{bad}:Env")
    with pytest.raises(EnvPoolError, match="no file"):
        EnvPool(f"{tmp_path}/absent.py:Env")
    with pytest.raises(EnvPoolError, match="expected a built-in environment"):
        EnvPool("no-colon")


def test_sessions_answer_from_many_threads_and_spread_over_the_workers(envs):
    with make_pool(envs, kwargs={"tag": "w"}, workers=2) as pool:
        sessions = [pool.session() for _ in range(8)]
        assert sorted(s.worker.index for s in sessions) == [0] * 4 + [1] * 4
        seen: dict[int, list[str]] = {}

        def play(i: int) -> None:
            s = sessions[i]
            s.reset(seed=i, options={"sibling": i})
            seen[i] = [s.step(f"a{i}").obs, s.step("done").obs]

        threads = [threading.Thread(target=play, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert seen == {i: [f"w 1 a{i}", "w 2 done"] for i in range(8)}
        result = sessions[0].step("x")
        assert (result.reward, result.terminated, result.truncated) == (1.0, False, False)
        assert result.info["n"] == 3 and isinstance(result.info["odd"], str)  # sent as text
        assert pool.stats()["calls"] == 8 * 3 + 1 and pool.stats()["restarts"] == 0


@pytest.mark.parametrize("how", ["exit", "segfault"])
def test_a_crash_ends_its_session_and_its_neighbours_are_replayed_on_the_new_worker(envs, how):
    with make_pool(envs, workers=2) as pool:
        a, b, c, d, e = started(pool, 5)  # a, c and e on worker 0; b and d on worker 1
        assert [s.worker.index for s in (a, b, c, d, e)] == [0, 1, 0, 1, 0]
        assert c.step("x").obs == "t 1 x"
        assert e.step("random").obs  # an answer a replay cannot give again
        assert fails(a, how).kind == "crashed"
        # c's environment died with the worker: its reset and step replayed on the new one
        # gave the same answers, so it goes on where it was.
        assert c.step("y").obs == "t 2 y"
        failure = fails(e, "x")  # e's replay gives another answer: it cannot go on
        assert failure.kind == "crashed" and "not deterministic" in failure.detail
        assert b.step("x").obs == "t 1 x"
        a.close(), e.close()  # as the runner does when their episodes end
        (f,) = started(pool, 1)  # a fresh session on the replaced worker serves
        assert f.step("z").obs == "t 1 z"
        stats = pool.stats()
        assert (stats["crashed"], stats["restarts"]) == (2, 1)
        assert (stats["replays"], stats["replays_failed"]) == (1, 1)


def test_a_hang_is_killed_at_the_deadline_and_its_neighbours_go_on(envs):
    with make_pool(envs, workers=2, step_timeout_s=0.5) as pool:
        a, b, c = started(pool, 3)
        pid = pool.pids()[0]
        t0 = time.monotonic()
        failure = fails(a, "sleep")
        assert failure.kind == "timeout" and "env.step_timeout_s=0.5" in failure.detail
        assert time.monotonic() - t0 < 5
        assert not alive(pid)  # its process group was killed
        assert c.step("x").obs == "t 1 x"  # replayed on the new worker
        assert b.step("x").obs == "t 1 x"
        c.close()  # a, timed out, released itself: the runner does not close it
        (d,) = started(pool, 1)
        assert d.worker.index == 0 and d.step("z").obs == "t 1 z"
        assert pool.pids()[0] != pid
        stats = pool.stats()
        assert (stats["timeout"], stats["crashed"], stats["restarts"]) == (1, 0, 1)
        assert stats["replays"] == 1


def test_a_call_behind_a_hung_neighbour_is_served_once_the_neighbour_is_killed(envs):
    with make_pool(envs, workers=1, step_timeout_s=1.0, reset_timeout_s=0.3) as pool:
        (a,) = started(pool, 1)
        hung = threading.Thread(target=lambda: fails(a, "sleep"))
        hung.start()
        time.sleep(0.1)
        b = pool.session()
        t0 = time.monotonic()
        # It waits for the worker as long as a neighbour's step may last (then the neighbour
        # is killed), then gets its own deadline on the new worker.
        assert b.reset(seed=1) == ("start 1", {"sibling": -1})
        assert 0.5 < time.monotonic() - t0 < 1.0 + 0.3 + 10
        hung.join(10)
        assert pool.stats()["timeout"] == 1 and a.worker.sessions == 1  # b's


def test_an_oversize_reply_is_invalid_and_its_worker_replaced(envs):
    with make_pool(envs, workers=1) as pool:
        a, b = started(pool, 2)
        pid = pool.pids()[0]
        failure = fails(a, "huge")
        assert failure.kind == "invalid" and "more than 1048576" in failure.detail
        assert b.step("x").obs == "t 1 x"  # replayed on the new worker
        assert not alive(pid)
        (c,) = started(pool, 1)
        assert c.step("x").obs == "t 1 x"
        assert pool.stats()["restarts"] == 1


@pytest.mark.parametrize(
    ("action", "why"),
    [
        ("not_text", "bad observation"),
        ("nan", "must be finite"),
        ("too_big", "|reward| <= 10.0"),
        ("not_bool", "terminated=1, not a bool"),
    ],
)
def test_an_invalid_answer_ends_its_session_only_and_the_worker_is_kept(envs, action, why):
    with make_pool(envs, workers=1) as pool:
        a, b = started(pool, 2)
        pid = pool.pids()[0]
        failure = fails(a, action)
        assert failure.kind == "invalid" and why in failure.detail, failure
        assert b.step("x").obs == "t 1 x" and pool.pids() == [pid]
        assert pool.stats()["invalid"] == 1 and pool.stats()["restarts"] == 0


def test_a_raising_environment_ends_its_session_only(envs):
    with make_pool(envs, workers=1) as pool:
        a, b = started(pool, 2)
        pid = pool.pids()[0]
        failure = fails(a, "raise")
        assert failure.kind == "raised" and "the environment broke" in failure.detail
        assert b.step("x").obs == "t 1 x" and pool.pids() == [pid]
        assert pool.stats()["raised"] == 1


def test_the_parent_checks_what_a_forging_worker_sends(envs):
    """The environment's code can write to the reply channel: the parent checks again."""
    with make_pool(envs, workers=1) as pool:
        (a,) = started(pool, 1)
        worker = a.worker
        real = worker.request

        def forged(message, deadline, what):
            real(message, deadline, what)
            return [{"role": "user"}, float("nan"), "yes", False, []]

        worker.request = forged
        assert fails(a, "x").kind == "invalid"


def test_closing_leaves_no_process_behind(envs):
    pool = make_pool(envs, workers=2)
    a, b = started(pool, 2)
    grandchild = int(a.step("spawn").obs)
    workers = pool.pids()
    assert len(workers) == 2 and all(alive(p) for p in [*workers, grandchild])
    a.close()
    pool.close()
    deadline = time.monotonic() + 5
    while any(alive(p) for p in [*workers, grandchild]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in [*workers, grandchild])
    assert pool.pids() == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.session()


def test_a_later_write_to_the_file_changes_nothing(envs):
    with make_pool(envs, workers=1) as pool:
        envs.write_text("raise SystemExit('rewritten')\n")
        a, b = started(pool, 2)
        assert fails(a, "exit").kind == "crashed"
        (c,) = started(pool, 1)  # the replacement loads the copy taken at start
        assert c.step("x").obs == "t 1 x"


def test_the_sandbox_refuses_to_run_unconfined(envs, monkeypatch):
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: "/nonexistent/bwrap")
    with pytest.raises(EnvPoolError, match="env.sandbox=true: the reward sandbox could not"):
        make_pool(envs, sandbox=True)


REFUSAL = sandbox.unavailable()


@pytest.mark.skipif(REFUSAL is not None, reason=f"no sandbox here: {REFUSAL}")
def test_a_sandboxed_worker_runs_confined(envs, monkeypatch):
    monkeypatch.setenv("SPECRL_ACTOR_TOKEN", "secret")
    with make_pool(envs, workers=1, sandbox=True) as pool:
        (a,) = started(pool, 1)
        uid, pid = a.step("whoami").obs.split()
        assert int(uid) == sandbox.SANDBOX_UID and int(pid) < 10  # its own pid namespace
        assert a.step("x").obs == "t 2 x"
    with make_pool(envs, workers=1) as pool:  # unconfined: the actor's user
        (a,) = started(pool, 1)
        assert int(a.step("whoami").obs.split()[0]) == os.getuid()


def test_the_runner_on_worker_processes_gives_the_episodes_it_gives_in_process():
    from actors.engines.torch.engine import TorchEngine
    from actors.episodes.runner import episode_runner
    from common import metric_names as mn
    from common.config import load_config
    from common.link.protocol import DecodeLimits, decode, encode
    from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
    from testing.models import random_model

    tokenizer = CharTokenizer(BUILTIN_ALPHABET)
    model = random_model(tokenizer.vocab_size, seed=3)
    limits = DecodeLimits(vocab_size=tokenizer.vocab_size)

    def run(workers: int):
        cfg = load_config(["env.name=lookup", f"env.workers={workers}", "env.max_turn_tokens=8"])
        engine = TorchEngine(
            model, tokenizer.eos_id, tokenizer.pad_id, 1.0, seed=7, version=0, max_rows=8
        )
        runner = episode_runner(cfg, engine, tokenizer)
        groups, pids = [], []
        try:
            episodes = runner.run_batch([42, 43, 44], 3, None, groups.append)
            if workers:
                pids = runner.env_pool.pids()
                stats = runner.env_pool.stats()
                steps = sum(len(ep.seen) for row in episodes for ep in row)
                assert stats["calls"] == 9 + steps and stats["restarts"] == 0, stats
        finally:
            if runner.env_pool is not None:
                runner.env_pool.close()
        assert len(pids) == workers and not any(alive(p) for p in pids)
        return runner, sorted(groups, key=lambda g: g.prompt_id), episodes

    local, local_groups, _ = run(0)
    pooled, pooled_groups, episodes = run(2)
    assert len(pooled_groups) == len(local_groups) == 3
    for mine, theirs in zip(pooled_groups, local_groups, strict=True):
        assert mine.prompt_id == theirs.prompt_id
        assert mine.prompt_ids.tolist() == theirs.prompt_ids.tolist()  # same first observation
        assert encode(decode(encode(mine), limits)) == encode(mine)  # a valid v2 frame
        assert all(c.stop in ("max_turns", "env_done", "eos", "context") for c in mine.completions)
        assert all((c.token_versions < 0).any() for c in mine.completions if len(c.turn_starts) > 1)
    assert all(ep.stop and not ep.failure for row in episodes for ep in row)
    assert not any(k.startswith(mn.ENV_FAILURES_PREFIX) for k in pooled.counts)
    assert not any(k.startswith(mn.ENV_FAILURES_PREFIX) for k in local.counts)
