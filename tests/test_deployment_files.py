"""The compose files and Dockerfiles agree with the code and with each other.

These read the files only. `scripts/compose-smoke.sh` (run by `.ci/run`) starts the CPU stack
for real: docker-compose.yml + docker-compose.cpu.yml, with Redis, the learner and 2 actors.
"""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SERVICES = {"redis", "learner", "actor"}


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / name).read_text())


def test_shared_stack_wiring():
    """docker-compose.yml: what the GPU and the CPU variants share."""
    compose = load("docker-compose.yml")
    services = compose["services"]
    assert set(services) == SERVICES
    redis, learner, actor = services["redis"], services["learner"], services["actor"]
    # The password reaches redis-server in a config file (tests/test_compose_gpu.py runs it).
    assert 'printf "requirepass %s\\n" "$$REDIS_PASSWORD"' in redis["command"]
    assert "umask 077" in redis["command"] and "healthcheck" in redis
    # Weights in memory only: no persistence, bounded, nothing evicted (tests/test_compose_gpu.py
    # runs this command line).
    for option in ("--appendonly no", '--save ""', "--maxmemory-policy noeviction"):
        assert option in redis["command"], option
    assert "volumes" not in redis and "redis-data" not in compose["volumes"]
    assert "healthcheck" in learner
    assert learner["depends_on"]["redis"]["condition"] == "service_healthy"
    assert actor["depends_on"]["learner"]["condition"] == "service_healthy"
    # Entry points and overrides the code actually has; addresses from the SPECRL_* variables.
    # Above one GPU the learner runs under torchrun (FSDP2 ranks); one GPU: one process.
    command = learner["command"]
    assert 'torchrun --standalone --nproc-per-node "$$LEARNER_GPUS" -m learner.main' in command
    assert "else set -- specrl-learner" in command
    assert compose["x-specrl-env"]["LEARNER_GPUS"] == "${LEARNER_GPUS:-1}"
    assert "learner.bind=tcp://$$SPECRL_LEARNER_BIND:$$SPECRL_LEARNER_PORT" in learner["command"]
    assert "redis.url=redis://$$SPECRL_REDIS_HOST:$$SPECRL_REDIS_PORT/0" in learner["command"]
    assert "/app/docker/actor.sh" in actor["command"]
    env = compose["x-specrl-env"]
    # The learner and actors read the password from the environment (common/config/run.py), as
    # SPECRL_REDIS_PASSWORD only; the bare REDIS_PASSWORD is the redis service's alone (its
    # config file and health check), so a reward worker's environment never holds it.
    assert env["SPECRL_REDIS_PASSWORD"] == "${REDIS_PASSWORD:?set REDIS_PASSWORD}"
    assert "REDIS_PASSWORD" not in env
    assert env["SPECRL_REDIS_HOST"] == "redis" and env["SPECRL_LEARNER_HOST"] == "learner"
    for name, service in services.items():
        own = {"REDIS_PASSWORD": env["SPECRL_REDIS_PASSWORD"]} if name == "redis" else {}
        assert service["environment"] == {**env, **own}, name
        # Published ports live in the GPU override: host networking (CPU) cannot have them.
        assert "ports" not in service
        assert "resources" not in service.get("deploy", {})
    assert actor["restart"] == "on-failure" and learner["restart"] == "on-failure"
    assert "replicas" in actor["deploy"]
    assert "runs:/runs" in learner["volumes"] and "runs" in compose["volumes"]
    # One fetch per host: the replicas share one in-memory folder as redis.host_cache_dir.
    assert f"weights-cache:{env['SPECRL_HOST_CACHE_DIR']}" in actor["volumes"]
    cache = compose["volumes"]["weights-cache"]["driver_opts"]
    assert cache["type"] == "tmpfs" and "size=${ACTOR_WEIGHTS_CACHE_SIZE:-40g}" in cache["o"]


