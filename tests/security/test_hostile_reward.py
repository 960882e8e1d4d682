"""A hostile reward against the reward sandbox: every escape attempt of
:mod:`actors.rewards.escapes` (the audit's H1 rows, a forged reply, secrets in a worker's
environment) must fail. The same attempts got through before the sandbox confined the
filesystem, the process tree and start-up; unsandboxed, most still do (the last test)."""

from __future__ import annotations

import pytest

from actors.rewards import sandbox
from actors.rewards.escapes import ATTEMPTS, NPROC_LIMIT, run_attempt, staged
from actors.rewards.pool import RewardCall, RewardPool

REFUSAL = sandbox.unavailable()
needs_sandbox = pytest.mark.skipif(
    REFUSAL is not None, reason=f"SKIPPED: this host cannot run the reward sandbox: {REFUSAL}"
)


def test_there_are_at_least_twelve_attempts():
    assert len(ATTEMPTS) >= 12
    assert len({a.name for a in ATTEMPTS}) == len(ATTEMPTS)


@needs_sandbox
@pytest.mark.parametrize("attempt", ATTEMPTS, ids=[a.name for a in ATTEMPTS])
def test_the_escape_attempt_fails(attempt):
    with staged() as stage:
        escaped, outcome = run_attempt(attempt, stage)
    assert not escaped, f"{attempt.what}: got through ({outcome})"


@needs_sandbox
def test_the_fork_bomb_is_capped_by_the_process_limit():
    (attempt,) = [a for a in ATTEMPTS if a.name == "fork_bomb"]
    with staged() as stage:
        escaped, outcome = run_attempt(attempt, stage)
    forks = float(outcome.split()[1])
    assert not escaped and 0 < forks < NPROC_LIMIT, outcome


@needs_sandbox
def test_unsandboxed_the_same_attempts_get_through():
    """The negative control: without the sandbox, the filesystem and process attempts succeed,
    so each check above can see an escape."""
    through = set()
    for attempt in ATTEMPTS:
        if attempt.name in ("shm_memory", "fork_bomb", "plant_sitecustomize"):
            continue  # host-wide side effects; checked by hand (docs/benchmarks.md)
        with staged() as stage:
            if run_attempt(attempt, stage, sandbox=False)[0]:
                through.add(attempt.name)
    assert {
        "rewrite_reward_file",
        "read_secret_file",
        "connect_unix_socket",
        "connect_tcp",
        "signal_actor",
        "write_run_dir",
        "write_specrl_code",
        "setsid_survivor",
        "read_actor_cmdline",
        "read_actor_environ",
    } <= through, through
    # What holds without the sandbox too: the environment allow-list and run_untrusted.
    assert not through & {"read_env_secrets", "read_env_secrets_unsandboxed", "forge_reply"}


@needs_sandbox
def test_the_sandbox_refuses_to_start_where_it_cannot_confine(monkeypatch, tmp_path):
    reward = tmp_path / "r.py"
    reward.write_text("def score(prompt, completion, row):\n    return 1.0\n")
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: "/nonexistent/bwrap")
    from actors.rewards.pool import RewardPoolError

    with pytest.raises(RewardPoolError, match="reward sandbox"):
        RewardPool(f"{reward}:score", sandbox=True)
    monkeypatch.undo()
    with RewardPool(f"{reward}:score", sandbox=True) as pool:
        assert pool.score([RewardCall("p", "c", {})])[0].reward == 1.0
