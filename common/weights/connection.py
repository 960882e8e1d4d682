"""Redis connections for the weight store: a pool's arguments another process can rebuild it
from, and retrying while Redis is unreachable (a Redis restart must not kill a learner or an
actor)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import redis

logger = logging.getLogger(__name__)

_CONNECTION_ARGS = (
    "host",
    "port",
    "path",
    "db",
    "username",
    "password",
    "socket_timeout",
    "socket_connect_timeout",
    "socket_keepalive",
    "client_name",
    "health_check_interval",
)


def portable_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The arguments of a connection pool that say where and how to connect (address, db,
    credentials, timeouts, TLS settings), with plain values only: the objects redis-py keeps
    among them (registries with locks, sentinels, handlers) belong to one pool, and a new pool
    makes its own."""
    plain = (str, int, float, bool, type(None))
    return {
        key: value
        for key, value in kwargs.items()
        if (key in _CONNECTION_ARGS or key.startswith("ssl_")) and isinstance(value, plain)
    }


REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError)
"""What a Redis restart or outage raises in redis-py."""


def retry_redis(who: str, what: str, action, should_stop):
    """``action()``, retried with backoff while Redis is unreachable; None if a stop has come
    when an attempt fails."""
    backoff_s = 0.1
    while True:
        try:
            return action()
        except REDIS_DOWN as e:
            if should_stop():
                return None
            logger.warning(
                "%s: %s: Redis unreachable (%s); retrying in %.1f s", who, what, e, backoff_s
            )
            time.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 5.0)