def test_gpu_override_reserves_gpus_and_publishes_ports():
    """docker-compose.override.yml: read by `docker compose up` with no -f (the GPU node).
    tests/test_compose_gpu.py checks the placement as Compose reads it."""
    services = load("docker-compose.override.yml")["services"]
    for name in ("learner", "actor"):
        gpu = services[name]["deploy"]["resources"]["reservations"]["devices"][0]
        assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
        # Explicit devices: `count: N` gives every container GPUs 0..N-1.
        assert gpu["device_ids"] == ["0"] and "count" not in gpu
    # A final checkpoint of a large model outlasts Docker's 10 s stop grace.
    assert services["learner"]["stop_grace_period"] == "${LEARNER_STOP_GRACE:-15m}"
    assert services["learner"]["healthcheck"]["start_period"] == "${LEARNER_START_PERIOD:-30m}"
    assert services["actor"]["environment"]["SPECRL_ACTOR_DEVICE"] == "cuda"
    # Docker's 64 MB /dev/shm is too small for vLLM's engine processes and the learner's snapshot.
    assert services["actor"]["shm_size"] == "${ACTOR_SHM_SIZE:-8gb}"
    assert services["learner"]["shm_size"] == "${LEARNER_SHM_SIZE:-40gb}"
    assert any(p.endswith(":5555") for p in services["learner"]["ports"])
    assert any(p.startswith("127.0.0.1:") for p in services["learner"]["ports"])
    assert any(p.endswith(":6379") for p in services["redis"]["ports"])
    check_published_ports(load("docker-compose.override.yml"))


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ``${NAME}``, ``${NAME:-default}`` and ``$$`` in ``text``, from ``env``."""

    def one(match: re.Match) -> str:
        name, default = match.group(1), match.group(3)
        return env.get(name) or (default if default is not None else "")

    return re.sub(r"\$\{(\w+)(:-([^}]*))?\}", one, text).replace("$$", "$")


def published(service: dict, env: dict[str, str]) -> dict[str, str]:
    """Container port -> host interface each ``HOST:PORT:PORT`` entry publishes it on ("" for
    an entry without a host: every interface)."""
    out = {}
    for entry in service.get("ports", []):
        parts = interpolate(str(entry), env).split(":")
        out[parts[-1]] = parts[0] if len(parts) == 3 else ""
    return out


def check_published_ports(stack: dict) -> None:
    """A GPU stack (docker-compose.override.yml, or what scripts/compose_gpu.py writes): the
    trajectory socket and Redis are published on the loopback unless SPECRL_PUBLISH_HOST says
    otherwise, /metrics always on the loopback, and the learner is told the host it is
    published on (it refuses a wider one without CurveZMQ)."""
    services = stack["services"]
    learner = services["learner"]
    for env, host in (({}, "127.0.0.1"), ({"SPECRL_PUBLISH_HOST": "0.0.0.0"}, "0.0.0.0")):
        assert published(learner, env) == {"5555": host, "9400": "127.0.0.1"}, env
        assert published(services["redis"], env) == {"6379": host}, env
        told = interpolate(learner["environment"]["SPECRL_PUBLISH_HOST"], env)
        assert told == host, env
        for name, service in services.items():
            if name not in ("learner", "redis"):
                assert "ports" not in service, name


def test_no_secret_on_a_command_line():
    """Any user of the host reads container processes' argv in /proc/*/cmdline: the Redis
    password is given to redis-server, redis-cli and specrl only through the environment or a
    0600 file, in every compose file and entry script."""
    texts = {
        name: (ROOT / name).read_text()
        for name in (
            "docker-compose.yml",
            "docker-compose.override.yml",
            "docker-compose.cpu.yml",
            "docker/actor.sh",
        )
    }
    forbidden = [
        r"--requirepass",
        r"redis-cli[^\n]*\s-a\s",
        r"redis(s)?://[^\s\"']*:\$+\{?REDIS_PASSWORD",
    ]
    for name, text in texts.items():
        for pattern in forbidden:
            assert not re.search(pattern, text), (name, pattern)
    compose = load("docker-compose.yml")
    redis, learner = compose["services"]["redis"], compose["services"]["learner"]
    checks = (
        (redis["healthcheck"]["test"][1], "REDIS_PASSWORD"),
        (learner["healthcheck"]["test"][1], "SPECRL_REDIS_PASSWORD"),
    )
    for check, variable in checks:
        assert check.startswith(f'REDISCLI_AUTH="$${variable}" redis-cli '), check
        assert check.count("REDIS_PASSWORD") == 1, check
    assert "REDIS_PASSWORD" not in learner["command"]
    actor_exec = texts["docker/actor.sh"].split("exec specrl-actor", 1)[1]
    assert "PASSWORD" not in actor_exec


def test_cpu_variant_is_host_network_on_loopback():
    """docker-compose.cpu.yml: CPU image, no GPU, every service on 127.0.0.1."""
    cpu = load("docker-compose.cpu.yml")
    services = cpu["services"]
    assert set(services) == SERVICES
    env = cpu["x-cpu-env"]
    for key in ("SPECRL_REDIS_HOST", "SPECRL_REDIS_BIND", "SPECRL_LEARNER_HOST"):
        assert env[key] == "127.0.0.1"
    assert env["SPECRL_LEARNER_BIND"] == env["SPECRL_METRICS_HOST"] == "127.0.0.1"
    for service in services.values():
        assert service["network_mode"] == "host"
        assert service["image"] == "specrl-cpu:latest"
        assert service["environment"] == env
        assert "deploy" not in service and "ports" not in service
    build = services["learner"]["build"]
    assert build["dockerfile"] == "docker/Dockerfile.cpu" and build["network"] == "host"
    # The three ports are distinct by default.
    ports = [env[k] for k in ("SPECRL_REDIS_PORT", "SPECRL_LEARNER_PORT")]
    ports.append(env["SPECRL_LEARNER_METRICS_PORT"])
    assert len(set(ports)) == 3


def test_actor_entry_point_gives_each_replica_an_identity():
    text = (ROOT / "docker" / "actor.sh").read_text()
    for part in (
        "exec specrl-actor",
        "actor.index=",
        "actor.seed=",
        "actor.actor_id=",
        "redis.url=redis://${SPECRL_REDIS_HOST}:${SPECRL_REDIS_PORT}/0",
        "learner.address=tcp://${SPECRL_LEARNER_HOST}:${SPECRL_LEARNER_PORT}",
        "actor.device=${SPECRL_ACTOR_DEVICE:-cpu}",
        "redis.host_cache_dir=${SPECRL_HOST_CACHE_DIR:-/dev/shm}",
    ):
        assert part in text, part


def dockerfile_stages(path: Path) -> list[list[tuple[str, str]]]:
    """The build stages of a Dockerfile, each a list of (INSTRUCTION, arguments): comments and
    blank lines dropped, continuation lines joined; ARGs before the first FROM form stage 0."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).partition(" ")
        instructions.append((keyword.upper(), " ".join(args.split())))
        pending = ""
    assert not pending, f"{path}: ends inside a continued line"
    stages: list[list[tuple[str, str]]] = [[]]
    for keyword, args in instructions:
        if keyword == "FROM":
            stages.append([])
        stages[-1].append((keyword, args))
    return stages


