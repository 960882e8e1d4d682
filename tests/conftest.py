"""Shared fixtures: one real private Redis server per test session, a clean db per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from ops.redis_server import RedisServer

REDIS_TEST_PASSWORD = "specrl-test"


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
