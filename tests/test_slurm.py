"""``specrl slurm``: the sbatch script it writes is byte for byte the golden files under
tests/golden/ (regenerate them after a deliberate change with ``SPECRL_UPDATE_GOLDEN=1``), parses
(``bash -n``), passes ``shellcheck``, and does what it says when run against stand-ins for
``srun``, ``scontrol``, Redis, torchrun and the actor: secrets owner-only and off every command
line, Redis on node 0, the learner's ranks meeting at node 0, one actor per GPU on the others."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from common.entrypoint import parse
from ops.cli import main as cli_main
from ops.slurm import SlurmError, SlurmJob, render

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden"

CASES = {
    # 3 nodes x 8 GPUs from a shared virtual environment: learner on node 0, 16 actors.
    "slurm_venv.sbatch": [
        "--run-name", "exp1", "--nodes", "3", "--gpus-per-node", "8",
        "--shared-dir", "/shared/specrl", "--venv", "/shared/venvs/specrl",
        "--actor-args", "engine=vllm",
    ],
    # 4 nodes x 4 GPUs from a container image (pyxis): learner on 2 nodes, 8 actors.
    "slurm_pyxis.sbatch": [
        "--run-name", "exp2", "--nodes", "4", "--gpus-per-node", "4", "--learner-nodes", "2",
        "--shared-dir", "/lustre/me/specrl", "--image", "nvcr.io#me/specrl:latest",
        "--mount", "/lustre/models", "--mount", "/lustre/data",
        "--partition", "gpu", "--account", "rl", "--time", "2-00:00:00",
        "--redis-maxmemory", "128gb",
        "--learner-args", "run.steps=2000 model.path=/lustre/models/Qwen2.5-7B",
        "--actor-args", "engine=vllm +engine.vllm_kwargs.gpu_memory_utilization=0.85",
    ],
}  # fmt: skip


def dry_run(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli_main(["slurm", "--dry-run", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("golden", sorted(CASES))
def test_dry_run_matches_the_golden_file(golden: str, capsys: pytest.CaptureFixture[str]) -> None:
    script = dry_run(CASES[golden], capsys)
    path = GOLDEN / golden
    if os.environ.get("SPECRL_UPDATE_GOLDEN") == "1":
        path.write_text(script)
    assert script == path.read_text(), f"regenerate with SPECRL_UPDATE_GOLDEN=1 if meant: {path}"


@pytest.mark.parametrize("golden", sorted(CASES))
def test_golden_files_parse_and_pass_shellcheck(golden: str) -> None:
    path = GOLDEN / golden
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; .ci/run does)")
    done = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def job(**changes: object) -> SlurmJob:
    base: dict[str, object] = {
        "run_name": "exp",
        "nodes": 2,
        "gpus_per_node": 2,
        "shared_dir": "/shared",
        "venv": "/venv",
    }
    return SlurmJob(**{**base, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"nodes": 1}, "must exceed --learner-nodes"),
        ({"nodes": 3, "learner_nodes": 3}, "must exceed --learner-nodes"),
        ({"gpus_per_node": 0}, "at least 1"),
        ({"run_name": "a b"}, "--run-name"),
        ({"shared_dir": "relative/dir"}, "--shared-dir"),
        ({"shared_dir": "/shared/$(id)"}, "--shared-dir"),
        ({"shared_dir": "/shared/../etc"}, "--shared-dir"),
        ({"image": "img"}, "exactly one of --venv"),
        ({"mounts": ("/models",)}, "--mount needs --image"),
        ({"venv": "", "image": "img", "mounts": ("/a,/b",)}, "--mount must be"),
        ({"venv": ""}, "exactly one of --venv"),
        ({"time": "1-00:00:00; rm"}, "--time"),
        ({"redis_maxmemory": "lots"}, "--redis-maxmemory"),
        ({"learner_args": ("run.steps",)}, "not a KEY=VALUE"),
        ({"actor_args": ("redis.url=redis://:hunter2@h:6379/0",)}, "set by the script"),
        ({"actor_args": ("+redis.password=hunter2",)}, "no secret on a command line"),
        ({"actor_args": ("actor.index=3",)}, "set by the script"),
    ],
)
def test_refuses_a_job_that_cannot_work(changes: dict, message: str) -> None:
    with pytest.raises(SlurmError, match=re.escape(message)):
        job(**changes)


def test_cli_refusal_exits_2_and_no_dry_run_writes_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--run-name", "exp", "--nodes", "2", "--gpus-per-node", "1", "--venv", "/v"]
    assert cli_main(["slurm", *args, "--shared-dir", str(tmp_path), "--nodes", "1"]) == 2
    assert "must exceed" in capsys.readouterr().err
    assert cli_main(["slurm", *args, "--shared-dir", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert cli_main(["slurm", *args, "--shared-dir", str(tmp_path)]) == 0
    written = tmp_path / "exp" / "specrl.sbatch"
    assert capsys.readouterr().out.strip() == f"sbatch {written}"
    assert stat.S_IMODE(written.parent.stat().st_mode) == 0o700
    assert written.read_text() == render(job(gpus_per_node=1, shared_dir=str(tmp_path), venv="/v"))


STAND_INS = {
    # srun: log the call, drop the options, run the command as task 0 of node 0.
    "srun": """#!/bin/bash
