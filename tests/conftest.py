"""Shared fixtures: one real private Redis server per test session, a clean db per test."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import redis

from ops.redis_server import RedisServer

REDIS_TEST_PASSWORD = "specrl-test"


def pytest_report_header(config: pytest.Config) -> str | None:
    """tests/engine_vllm/ is left out of collection without vLLM: said once, at the top."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm tier (tests/engine_vllm/): not collected, vLLM is not installed"
    return None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A real ``redis-server`` on a free port, password-protected like a deployment."""
    with RedisServer(password=REDIS_TEST_PASSWORD) as server:
        yield server


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """A bytes client (``decode_responses=False``) on an empty db."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    yield client
    client.close()
