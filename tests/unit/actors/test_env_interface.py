"""The environment interface: loading ``env.name`` specs (clear errors at start), sync and async
environments, every invalid answer as a typed failure, and the built-in ``lookup``."""

import asyncio
import math
import sys
import textwrap

import numpy as np
import pytest

from actors.episodes import (
    FAILURE_KINDS,
    CheckedEnv,
    EnvFailure,
    EnvSpecError,
    load_env_class,
    make_env,
)
from actors.episodes.builtin import BAD, BUILTIN, LookupEnv
from common.chat_bridge import make_bridge
from common.config.env import BUILTIN_ENVS
from common.tokenizer import BUILTIN_ALPHABET, CharTokenizer

ENV_SOURCE = textwrap.dedent(
    """
    class Echo:
        def __init__(self, prefix="> "):
            self.prefix = prefix

        def reset(self, *, seed, options):
            return f"{self.prefix}start {seed}", {"options": options}

        def step(self, action):
            return self.prefix + action, 0.5, action == "stop", False, {}


    class AsyncEcho(Echo):
        async def reset(self, *, seed, options):
            return f"async {seed}", {}

        async def step(self, action):
            return [{"role": "tool", "content": action}], 1, True, False, {"n": 1}

        async def close(self):
            self.closed = True


    def not_a_class():
        pass


    class NoStep:
        def reset(self, *, seed, options):
            return "x", {}
    """
)


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "my_envs.py"
    path.write_text(ENV_SOURCE)
    return path


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    (tmp_path / "specrl_test_envs.py").write_text(ENV_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "specrl_test_envs"
    sys.modules.pop("specrl_test_envs", None)


def test_loads_a_module_class_and_a_file_class(env_file, env_module):
    env = make_env(f"{env_module}:Echo", {"prefix": "# "})
    assert env.reset(seed=3, options={"a": 1}) == ("# start 3", {"options": {"a": 1}})
    result = env.step("stop")
    assert (result.obs, result.reward, result.terminated, result.truncated) == (
        "# stop",
        0.5,
        True,
        False,
    )
    assert result.done
    from_file = make_env(f"{env_file}:Echo")
    assert from_file.reset(seed=1)[0] == "> start 1"
    assert load_env_class("lookup") is LookupEnv


@pytest.mark.parametrize(
    ("spec", "kwargs", "match"),
    [
        ("no_such_module_xyz:Env", {}, "no module 'no_such_module_xyz'"),
        ("{module}:Missing", {}, "has no class 'Missing'"),
        ("{module}:not_a_class", {}, "not_a_class is a function, not a class"),
        ("{module}:NoStep", {}, "class NoStep has no step method"),
        ("{module}:Echo", {"colour": "red"}, r"env.kwargs=\{'colour': 'red'\} do not fit Echo"),
        ("{file}:Echo", {"prefix": 1, "x": 2}, "do not fit Echo"),
        ("/nowhere/envs.py:Echo", {}, "no file /nowhere/envs.py"),
        ("just_a_name", {}, "expected a built-in environment"),
        ("{module}:1abc", {}, "is not a class name"),
        ("my-envs:Env", {}, "neither a .py file nor a dotted module name"),
    ],
)
def test_bad_specs_are_refused_with_the_reason(env_file, env_module, spec, kwargs, match):
    spec = spec.format(module=env_module, file=env_file)
    with pytest.raises(EnvSpecError, match=match):
        make_env(spec, kwargs)


def test_a_file_or_constructor_that_raises_is_refused_at_start(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no GPU here')\n")
    with pytest.raises(EnvSpecError, match="loading .*broken.py raised RuntimeError"):
        make_env(f"{broken}:Env")
    with pytest.raises(EnvSpecError, match=r"LookupEnv\(\*\*\{'digits': 0\}\) raised"):
        make_env("lookup", {"digits": 0})


def test_async_env_runs_from_sync_code_and_from_a_coroutine(env_file):
    env = make_env(f"{env_file}:AsyncEcho")
    assert env.reset(seed=7) == ("async 7", {})
    result = env.step("look")
    assert result.obs == [{"role": "tool", "content": "look"}]
    assert result.reward == 1.0 and isinstance(result.reward, float) and result.terminated
    env.close()
    assert env.env.closed

    async def inside_a_loop():
        other = make_env(f"{env_file}:AsyncEcho")
        with pytest.raises(RuntimeError, match="await areset"):
            other.reset(seed=1)
        obs, _ = await other.areset(seed=2)
        step = await other.astep("x")
        await other.aclose()
        return obs, step.info

    assert asyncio.run(inside_a_loop()) == ("async 2", {"n": 1})


class Scripted:
    """Returns whatever the test put in ``answer``."""

    def __init__(self, answer=None, reset_answer=("ok", {})):
        self.answer = answer
        self.reset_answer = reset_answer

    def reset(self, *, seed, options):
        return self.reset_answer

    def step(self, action):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


GOOD = ("obs", 0.0, False, False, {})


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        ("obs", "must return \\(observation, reward, terminated, truncated, info\\)"),
        (("obs", 0.0, False, False), "must return"),
        ((42, 0.0, False, False, {}), "bad observation"),
        ((None, 0.0, False, False, {}), "bad observation"),
        (([{"role": "user"}], 0.0, False, False, {}), "bad observation"),
        (([{"role": "user", "content": b"x"}], 0.0, False, False, {}), "bad observation"),
        (("obs", math.nan, False, False, {}), "reward nan"),
        (("obs", math.inf, False, False, {}), "reward inf"),
        (("obs", 2e6, False, False, {}), "max_abs_reward|<= 1000000"),
        (("obs", "1", False, False, {}), "not a number"),
        (("obs", None, False, False, {}), "not a number"),
        (("obs", 0.0, 1, False, {}), "terminated=1, not a bool"),
        (("obs", 0.0, False, "no", {}), "truncated='no', not a bool"),
        (("obs", 0.0, False, False, None), "info None, not a dict"),
        (("obs", 0.0, False, False, [1]), "not a dict"),
    ],
)
def test_each_invalid_answer_is_a_typed_failure(answer, match):
    env = CheckedEnv(Scripted(answer))
    env.reset(seed=0)
    with pytest.raises(EnvFailure, match=match) as err:
        env.step("a")
    assert err.value.kind == "invalid" and err.value.kind in FAILURE_KINDS