def check_app_stage(stage: list[tuple[str, str]], name: str) -> None:
    """The stage that holds specrl: sources copied into /app, installed after they are there,
    config directory set, run from /runs."""
    workdirs = [i for i, (k, _) in enumerate(stage) if k == "WORKDIR"]
    app = next(i for i in workdirs if stage[i][1] == "/app")
    copies = {args: i for i, (k, args) in enumerate(stage) if k == "COPY"}
    needed = ["pyproject.toml README.md ./"] + [
        f"{part} {part}" for part in ("actors", "learner", "common", "ops", "configs", "docker")
    ]
    for args in needed:
        assert args in copies, f"{name}: no instruction COPY {args}"
        assert copies[args] > app, f"{name}: COPY {args} runs before WORKDIR /app"
        assert not any(app < w < copies[args] for w in workdirs), f"{name}: COPY {args} not in /app"
    installs = [
        i
        for i, (k, args) in enumerate(stage)
        if k == "RUN" and re.search(r"pip install .*-e ", args)
    ]
    assert len(installs) == 1, f"{name}: expected one editable install of specrl, got {installs}"
    for args in needed[:4]:  # the packaging metadata and the three packages
        assert copies[args] < installs[0], f"{name}: COPY {args} comes after the install"
    assert ("ENV", "SPECRL_CONFIG_DIR=/app/configs") in stage, name
    assert stage[workdirs[-1]] == ("WORKDIR", "/runs"), name
    assert stage[-1] == ("CMD", '["specrl", "--help"]'), name


