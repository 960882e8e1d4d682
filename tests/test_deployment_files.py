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
    assert "--requirepass" in redis["command"] and "healthcheck" in redis
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
    assert (
        "redis.url=redis://:$$REDIS_PASSWORD@$$SPECRL_REDIS_HOST:$$SPECRL_REDIS_PORT/0"
        in learner["command"]
    )
    assert "/app/docker/actor.sh" in actor["command"]
    env = compose["x-specrl-env"]
    assert env["SPECRL_REDIS_HOST"] == "redis" and env["SPECRL_LEARNER_HOST"] == "learner"
    for service in services.values():
        assert service["environment"] == env
        # Published ports live in the GPU override: host networking (CPU) cannot have them.
        assert "ports" not in service
        assert "resources" not in service.get("deploy", {})
    assert actor["restart"] == "on-failure" and learner["restart"] == "on-failure"
    assert "replicas" in actor["deploy"]
    assert "runs:/runs" in learner["volumes"] and "runs" in compose["volumes"]


def test_gpu_override_reserves_gpus_and_publishes_ports():
    """docker-compose.override.yml: read by `docker compose up` with no -f (the GPU node)."""
    services = load("docker-compose.override.yml")["services"]
    for name in ("learner", "actor"):
        gpu = services[name]["deploy"]["resources"]["reservations"]["devices"][0]
        assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert services["actor"]["environment"]["SPECRL_ACTOR_DEVICE"] == "cuda"
    assert any(p.endswith(":5555") for p in services["learner"]["ports"])
    assert any(p.startswith("127.0.0.1:") for p in services["learner"]["ports"])
    assert any(p.endswith(":6379") for p in services["redis"]["ports"])


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
        "actor.actor_id=",
        "redis.url=redis://:${REDIS_PASSWORD}@${SPECRL_REDIS_HOST}:${SPECRL_REDIS_PORT}/0",
        "learner.address=tcp://${SPECRL_LEARNER_HOST}:${SPECRL_LEARNER_PORT}",
        "actor.device=${SPECRL_ACTOR_DEVICE:-cpu}",
    ):
        assert part in text, part


def test_dockerfiles_copy_what_the_images_need():
    gpu = (ROOT / "Dockerfile").read_text()
    cpu = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    assert gpu.startswith("#") and "FROM nvidia/cuda:" in gpu
    assert re.search(r"^ARG BASE_IMAGE=specrl-base:bookworm$", cpu, re.M)
    for text in (gpu, cpu):
        for part in ("actors", "learner", "common", "configs", "docker"):
            assert f"COPY {part} {part}" in text, part
        assert "SPECRL_CONFIG_DIR=/app/configs" in text
    assert "torch==2.13.0" in gpu
    # The CPU image installs from the wheelhouse only, never from an index.
    assert "COPY build/wheelhouse /wheels" in cpu
    for line in cpu.splitlines():
        if "pip install" in line:
            assert "--no-index" in line, line
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "!build/wheelhouse" in ignored


def test_ci_runs_the_compose_smoke():
    assert "bash scripts/compose-smoke.sh" in (ROOT / ".ci" / "run").read_text()
    smoke = (ROOT / "scripts" / "compose-smoke.sh").read_text()
    assert "-f docker-compose.yml -f docker-compose.cpu.yml" in smoke
    assert "trap cleanup EXIT" in smoke and "down -v" in smoke