def test_valid_answers_pass_including_numpy_scalars():
    env = CheckedEnv(Scripted(("obs", np.float32(0.25), np.bool_(True), False, {"k": 1})))
    env.reset(seed=0)
    result = env.step("a")
    assert (result.reward, result.terminated, type(result.terminated)) == (0.25, True, bool)
    assert CheckedEnv(Scripted(GOOD)).step("a").obs == "obs"


def test_bad_reset_answers_and_raising_envs():
    for reset_answer, match in [
        ("obs", "must return \\(observation, info\\)"),
        ((1, {}), "bad"),
        (("o", 3), "not a dict"),
    ]:
        with pytest.raises(EnvFailure, match=match) as err:
            CheckedEnv(Scripted(reset_answer=reset_answer)).reset(seed=0)
        assert err.value.kind == "invalid"
    env = CheckedEnv(Scripted(ValueError("tool broke")), name="my_envs:Scripted")
    with pytest.raises(EnvFailure, match="my_envs:Scripted.step raised ValueError") as err:
        env.step("a")
    assert err.value.kind == "raised"
    with pytest.raises(ValueError, match="unknown environment failure kind"):
        EnvFailure("bored", "")


def test_builtin_registry_matches_the_config_names():
    assert set(BUILTIN) == set(BUILTIN_ENVS)


def play(env, actions, seed=5):
    obs, info = env.reset(seed=seed)
    steps = [env.step(a) for a in actions]
    return obs, info, steps


def test_lookup_call_then_answer():
    env = make_env("lookup")
    obs, info, _ = play(env, [])
    key = info["key"]
    assert obs == f"find {key}>" and len(key) == 2
    call = env.step(f"get {key}")
    assert call.obs.startswith("=") and call.obs.endswith(">") and len(call.obs) == 8
    assert (call.reward, call.terminated, call.info["malformed"]) == (0.0, False, False)
    value = call.obs[1:-1]
    assert value.isdigit()
    answer = env.step(value)
    assert (answer.reward, answer.terminated, answer.truncated) == (1.0, True, False)
    wrong = "0" * 6 if value != "0" * 6 else "1" * 6
    env.reset(seed=5)
    assert env.step(wrong).reward == 0.0
    # Every character fits the built-in char model's alphabet.
    bridge = make_bridge(CharTokenizer(BUILTIN_ALPHABET))
    for text in (obs, call.obs, BAD):
        assert CharTokenizer(BUILTIN_ALPHABET).decode(bridge.bridge_ids(text).ids) == text


def test_lookup_malformed_calls_and_turn_limit():
    env = make_env("lookup", {"max_turns": 3})
    _, info = env.reset(seed=5)
    wrong_key = "aa" if info["key"] != "aa" else "bb"
    steps = [env.step(a) for a in ("get", "hello", f"get {wrong_key}")]
    assert [s.obs for s in steps] == [BAD, BAD, BAD]
    assert [s.info["malformed"] for s in steps] == [True, True, True]
    assert [s.truncated for s in steps] == [False, False, True]
    assert not any(s.terminated for s in steps)
    assert all(s.reward == 0.0 for s in steps)


def test_lookup_is_determined_by_the_seed():
    def value_of(seed):
        env = make_env("lookup")
        _, info = env.reset(seed=seed)
        return info["key"], env.step(f"get {info['key']}").obs

    assert value_of(11) == value_of(11)
    assert len({value_of(seed) for seed in range(20)}) > 15
    partial = make_env("lookup", {"partial_credit": 0.5})
    _, info = partial.reset(seed=11)
    value = partial.step(f"get {info['key']}").obs[1:-1]
    near = ("9" if value[0] != "9" else "8") + value[1:]
    assert partial.step(near).reward == pytest.approx(0.5 * 5 / 6)


def test_the_documented_example_environment_plays_by_the_contract():
    """examples/guess_number.py (docs/environments.md), loaded as a user names it: a binary
    search on its hints wins within its turns; a turn without a number is malformed."""
    env = make_env("examples/guess_number.py:GuessNumber", {"high": 50, "turns": 6})
    obs, _ = env.reset(seed=3, options={"sibling": 0})
    assert "between 1 and 50" in obs
    low, high = 1, 50
    bad = env.step("no idea")
    assert bad.info["malformed"] and not bad.done
    for _ in range(5):
        guess = (low + high) // 2
        step = env.step(f"I guess {guess}")
        if step.terminated:
            assert step.reward == 1.0 and step.obs == "Correct!"
            break
        low, high = (guess + 1, high) if step.obs == "Higher." else (low, guess - 1)
    else:
        pytest.fail("a binary search over 1..50 finds the number in 6 guesses")
    env.close()
