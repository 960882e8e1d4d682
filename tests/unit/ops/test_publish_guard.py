"""The learner refuses to start when the compose files publish its trajectory socket beyond the
loopback (SPECRL_PUBLISH_HOST) without CurveZMQ; scripts/compose-smoke.sh never passes silently
when it cannot run."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from common.config import load_config
from common.entrypoint import PUBLISH_HOST_ENV, publish_refusal
from ops.processes import ROOT, child_env

LOOPBACK = ("", "127.0.0.1", "::1", "localhost")  # "": not under the compose files
BEYOND_LOOPBACK = ("0.0.0.0", "::", "10.1.2.3")


@pytest.mark.parametrize(
    ("host", "curve_dir", "refused"),
    [
        *[(host, "", False) for host in LOOPBACK],
        *[(host, "", True) for host in BEYOND_LOOPBACK],
        ("0.0.0.0", "/keys", False),  # CurveZMQ: any host
    ],
)
def test_publish_refusal(host, curve_dir, refused):
    cfg = load_config([f"security.curve_dir={curve_dir}"] if curve_dir else [])
    reason = publish_refusal(cfg, {PUBLISH_HOST_ENV: host} if host else {})
    assert (reason is not None) == refused, reason
    if refused:
        assert f"{PUBLISH_HOST_ENV}={host}" in reason and "security.curve_dir" in reason


def test_the_learner_process_exits_with_the_reason(tmp_path):
    """`python -m learner.main`, as the compose learner command runs it, with the port published
    on every interface and no keys: it stops before training or binding anything."""
    env = child_env({PUBLISH_HOST_ENV: "0.0.0.0"})
    run = subprocess.run(
        [sys.executable, "-m", "learner.main", "run.name=guard", f"run.dir={tmp_path / 'run'}"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    assert "refusing to start" in run.stderr and "security.curve_dir" in run.stderr
    assert not (tmp_path / "run").exists()


def test_compose_smoke_skip_is_loud_and_optionally_fatal(tmp_path):
    """Without Docker (no docker, dockerd or apt-get on PATH) the smoke test skips with exit 0
    and an unmistakable marker on stdout and stderr; SPECRL_SMOKE_REQUIRE=1 makes it fail."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "date", "id", "cat"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    script = str(ROOT / "scripts" / "compose-smoke.sh")
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    bash = shutil.which("bash")
    skipped = subprocess.run(
        [bash, script], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert skipped.returncode == 0, skipped.stderr
    for stream in (skipped.stdout, skipped.stderr):
        marker = [line for line in stream.splitlines() if line.startswith("SPECRL-COMPOSE-SMOKE:")]
        assert marker and "SKIPPED" in marker[0] and "no Docker engine" in marker[0], stream
        assert "NOT built, started or checked" in stream
    required = subprocess.run(
        [bash, script],
        env={**env, "SPECRL_SMOKE_REQUIRE": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert required.returncode == 1
    assert "FAILED (SPECRL_SMOKE_REQUIRE=1)" in required.stderr
