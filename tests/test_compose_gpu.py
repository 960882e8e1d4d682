"""GPU placement and sizes of the compose stack (scripts/compose_gpu.py, docker-compose.override.yml)
and the Redis the stack runs.

The layouts are checked on what Compose itself makes of the files (`docker compose config`, or
`docker-compose config`); Redis is started with the compose file's own command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch
import yaml
from safetensors.torch import save_file

from common.config.learner import LearnerConfig
from common.config.run import RedisConfig
from ops.redis_server import find_free_port, find_redis_server_binary
from testing.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "compose_gpu.py"
compose_gpu = load_script("compose_gpu")


def compose_command() -> list[str] | None:
    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        probe = subprocess.run([*command, "version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return command
    return None


COMPOSE = compose_command()
needs_compose = pytest.mark.skipif(COMPOSE is None, reason="no docker compose / docker-compose")


def config(*files: Path, **env: str) -> dict:
    """The stack as Compose reads ``files`` (interpolated with REDIS_PASSWORD=x and ``env``)."""
    args = [a for f in files for a in ("-f", str(f))]
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DOCKER_"))}
    out = subprocess.run(
        [*COMPOSE, "--project-directory", str(ROOT), *args, "config"],
        capture_output=True,
        text=True,
        env={**run_env, "REDIS_PASSWORD": "x", **env},
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def generate(tmp_path: Path, *args: str) -> tuple[int, str, Path]:
    """Runs the script as a user would; returns its exit status, stderr and the output path."""
    out = tmp_path / "docker-compose.gpu.yml"
    env = {k: v for k, v in os.environ.items() if k not in ("GPUS", "LEARNER_GPUS", "ACTORS")}
    env["PATH"] = os.defpath  # no nvidia-smi: --gpus is what counts
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "-o", str(out)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    return run.returncode, run.stderr, out


def gpus_of(service: dict) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1 and "count" not in devices[0], devices
    return devices[0]["device_ids"]


def actors(stack: dict) -> dict[str, dict]:
    return {n: s for n, s in stack["services"].items() if n == "actor" or n.startswith("actor-")}


def check_placement(stack: dict, node_gpus: int) -> dict[str, list[str]]:
    """Every actor on GPUs no other actor has, none of them the learner's unless the node has
    one GPU; the learner's torchrun ranks match its GPUs. Returns service -> GPUs."""
    services = stack["services"]
    learner = gpus_of(services["learner"])
    assert services["learner"]["environment"]["LEARNER_GPUS"] == str(len(learner))
    placed = {"learner": learner}
    seen: set[str] = set()
    for name, service in actors(stack).items():
        ids = gpus_of(service)
        assert service.get("deploy", {}).get("replicas", 1) == 1, name
        assert not seen & set(ids), f"{name} shares GPUs {ids} with another actor"
        seen |= set(ids)
        if node_gpus > 1:
            assert not set(ids) & set(learner), f"{name} shares GPUs with the learner"
        placed[name] = ids
    used = {int(i) for ids in placed.values() for i in ids}
    assert used <= set(range(node_gpus)), used
    indices = [s["environment"]["SPECRL_ACTOR_INDEX"] for s in actors(stack).values()]
    assert sorted(indices, key=int) == [str(i) for i in range(len(indices))]
    return placed


def without_placement(service: dict) -> dict:
    """An actor service less what differs between actors."""
    service = json.loads(json.dumps(service))
    service.pop("deploy")
    for key in ("SPECRL_ACTOR_INDEX", "SPECRL_NODE_ARGS"):
        service["environment"].pop(key, None)
    return service


@pytest.fixture(scope="module")
def default_stack() -> dict:
    """`docker compose up` with no -f: docker-compose.yml and docker-compose.override.yml."""
    return config(ROOT / "docker-compose.yml", ROOT / "docker-compose.override.yml")


@needs_compose
def test_default_files_validate_and_share_gpu_0(default_stack):
    placed = check_placement(default_stack, node_gpus=1)
    assert placed == {"learner": ["0"], "actor": ["0"]}
    node_args = default_stack["services"]["actor"]["environment"]["SPECRL_NODE_ARGS"]
    assert node_args == "+engine.vllm_kwargs.gpu_memory_utilization=0.3"


