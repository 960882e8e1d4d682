"""The actor leaves a rollout in flight at the next decoding step once a stop is requested."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors.loop import ActorPhases, GenerationStopped


def test_weight_source_raises_once_a_stop_is_requested() -> None:
    flag = {"stop": False}
    fetched = []
    phases = SimpleNamespace(stop=lambda: flag["stop"], fetch=lambda: fetched.append(1))
    assert ActorPhases.weight_source(phases) is None  # type: ignore[arg-type]
    assert fetched == [1]
    flag["stop"] = True
    with pytest.raises(GenerationStopped):
        ActorPhases.weight_source(phases)  # type: ignore[arg-type]
    assert fetched == [1]  # no fetch once stopping


def test_the_actor_process_ends_without_the_interpreters_teardown(tmp_path) -> None:
    """``actors.main.exit_now``: the exit code kept, logs and stdout flushed, and no teardown
    waited for (an atexit hook that would sleep a minute does not run), which is what kept vLLM
    actors past the launcher's grace period."""
    import subprocess
    import sys

    from ops.processes import ROOT

    code = (
        "import atexit, logging, sys, time\n"
        "from actors.main import exit_now\n"
        "atexit.register(time.sleep, 60)\n"
        "logging.basicConfig(stream=sys.stderr)\n"
        "logging.getLogger('actor').warning('last words')\n"
        "print('buffered', end='')\n"
        "exit_now(3)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered"
    assert "last words" in done.stderr
