"""redis.url: the password travels in $SPECRL_REDIS_PASSWORD, not on command lines; it is
redacted wherever the URL is shown; an unprotected Redis on another machine is warned about."""

from __future__ import annotations

import logging

import pytest

from common.config import load_config
from common.config.run import (
    REDIS_PASSWORD_ENV,
    RedisConfig,
    redact_redis_url,
    split_redis_password,
    with_redis_password,
)

CONFIG_LOGGER = "common.config.run"


@pytest.fixture(autouse=True)
def no_password_in_env(monkeypatch):
    monkeypatch.delenv(REDIS_PASSWORD_ENV, raising=False)


@pytest.mark.parametrize(
    ("url", "bare", "password", "redacted"),
    [
        ("redis://:pw@h:1/0", "redis://h:1/0", "pw", "redis://:***@h:1/0"),
        ("redis://user:pw@h/0", "redis://user@h/0", "pw", "redis://user:***@h/0"),
        ("redis://:p%40w%3A@h:1/0", "redis://h:1/0", "p@w:", "redis://:***@h:1/0"),
        # Without a password, the bare and the redacted URL are the URL as it is.
        *[(url, url, "", url) for url in ("rediss://[::1]:6379/0", "redis://h")],
    ],
)
def test_split_put_back_and_redact(url, bare, password, redacted):
    assert split_redis_password(url) == (bare, password)
    assert redact_redis_url(url) == redacted
    if password:
        # Put back (quoted), the URL means the same to redis-py as the original.
        import redis.connection

        again = with_redis_password(bare, password)
        assert redis.connection.parse_url(again) == redis.connection.parse_url(url)


def test_the_password_comes_from_the_environment(monkeypatch):
    assert RedisConfig(url="redis://h:1/0").resolved_url() == "redis://h:1/0"
    monkeypatch.setenv(REDIS_PASSWORD_ENV, "s3 cr@t")
    assert RedisConfig(url="redis://h:1/0").resolved_url() == "redis://:s3%20cr%40t@h:1/0"
    assert RedisConfig().resolved_url() == "redis://:s3%20cr%40t@127.0.0.1:6379/0"
    # A password written in the URL wins.
    assert RedisConfig(url="redis://:own@h:1/0").resolved_url() == "redis://:own@h:1/0"


def warnings_for(caplog, url: str) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        RedisConfig(url=url)
    return [r.getMessage() for r in caplog.records if r.name == CONFIG_LOGGER]


def test_an_unprotected_remote_redis_is_warned_about(caplog, monkeypatch):
    no_password = warnings_for(caplog, "redis://10.0.0.5:6379/0")
    assert len(no_password) == 2
    assert "has no password" in no_password[0] and "10.0.0.5" in no_password[0]
    assert "plain TCP" in no_password[1]
    # With a password, plain redis:// to another machine still crosses the network in clear.
    (plain,) = warnings_for(caplog, "redis://:pw@db.example:6379/0")
    assert "plain TCP" in plain and "rediss://" in plain
    assert "pw@" not in plain and ":***@" in plain  # the message never shows the password
    # TLS with a password, a loopback host or a Unix socket: nothing to say.
    for url in (
        "rediss://:pw@db.example:6379/0",
        "redis://127.0.0.1:6379/0",
        "redis://localhost:6379/0",
        "redis://[::1]:6379/0",
        "unix:///run/redis.sock",
        "",
    ):
        assert warnings_for(caplog, url) == [], url
    # TLS without a password: still open to anyone who reaches it.
    (open_tls,) = warnings_for(caplog, "rediss://db.example:6379/0")
    assert "has no password" in open_tls
    # The password may come from the environment instead of the URL.
    monkeypatch.setenv(REDIS_PASSWORD_ENV, "pw")
    assert warnings_for(caplog, "rediss://db.example:6379/0") == []


def test_the_loader_warns_when_a_process_is_configured(caplog):
    with caplog.at_level(logging.WARNING, logger=CONFIG_LOGGER):
        cfg = load_config(["redis.url=redis://10.0.0.5:6379/0"])
    assert cfg.redis.url == "redis://10.0.0.5:6379/0"
    assert any("has no password" in r.getMessage() for r in caplog.records)
