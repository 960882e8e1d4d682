"""docker-compose.yml and the Dockerfile agree with the code (CI also runs `docker compose config`
where a docker client with compose exists; this machine has none)."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_and_their_wiring():
    services = compose()["services"]
    assert set(services) == {"redis", "learner", "actor"}
    redis, learner, actor = services["redis"], services["learner"], services["actor"]
    assert "--requirepass" in redis["command"]
    assert "healthcheck" in redis and "healthcheck" in learner
    assert learner["depends_on"]["redis"]["condition"] == "service_healthy"
    assert actor["depends_on"]["learner"]["condition"] == "service_healthy"
    # Entry points and overrides the code actually has.
    assert (
        "specrl-learner" in learner["command"]
        and "learner.bind=tcp://0.0.0.0:5555" in learner["command"]
    )
    assert (
        "specrl-actor" in actor["command"]
        and "learner.address=tcp://learner:5555" in actor["command"]
    )
    for service in (learner, actor):
        assert "redis://:$$REDIS_PASSWORD@redis:6379/0" in service["command"]
        gpu = service["deploy"]["resources"]["reservations"]["devices"][0]
        assert gpu["capabilities"] == ["gpu"]
    assert "replicas" in actor["deploy"]
    assert "runs:/runs" in learner["volumes"] and "runs" in compose()["volumes"]


def test_dockerfile_copies_what_the_image_needs():
    text = (ROOT / "Dockerfile").read_text()
    for part in ("actors", "learner", "common", "configs", "pyproject.toml"):
        assert f"COPY {part}" in text or part in text.split("COPY", 1)[1]
    assert "torch==2.13.0" in text and "SPECRL_CONFIG_DIR=/app/configs" in text