@needs_compose
def test_eight_gpus(tmp_path):
    rc, err, out = generate(tmp_path, "--gpus", "8", "--learner-gpus", "4")
    assert rc == 0, err
    stack = config(ROOT / "docker-compose.yml", out)
    placed = check_placement(stack, node_gpus=8)
    assert len(placed) == 5 and placed["learner"] == ["0", "1", "2", "3"]
    # Actors on GPUs of their own run vLLM's default share; the services differ in nothing else.
    services = actors(stack)
    assert all("SPECRL_NODE_ARGS" not in s["environment"] for s in services.values())
    reference = without_placement(services["actor"])
    assert all(without_placement(s) == reference for s in services.values())
    assert reference["environment"]["SPECRL_ACTOR_DEVICE"] == "cuda"

    # Two GPUs per actor: vLLM tensor parallelism over them; 3 actors fit beside 2 learner GPUs.
    rc, err, out = generate(tmp_path, "--gpus", "8", "--learner-gpus", "2", "--gpus-per-actor", "2")
    assert rc == 0, err
    stack = config(ROOT / "docker-compose.yml", out)
    placed = check_placement(stack, node_gpus=8)
    assert [len(ids) for ids in placed.values()] == [2, 2, 2, 2]
    for service in actors(stack).values():
        assert "engine.vllm_tensor_parallel_size=2" in service["environment"]["SPECRL_NODE_ARGS"]


@needs_compose
def test_one_gpu_layout_is_the_default_one(tmp_path, default_stack):
    """The script's 1-GPU layout is what docker-compose.override.yml gives: nothing drifts."""
    rc, err, out = generate(tmp_path, "--gpus", "1")
    assert rc == 0, err
    assert config(ROOT / "docker-compose.yml", out) == default_stack


@needs_compose
def test_a_learner_sharing_its_gpu_plans_for_what_vllm_leaves(tmp_path):
    """On one GPU the fit check plans for the GPU less the actor's vLLM share (and 5%), not for
    what happens to be free when the learner starts; with GPUs of its own it measures them."""
    rc, err, out = generate(tmp_path, "--gpus", "1", "--gpu-memory-gib", "80")
    assert rc == 0, err
    stack = config(ROOT / "docker-compose.yml", out)
    learner_args = stack["services"]["learner"]["environment"]["SPECRL_NODE_ARGS"].split()
    assert "learner.device_memory_gib=52.0" in learner_args  # 80 x (1 - 0.3 - 0.05)
    rc, err, out = generate(
        tmp_path, "--gpus", "1", "--gpu-memory-gib", "80", "--actor-gpu-memory", "0.5"
    )
    assert rc == 0, err
    learner_env = config(ROOT / "docker-compose.yml", out)["services"]["learner"]["environment"]
    assert "learner.device_memory_gib=36.0" in learner_env["SPECRL_NODE_ARGS"].split()
    rc, err, out = generate(tmp_path, "--gpus", "2", "--gpu-memory-gib", "80")
    assert rc == 0, err
    learner_env = config(ROOT / "docker-compose.yml", out)["services"]["learner"]["environment"]
    assert "device_memory_gib" not in learner_env.get("SPECRL_NODE_ARGS", "")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gpus", "8", "--learner-gpus", "8"], "no GPU left for an actor"),
        (
            ["--gpus", "4", "--actors", "4"],
            "the layout needs 5 GPUs (learner 1 + 4 actor(s) x 1), the node has 4",
        ),
        (["--gpus", "8", "--learner-gpus", "4", "--gpus-per-actor", "8"], "no GPU left"),
        (["--gpus", "1", "--learner-gpus", "2"], "a 1-GPU node holds the learner and one actor"),
        (["--gpus", "1", "--actors", "2"], "a 1-GPU node holds the learner and one actor"),
        (["--gpus", "0"], "gpus must be >= 1"),
        ([], "give --gpus N"),
        (["--gpus", "2", "--actor-gpu-memory", "1.5"], "--actor-gpu-memory must be in (0, 1)"),
        (["--gpus", "2", "--model-dir", "/nonexistent"], "no such directory"),
        (["--gpus", "1", "--gpu-memory-gib", "0"], "--gpu-memory-gib must be > 0"),
    ],
)
def test_bad_layouts_are_refused(tmp_path, args, message):
    rc, err, out = generate(tmp_path, *args)
    assert rc == 2 and message in err, err
    assert not out.exists()


