"""The OpenEnv adapter (actors/episodes/openenv.py) against a fake OpenEnv server on loopback
(testing/openenv_server.py): sessions, capacity, schema errors, a server that dies, and
episodes through the runner on the torch engine."""

from __future__ import annotations

import threading
import time

import pytest

from actors.engines.torch.engine import TorchEngine
from actors.episodes.env import EnvFailure, make_env
from actors.episodes.runner import EpisodeRunner
from common import metric_names as mn
from common.chat_bridge import make_bridge
from common.config import load_config
from common.config.env import EnvConfig, env_spec_refusal, openenv_url
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer
from testing.models import random_model
from testing.openenv_server import FakeOpenEnv

TOKENIZER = CharTokenizer(BUILTIN_ALPHABET)


@pytest.fixture
def server():
    fake = FakeOpenEnv(max_sessions=4, turns=2)
    yield fake
    fake.close()


def until(check, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def test_server_addresses_and_bad_specs():
    assert openenv_url("http://h:8000") == "ws://h:8000/ws"
    assert openenv_url("https://h/env") == "wss://h/env/ws"
    assert openenv_url("ws://h:8000") == "ws://h:8000/ws"
    assert openenv_url("ws://h:8000/sessions") == "ws://h:8000/sessions"
    for bad in ("ftp://h:1", "ws://", "h:8000"):
        with pytest.raises(ValueError, match="OpenEnv server"):
            openenv_url(bad)
    assert env_spec_refusal("openenv:ws://127.0.0.1:9") is None
    assert "OpenEnv server" in env_spec_refusal("openenv:localhost")
    with pytest.raises(ValueError, match="the OpenEnv server runs the environment"):
        EnvConfig(name="openenv:ws://127.0.0.1:9", workers=2)
    cfg = load_config(["task=lookup", "env.name=openenv:http://127.0.0.1:9"])
    assert cfg.env.name == "openenv:http://127.0.0.1:9"


def test_a_session_resets_steps_and_closes(server):
    env = make_env(f"openenv:{server.url}")
    obs, _ = env.reset(seed=13, options={"sibling": 1, "split": "eval"})
    assert obs == "start 3"
    assert server.resets == [
        {"seed": 13, "episode_id": "specrl-13-1", "sibling": 1, "split": "eval"}
    ]
    step = env.step("hello")
    assert (step.obs, step.reward, step.terminated) == ("heard hello", 2.0, False)
    assert env.step("xy").terminated
    assert len(server.active) == 1
    env.close()
    assert until(lambda: not server.active)  # the session ended on the server
    # A second episode on the same object opens a session of its own.
    assert env.reset(seed=4)[0] == "start 4" and server.opened == 2
    env.close()


def test_a_full_server_is_tried_again_until_a_session_frees():
    server = FakeOpenEnv(max_sessions=1)
    try:
        first = make_env(f"openenv:{server.url}")
        first.reset(seed=1)
        second = make_env(f"openenv:{server.url}", {"reset_timeout_s": 10.0})
        got: list = []
        waiting = threading.Thread(target=lambda: got.append(second.reset(seed=2)))
        waiting.start()
        assert until(lambda: server.refused >= 2)  # refused, and tried again
        assert not got
        first.close()
        waiting.join(timeout=10)
        assert got and got[0][0] == "start 2" and server.most == 1
        second.close()
        # Never freed: the reset fails at its deadline.
        held = make_env(f"openenv:{server.url}")
        held.reset(seed=3)
        late = make_env(f"openenv:{server.url}", {"reset_timeout_s": 0.5})
        started = time.monotonic()
        with pytest.raises(EnvFailure, match="CAPACITY_REACHED"):
            late.reset(seed=4)
        assert 0.4 < time.monotonic() - started < 5
        held.close()
    finally:
        server.close()


def test_an_action_the_schema_refuses_is_a_malformed_action(server):
    env = make_env(f"openenv:{server.url}", {"action_field": "text"})
    env.reset(seed=5)
    step = env.step("hello")
    assert step.info.get("malformed") and not step.terminated and step.reward == 0.0
    assert "VALIDATION_ERROR" in step.obs
    env.close()


def test_a_server_that_dies_mid_episode_fails_the_call(server):
    env = make_env(f"openenv:{server.url}", {"step_timeout_s": 5.0})
    env.reset(seed=6)
    server.die()
    with pytest.raises(EnvFailure, match="raised"):
        env.step("hello")
    env.close()
    with pytest.raises(EnvFailure):
        make_env(f"openenv:{server.url}", {"reset_timeout_s": 1.0}).reset(seed=7)


def runner(url: str, max_turns: int = 8) -> EpisodeRunner:
    model = random_model(TOKENIZER.vocab_size, seed=3)
    engine = TorchEngine(model, TOKENIZER.eos_id, TOKENIZER.pad_id, 1.0, seed=7, max_rows=8)
    cfg = EnvConfig(
        name=f"openenv:{url}", max_turn_tokens=6, max_turns=max_turns, step_timeout_s=5.0
    )
    bridge = make_bridge(TOKENIZER, max_obs_chars=cfg.max_obs_chars, max_obs_tokens=64)
    spec = cfg.name

    def fresh():
        return make_env(spec, {"reset_timeout_s": 5.0, "step_timeout_s": 5.0})

    return EpisodeRunner(engine, cfg, bridge, TOKENIZER, fresh, frozenset({TOKENIZER.eos_id}))


def test_episodes_run_through_the_runner_one_session_each(server):
    groups: list = []
    episodes = runner(server.url).run_batch([1, 2], 2, None, groups.append)
    assert len(groups) == 2
    for row in episodes:
        for ep in row:
            assert ep.stop == "env_done" and len(ep.turn_starts) == 2 and not ep.failure
    assert server.opened == 4 and server.most <= 4
    assert until(lambda: not server.active)  # every session closed at the batch's end


def test_a_server_that_dies_mid_batch_fails_its_episodes_and_the_batch_ends():
    server = FakeOpenEnv(turns=10_000)
    run = runner(server.url, max_turns=10_000)

    def die_after_some_steps() -> None:
        until(lambda: server.steps >= 8, timeout_s=60)
        server.die()

    threading.Thread(target=die_after_some_steps, daemon=True).start()
    groups: list = []
    episodes = run.run_batch([1, 2], 2, None, groups.append)
    assert groups == []  # env.on_failure=drop_group
    assert all(ep.stop == "env_error" for row in episodes for ep in row)
    assert run.counts[f"{mn.ENV_FAILURES_PREFIX}raised"] == 4


def test_the_actor_refuses_to_start_without_a_server_and_probes_one_that_answers(server):
    from actors.episodes.env import EnvSpecError
    from actors.episodes.runner import episode_runner

    overrides = ["task=lookup", "env.reset_timeout_s=1", "env.step_timeout_s=1"]
    engine = object()  # the probe comes before the engine is used
    cfg = load_config([*overrides, f"env.name=openenv:{server.url}"])
    episode_runner(cfg, engine, TOKENIZER)
    assert server.resets[-1]["probe"] is True and until(lambda: not server.active)
    server.close()
    cfg = load_config([*overrides, f"env.name=openenv:{server.url}"])
    with pytest.raises(EnvSpecError, match="no session with the OpenEnv server"):
        episode_runner(cfg, engine, TOKENIZER)