def test_dockerfiles_copy_what_the_images_need():
    gpu = dockerfile_stages(ROOT / "Dockerfile")
    cpu = dockerfile_stages(ROOT / "docker" / "Dockerfile.cpu")
    # GPU image: one stage on the CUDA base; the locked dependencies (their own layer, before
    # the sources), then specrl without dependencies. tests/test_image_pins.py checks the pins.
    assert gpu[0] == [] and len(gpu) == 2
    assert gpu[1][0][1].startswith("nvidia/cuda:"), gpu[1][0]
    check_app_stage(gpu[1], "Dockerfile")
    steps = [f"{k} {args}" for k, args in gpu[1]]
    lock = next(i for i, s in enumerate(steps) if "pip install --require-hashes -r" in s)
    assert steps.index("COPY docker/requirements-gpu.txt /tmp/requirements-gpu.txt") < lock
    assert lock < steps.index("COPY actors actors")
    assert any("pip install --no-deps --no-build-isolation -e . && pip check" in s for s in steps)
    # CPU image: runtime, deps (wheelhouse only) and the final stage built on runtime.
    assert cpu[0] == [("ARG", "BASE_IMAGE=specrl-base:bookworm")]
    runtime, deps, final = cpu[1:]
    assert runtime[0] == ("FROM", "${BASE_IMAGE} AS runtime")
    assert deps[0] == ("FROM", "runtime AS deps")
    assert ("COPY", "build/wheelhouse /wheels") in deps
    assert final[0] == ("FROM", "runtime")
    assert ("COPY", "--from=deps /opt/venv /opt/venv") in final
    check_app_stage(final, "docker/Dockerfile.cpu")
    # The CPU image installs from the wheelhouse only, never from an index: every pip install
    # command of every RUN (continued lines joined, split at &&) says --no-index.
    pip_commands = [
        command
        for stage in cpu
        for k, args in stage
        if k == "RUN"
        for command in args.split("&&")
        if "pip install" in command
    ]
    assert len(pip_commands) == 2, pip_commands
    assert all("--no-index" in command for command in pip_commands), pip_commands
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "!build/wheelhouse" in ignored


def test_dockerfile_parser(tmp_path):
    path = tmp_path / "Dockerfile"
    path.write_text(
        "# comment\nARG A=1\nFROM x AS y\nRUN a \\\n    && b\n\n# COPY fake fake\nCOPY  s  d\n"
    )
    assert dockerfile_stages(path) == [
        [("ARG", "A=1")],
        [("FROM", "x AS y"), ("RUN", "a && b"), ("COPY", "s d")],
    ]


def test_ci_runs_the_compose_smoke():
    assert "bash scripts/compose-smoke.sh" in (ROOT / ".ci" / "run").read_text()
    smoke = (ROOT / "scripts" / "compose-smoke.sh").read_text()
    assert "-f docker-compose.yml -f docker-compose.cpu.yml" in smoke
    assert "trap cleanup EXIT" in smoke and "down -v" in smoke