def test_gpus_beyond_what_nvidia_smi_lists_are_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(compose_gpu, "visible_gpus", lambda: 2)
    assert compose_gpu.main(["--gpus", "8", "-o", str(tmp_path / "x.yml")]) == 2
    assert "--gpus 8, but nvidia-smi -L lists 2 GPU(s) here" in capsys.readouterr().err
    assert compose_gpu.main(["-o", str(tmp_path / "x.yml")]) == 0  # the listed count by default
    assert set(compose_gpu.plan(2)) == {"learner", "actor"}


def write_model(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    path.mkdir()
    (path / "config.json").write_text("{}")
    save_file(
        {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()},
        path / "model.safetensors",
    )


def size_bytes(size: str) -> int:
    m = re.fullmatch(r"(\d+)gb?", size)
    assert m, size
    return int(m[1]) * 2**30


def test_sizes_follow_the_model(tmp_path):
    write_model(tmp_path / "m", {"embed": (300, 64), "w": (64, 64), "bias": (64,)})
    assert compose_gpu.model_parameters(tmp_path / "m") == 300 * 64 + 64 * 64 + 64
    # The script's copies of the defaults its formulas use are the config's.
    assert RedisConfig().retention == compose_gpu.REDIS_RETENTION
    assert LearnerConfig().publish_max_inflight == compose_gpu.PUBLISH_MAX_INFLIGHT
    # An 8B model in bf16: V = 16.1e9 bytes.
    params = 8_030_000_000
    version = 2 * params
    size = compose_gpu.sizes(params, "bfloat16")
    gib = 2**30  # sizes round up to whole GiB
    assert 3 * version <= size_bytes(size["weights_cache"]) <= 3.15 * version + gib
    redis_bytes = size_bytes(size["redis_maxmemory"])
    # The longest delta chain the weight store keeps (tests/test_compose_gpu_host.py).
    chain = compose_gpu.chain_versions() * version
    assert chain + gib <= redis_bytes <= chain + 2 * gib
    assert size["redis_maxmemory"].endswith("gb")  # Redis's unit
    assert 2 * version <= size_bytes(size["learner_shm"]) <= 2 * version + 5 * gib
    assert compose_gpu.sizes(params, "float32")["weights_cache"] != size["weights_cache"]
    # The learner's wait for a group covers an actor's cold start: longer for a bigger version.
    assert (
        600
        < int(size["group_timeout_s"])
        < int(compose_gpu.sizes(params, "float32")["group_timeout_s"])
    )


@needs_compose
def test_model_and_data_mounts(tmp_path):
    write_model(tmp_path / "model", {"w": (1024, 1024)})
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text('{"prompt": "1+1", "answer": 2}\n')
    rc, err, out = generate(
        tmp_path, "--gpus", "4", "--model-dir", str(tmp_path / "model"), "--data-file", str(data)
    )
    assert rc == 0, err
    stack = config(ROOT / "docker-compose.yml", out)
    check_placement(stack, node_gpus=4)
    mounts = {f"{tmp_path / 'model'}:/model:ro", f"{data.parent}:/data:ro"}
    for name in ("learner", *actors(stack)):
        service = stack["services"][name]
        assert mounts <= set(service["volumes"]), (name, service["volumes"])
        node_args = service["environment"]["SPECRL_NODE_ARGS"].split()
        assert {"model.path=/model", "task=dataset", "task.path=/data/train.jsonl"} <= set(
            node_args
        )
    learner_args = stack["services"]["learner"]["environment"]["SPECRL_NODE_ARGS"]
    assert "learner.publish_dtype=bfloat16" in learner_args
    assert "learner.group_timeout_s=601" in learner_args.split()  # 2 MiB in bf16
    # Sizes from the model (1 GiB at least), each overridable by its variable.
    assert "size=1g," in stack["volumes"]["weights-cache"]["driver_opts"]["o"]
    overridden = config(
        ROOT / "docker-compose.yml", out, ACTOR_WEIGHTS_CACHE_SIZE="7g", REDIS_MAXMEMORY="9gb"
    )
    assert "size=7g," in overridden["volumes"]["weights-cache"]["driver_opts"]["o"]
    assert overridden["services"]["redis"]["environment"]["SPECRL_REDIS_MAXMEMORY"] == "9gb"
    timeout = config(ROOT / "docker-compose.yml", out, LEARNER_GROUP_TIMEOUT_S="3600")
    assert "learner.group_timeout_s=3600" in (
        timeout["services"]["learner"]["environment"]["SPECRL_NODE_ARGS"].split()
    )


def test_node_args_reach_the_processes_before_the_user_args():
    """The learner's command and docker/actor.sh pass SPECRL_NODE_ARGS, then the user's ARGS."""
    base = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    learner = base["services"]["learner"]["command"]
    assert learner.index("$${SPECRL_NODE_ARGS:-}") < learner.index("${LEARNER_ARGS:-}")
    actor_sh = (ROOT / "docker" / "actor.sh").read_text()
    assert '${SPECRL_NODE_ARGS:-} "$@"' in actor_sh
    assert "index=${SPECRL_ACTOR_INDEX:-" in actor_sh


def redis_script() -> str:
    """The script of the compose file's Redis command (``sh -c '<script>'``), as the container's
    shell gets it ($$ is Compose's escape of $)."""
    command = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["redis"][
        "command"
    ]
    argv = shlex.split(command)
    assert argv[:2] == ["sh", "-c"] and len(argv) == 3, argv
    return argv[2].replace("$$", "$")


def start_compose_redis(tmp_path: Path, env: dict[str, str]) -> subprocess.Popen:
    """The compose file's Redis command run by sh, with ``redis-server`` on PATH and its config
    file under ``tmp_path / "tmp"`` (TMPDIR)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").symlink_to(find_redis_server_binary())
    (tmp_path / "tmp").mkdir()
    (tmp_path / "data").mkdir()
    run_env = {"PATH": f"{bin_dir}:{os.defpath}", "TMPDIR": str(tmp_path / "tmp"), **env}
    return subprocess.Popen(
        ["sh", "-c", redis_script()],
        cwd=tmp_path / "data",
        env=run_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def compose_redis_env(port: int, password: str) -> dict[str, str]:
    """The compose stack's Redis settings: ``port`` on the loopback, ``password``, 8 MiB."""
    return {
        "SPECRL_REDIS_PORT": str(port),
        "SPECRL_REDIS_BIND": "127.0.0.1",
        "REDIS_PASSWORD": password,
        "SPECRL_REDIS_MAXMEMORY": "8mb",
    }


@contextlib.contextmanager
def compose_redis(
    tmp_path: Path, env: dict[str, str]
) -> Iterator[tuple[subprocess.Popen, redis.Redis]]:
    """Within: :func:`start_compose_redis`'s process and a client (``env``'s port and password)
    that it has answered; the process is killed on the way out."""
    proc = start_compose_redis(tmp_path, env)
    try:
        client = redis.Redis(port=int(env["SPECRL_REDIS_PORT"]), password=env["REDIS_PASSWORD"])
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            client.ping()  # still not up after 10 s: its error
        yield proc, client
    finally:
        proc.kill()
        proc.wait()


def test_redis_keeps_weights_in_memory_only_and_refuses_past_maxmemory(tmp_path):
    """The compose file's Redis command, run for real: no AOF, no RDB save rules, and a write
    past maxmemory fails instead of evicting what is stored."""
    with compose_redis(tmp_path, compose_redis_env(find_free_port(), "pw")) as (_, client):
        assert client.config_get("save")["save"] == ""
        assert client.config_get("appendonly")["appendonly"] == "no"
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        assert int(client.config_get("maxmemory")["maxmemory"]) == 8 * 2**20
        chunk = b"x" * 2**20
        stored = 0
        with pytest.raises(redis.exceptions.OutOfMemoryError, match="maxmemory"):
            for i in range(64):
                client.set(f"weights:run:1:chunk:{i}", chunk)
                stored += 1
        # Nothing stored was evicted to make room.
        assert 0 < stored < 64
        assert all(client.exists(f"weights:run:1:chunk:{i}") for i in range(stored))
    assert not list((tmp_path / "data").iterdir()), "Redis wrote files"


def test_redis_password_reaches_the_server_in_a_0600_file_not_its_argv(tmp_path):
    """The compose file's Redis command, run by sh: the process that execs redis-server has no
    password in its argv (what /proc/<pid>/cmdline shows any user of the host), the config
    file holding it is 0600, Redis refuses clients without it; a password the config file
    cannot hold is refused before Redis starts."""
    port = find_free_port()
    password = "c0ffee+/=-_.pw"
    env = compose_redis_env(port, password)
    with compose_redis(tmp_path, env) as (proc, _):
        assert password.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        conf = tmp_path / "tmp" / "specrl-redis.conf"
        assert conf.stat().st_mode & 0o777 == 0o600
        assert conf.read_text() == f"requirepass {password}\n"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).get("k")
    # sh execs redis-server, so the argv above was redis-server's as exec'd: the script
    # passes the config file, never the value.
    script = redis_script()
    tail = script.split("exec redis-server", 1)[1]
    assert "PASSWORD" not in tail and tail.lstrip().startswith('"$conf"')

    bad = tmp_path / "bad"
    bad.mkdir()
    proc = start_compose_redis(bad, {**env, "REDIS_PASSWORD": 'two words"'})
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and b"REDIS_PASSWORD may hold" in err
    assert not (bad / "tmp" / "specrl-redis.conf").exists()