args="$*"
printf 'srun %s\\n' "${args//$'\\n'/ }" >>"$LOG"
while [ $# -gt 0 ] && [[ $1 == --* ]]; do shift; done
export SLURM_PROCID=0 SLURM_NODEID=0
exec "$@"
""",
    "scontrol": "#!/bin/sh\nprintf 'node1\\nnode2\\nnode3\\n'\n",
    # python -c: the Redis binary's path, else "Redis is up and has the version".
    "python": """#!/bin/sh
case "$*" in *find_redis_server_binary*) command -v redis-server ;; esac
exit 0
""",
    "specrl": f'#!/bin/sh\nexec "{ROOT}/.venv/bin/specrl" "$@"\n',
    "redis-server": '#!/bin/sh\nprintf "%s\\n" "$@" >"$LOG.redis"\nexec sleep 60\n',
    # The learner "trains" until Redis and the actor have started, then finishes the run.
    "torchrun": """#!/bin/sh
printf "%s\\n" "$@" >"$LOG.learner"
for _ in $(seq 200); do [ -e "$LOG.redis" ] && [ -e "$LOG.actor" ] && exit 0; sleep 0.1; done
exit 3
""",
    "specrl-actor": '#!/bin/sh\nprintf "%s\\n" "$@" >"$LOG.actor"\nexec sleep 60\n',
}


def run_job(tmp_path: Path, script: Path) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "LOG": str(tmp_path / "log"),
        "SLURM_JOB_NODELIST": "node[1-3]",
        "SLURM_CPUS_ON_NODE": "16",
    }
    return subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.skipif(not (ROOT / ".venv/bin/specrl").exists(), reason="needs .venv (setup.sh)")
def test_the_script_runs_against_stand_ins(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name, text in STAND_INS.items():
        (venv / "bin" / name).write_text(text)
        (venv / "bin" / name).chmod(0o755)
    shared = tmp_path / "shared"
    the_job = job(
        nodes=3, gpus_per_node=8, shared_dir=str(shared), venv=str(venv),
        actor_args=("actor.outbox_max=16",),
    )  # fmt: skip
    script = tmp_path / "job.sbatch"
    script.write_text(render(the_job))
    done = run_job(tmp_path, script)
    assert done.returncode == 0, done.stdout + done.stderr
    secrets = shared / "exp" / "secrets"
    password = (secrets / "redis-password").read_text()
    assert re.fullmatch(r"[0-9a-f]{48}", password)
    assert (secrets / "redis.conf").read_text() == f"requirepass {password}\n"
    modes = {p.relative_to(secrets): stat.S_IMODE(p.stat().st_mode) for p in secrets.rglob("*")}
    assert modes[Path("curve/learner.key_secret")] == modes[Path("redis.conf")] == 0o600
    assert modes[Path("curve/authorized")] == 0o700 and Path("curve/actor.key_secret") in modes
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o700
    assert all(mode & 0o077 == 0 for mode in modes.values()), modes
    log = (tmp_path / "log").read_text()
    everything = log + "".join(
        (tmp_path / f"log.{s}").read_text() for s in ("redis", "learner", "actor")
    )
    assert password not in everything
    steps = log.splitlines()
    redis = next(s for s in steps if "redis.conf" in s)
    assert "--nodelist=node1" in redis and "--gres=none" in redis
    learner = next(s for s in steps if "torchrun" in s)
    assert "--nodes=1" in learner and "--nodelist=node1" in learner
    actors = next(s for s in steps if "specrl-actor" in s)
    for option in ("--nodes=2", "--ntasks-per-node=8", "--gpus-per-task=1", "--cpus-per-task=2"):
        assert option in actors
    assert "--nodelist=node2,node3" in actors
    rank = (tmp_path / "log.learner").read_text().splitlines()
    assert rank[:6] == ["--nnodes=1", "--nproc-per-node=8", "--node-rank=0"] + [
        "--master-addr=node1",
        "--master-port=29500",
        "-m",
    ]
    learner_cfg = parse(rank[7:], "specrl-learner", "")
    assert learner_cfg.redis.url == "redis://node1:6379/0"
    assert learner_cfg.learner.address == "tcp://node1:5555"
    assert learner_cfg.security.curve_dir == str(secrets / "curve")
    actor_cfg = parse((tmp_path / "log.actor").read_text().splitlines(), "specrl-actor", "")
    assert actor_cfg.actor.index == 0 and actor_cfg.actor.actor_id == "exp-actor-0"
    assert actor_cfg.actor.outbox_max == 16 and actor_cfg.actor.device == "cuda"
    assert actor_cfg.security.curve_dir == learner_cfg.security.curve_dir

    # A resubmitted job keeps the run's password and keys; one that finds a secret readable
    # beyond its owner refuses to start.
    key = (secrets / "curve" / "learner.key_secret").read_text()
    assert run_job(tmp_path, script).returncode == 0
    assert (secrets / "redis-password").read_text() == password
    assert (secrets / "curve" / "learner.key_secret").read_text() == key
    (secrets / "redis-password").chmod(0o644)
    done = run_job(tmp_path, script)
    assert done.returncode == 1 and "readable beyond their owner" in done.stderr
    assert "redis-password" in done.stderr
