"""The environment of multi-turn episodes: a Gymnasium-shaped text environment, duck-typed (no
dependency), named by ``env.name``, and the checked wrapper the episode runner talks to.

What a user writes (``env.name=my_envs:GuessNumber`` or ``env.name=envs/guess.py:GuessNumber``,
constructed with ``env.kwargs``)::

    class GuessNumber:
        def __init__(self, **kwargs): ...
        def reset(self, *, seed: int, options: dict) -> tuple[str | list[dict], dict]: ...
        def step(self, action: str) -> tuple[str | list[dict], float, bool, bool, dict]: ...
        def close(self) -> None: ...              # optional

``reset``, ``step`` and ``close`` may be ``async def``. An observation is text (rendered in
``env.obs_role``) or a list of ``{"role", "content"}`` messages (one environment step, rendered
together). ``step`` returns ``(observation, reward, terminated, truncated, info)``: the reward
a finite number, ``terminated`` / ``truncated`` booleans, ``info`` a dict.

:func:`load_env_class` refuses a bad spec at start with :class:`EnvSpecError` (as
``task.reward`` does); :class:`CheckedEnv` turns what the environment raises or returns wrong into
:class:`EnvFailure` with a kind the runner counts (``env/failures/<kind>``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import numbers
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.chat_bridge import Message, ObservationError, as_messages
from common.config.env import BUILTIN_ENVS, OPENENV_PREFIX, env_spec_refusal

logger = logging.getLogger(__name__)

FAILURE_KINDS = ("crashed", "timeout", "invalid", "raised")
"""Why an episode's environment failed: its worker process died, a call ran past its deadline,
it returned something invalid, or it raised."""

DEFAULT_MAX_ABS_REWARD = 1e6
"""Bound on |reward| when none is given (``learner.max_abs_reward``'s default)."""


class EnvSpecError(ValueError):
    """An ``env.name`` (with its ``env.kwargs``) that does not give a usable environment."""


class EnvFailure(RuntimeError):
    """An environment call that gave no usable answer; ``kind`` is one of
    :data:`FAILURE_KINDS`."""

    def __init__(self, kind: str, detail: str) -> None:
        if kind not in FAILURE_KINDS:
            raise ValueError(f"unknown environment failure kind {kind!r}")
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


@dataclass(frozen=True)
class StepResult:
    """One checked ``step``: the observation (text, or its checked messages), the reward as a
    float, the two flags as bools, ``info`` as a dict."""

    obs: str | list[Message]
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated


def parse_env_spec(spec: str) -> tuple[str, str]:
    """``(target, class name)`` of a ``<module or file.py>:<Class>`` spec (the form only)."""
    refusal = env_spec_refusal(spec)
    if refusal is not None:
        raise EnvSpecError(refusal)
    target, _, name = spec.rpartition(":")
    return target, name


def load_env_class(spec: str, source: bytes | None = None) -> type:
    """The environment class ``spec`` names: a built-in name, a module's class or a file's
    (``source``: that file's text as read earlier, e.g. the environment pool's sealed copy)."""
    if spec in BUILTIN_ENVS:
        from actors.episodes.builtin import BUILTIN

        return BUILTIN[spec]
    target, name = parse_env_spec(spec)
    if target.endswith(".py"):
        path = Path(target)
        if source is None and not path.is_file():
            raise EnvSpecError(f"env.name={spec!r}: no file {path}")
        module = _module_from_file(path, spec, source)
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as err:
            raise EnvSpecError(f"env.name={spec!r}: no module {target!r} ({err})") from err
        except Exception as err:  # noqa: BLE001 - the user's module failed to import
            raise EnvSpecError(f"env.name={spec!r}: importing {target!r} raised {err!r}") from err
    return _checked_class(module, spec)


def _module_from_file(path: Path, spec: str, source: bytes | None) -> types.ModuleType:
    module_name = f"specrl_user_env_{path.stem}"
    module = types.ModuleType(module_name)
    module.__file__ = str(path)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    try:
        code = compile(path.read_bytes() if source is None else source, str(path), "exec")
        exec(code, module.__dict__)  # noqa: S102 - the user's environment
    except Exception as err:  # noqa: BLE001 - any error in the user's file stops the start
        sys.modules.pop(module_name, None)
        raise EnvSpecError(f"env.name={spec!r}: loading {path} raised {err!r}") from err
    return module


def _checked_class(module: types.ModuleType, spec: str) -> type:
    target, name = parse_env_spec(spec)
    cls = getattr(module, name, None)
    if cls is None:
        raise EnvSpecError(f"env.name={spec!r}: {target} has no class {name!r}")
    if not inspect.isclass(cls):
        raise EnvSpecError(
            f"env.name={spec!r}: {name} is a {type(cls).__name__}, not a class with reset and step"
        )
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvSpecError(f"env.name={spec!r}: class {name} has no {' or '.join(missing)} method")
    return cls


def make_env(
    spec: str,
    kwargs: Mapping[str, Any] | None = None,
    max_abs_reward: float = DEFAULT_MAX_ABS_REWARD,
    cls: type | None = None,
) -> CheckedEnv:
    """A fresh environment of ``spec`` (or of ``cls``, its class loaded already) built with
    ``kwargs``, wrapped in :class:`CheckedEnv`. Keyword arguments the constructor does not take,
    or a constructor that raises, stop the start with :class:`EnvSpecError`."""
    kwargs = dict(kwargs or {})
    if cls is None and spec.startswith(OPENENV_PREFIX):
        from actors.episodes.openenv import OpenEnvSession

        cls, kwargs = OpenEnvSession, {"url": spec[len(OPENENV_PREFIX) :], **kwargs}
    cls = load_env_class(spec) if cls is None else cls
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as err:
        raise EnvSpecError(
            f"env.name={spec!r}: env.kwargs={kwargs!r} do not fit {cls.__name__}: {err}"
        ) from err
    except ValueError:
        pass  # no signature to read: the call itself will tell
    try:
        env = cls(**kwargs)
    except Exception as err:  # noqa: BLE001 - the user's constructor
        raise EnvSpecError(
            f"env.name={spec!r}: {cls.__name__}(**{kwargs!r}) raised {err!r}"
        ) from err
    return CheckedEnv(env, max_abs_reward=max_abs_reward, name=spec)


class CheckedEnv:
    """An environment whose every answer is checked: the sync methods (``reset``, ``step``,
    ``close``) run an ``async`` environment on the wrapper's own event loop; the ``a``-prefixed
    ones are for callers that are coroutines already. What the environment raises becomes
    ``EnvFailure("raised")``; an answer of the wrong shape or type, ``EnvFailure("invalid")``."""

    def __init__(self, env: Any, max_abs_reward: float = DEFAULT_MAX_ABS_REWARD, name: str = ""):
        self.env = env
        self.name = name or type(env).__name__
        self.max_abs_reward = max_abs_reward
        self._loop: asyncio.AbstractEventLoop | None = None

    def reset(self, *, seed: int, options: Mapping[str, Any] | None = None) -> tuple[Any, dict]:
        return self._run(self.areset(seed=seed, options=options))

    def step(self, action: str) -> StepResult:
        return self._run(self.astep(action))

    def close(self) -> None:
        try:
            self._run(self.aclose())
        finally:
            if self._loop is not None:
                self._loop.close()
                self._loop = None

    async def areset(
        self, *, seed: int, options: Mapping[str, Any] | None = None
    ) -> tuple[str | list[Message], dict]:
        return self.check_reset(
            await self._call("reset", seed=int(seed), options=dict(options or {}))
        )

    async def astep(self, action: str) -> StepResult:
        return self.check_step(await self._call("step", action))

    def check_reset(self, value: Any) -> tuple[str | list[Message], dict]:
        """What ``reset`` returned, checked: ``(observation, info)``, else ``invalid``."""
        if not isinstance(value, tuple | list) or len(value) != 2:
            raise self._invalid("reset", f"must return (observation, info), got {value!r:.120}")
        obs, info = value
        return self._obs("reset", obs), self._info("reset", info)

    def check_step(self, value: Any) -> StepResult:
        """What ``step`` returned, checked (a :class:`StepResult`), else ``invalid``."""
        if not isinstance(value, tuple | list) or len(value) != 5:
            raise self._invalid(
                "step",
                "must return (observation, reward, terminated, truncated, info), got "
                f"{value!r:.120}",
            )
        obs, reward, terminated, truncated, info = value
        return StepResult(
            obs=self._obs("step", obs),
            reward=self._reward(reward),
            terminated=self._flag("terminated", terminated),
            truncated=self._flag("truncated", truncated),
            info=self._info("step", info),
        )

    async def aclose(self) -> None:
        if callable(getattr(self.env, "close", None)):
            try:
                await self._call("close")
            except EnvFailure as err:
                logger.warning("environment %s: close failed: %s", self.name, err.detail)

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            value = getattr(self.env, method)(*args, **kwargs)
            if inspect.isawaitable(value):
                value = await value
        except Exception as err:  # noqa: BLE001 - whatever the user's env raises is counted
            raise EnvFailure("raised", f"{self.name}.{method} raised {err!r:.200}") from err
        return value

    def _run(self, coroutine: Any) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            coroutine.close()
            raise RuntimeError(
                "CheckedEnv's sync methods cannot run inside an event loop; await areset, "
                "astep and aclose instead"
            )
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(coroutine)

    def _invalid(self, method: str, why: str) -> EnvFailure:
        return EnvFailure("invalid", f"{self.name}.{method} {why}")

    def _obs(self, method: str, obs: Any) -> str | list[Message]:
        try:
            messages = as_messages(obs, "user")
        except ObservationError as err:
            raise self._invalid(method, f"returned a bad observation: {err}") from err
        return obs if isinstance(obs, str) else messages

    def _reward(self, reward: Any) -> float:
        if not isinstance(reward, numbers.Real):
            raise self._invalid("step", f"returned reward {reward!r:.80}, not a number")
        value = float(reward)
        if not math.isfinite(value) or abs(value) > self.max_abs_reward:
            raise self._invalid(
                "step",
                f"returned reward {value!r}: must be finite with |reward| <= {self.max_abs_reward}",
            )
        return value

    def _flag(self, name: str, value: Any) -> bool:
        is_numpy_bool = getattr(value, "dtype", None) is not None and value.dtype.kind == "b"
        if not isinstance(value, bool) and not (is_numpy_bool and value.shape == ()):
            raise self._invalid("step", f"returned {name}={value!r:.80}, not a bool")
        return bool(value)

    def _info(self, method: str, info: Any) -> dict[str, Any]:
        if not isinstance(info, Mapping):
            raise self._invalid(method, f"returned info {info!r:.80}, not a dict")
        return dict(info)