def test_published_ports_in_generated_files():
    """What scripts/compose_gpu.py writes publishes like docker-compose.override.yml: the
    loopback by default, SPECRL_PUBLISH_HOST when set, and the learner knows which."""
    from tests.test_deployment_files import check_published_ports

    for layout in (compose_gpu.plan(1), compose_gpu.plan(8, 4), compose_gpu.plan(4, 2, 2)):
        check_published_ports(compose_gpu.render(layout))


@needs_compose
def test_compose_publishes_on_the_loopback_unless_told(default_stack):
    """As Compose reads the default GPU stack: host_ip 127.0.0.1, or SPECRL_PUBLISH_HOST."""

    def host_and_target(port: dict | str) -> tuple[str, str]:
        # Compose v2 prints the long syntax (a mapping); docker-compose 1.29 the short one,
        # "[HOST_IP:]PUBLISHED:TARGET[/PROTO]".
        if isinstance(port, dict):
            return port.get("host_ip", ""), str(port["target"])
        parts = str(port).split("/")[0].rsplit(":", 2)
        return (parts[0] if len(parts) == 3 else ""), parts[-1]

    def hosts(stack: dict) -> dict[str, str]:
        services = stack["services"]
        return {
            target: host
            for name in ("learner", "redis")
            for host, target in map(host_and_target, services[name].get("ports", []))
        }

    assert hosts(default_stack) == {"5555": "127.0.0.1", "9400": "127.0.0.1", "6379": "127.0.0.1"}
    wide = config(
        ROOT / "docker-compose.yml",
        ROOT / "docker-compose.override.yml",
        SPECRL_PUBLISH_HOST="0.0.0.0",
    )
    assert hosts(wide) == {"5555": "0.0.0.0", "9400": "127.0.0.1", "6379": "0.0.0.0"}
    assert wide["services"]["learner"]["environment"]["SPECRL_PUBLISH_HOST"] == "0.0.0.0"
