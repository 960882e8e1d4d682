"""A reward function named by ``<module or file>:<function>``, how it is called, and how what it
returns becomes one reward with named components.

The call is ``fn(prompt=..., completion=..., row=...)``: the prompt text, the decoded completion
(before EOS) and the data row (a dict: every column of a data set's row; ``prompt``, ``answer``
and ``prompt_id`` for built-in tasks). It returns a number, or a dict of named numbers (the
components), summed with ``task.reward_weights`` (1 for a component the weights do not name).
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REWARD_ARGUMENTS = ("prompt", "completion", "row")
"""The keyword arguments every reward function is called with."""

FAILURE_KINDS = ("raised", "timeout", "nonfinite", "invalid", "crashed")
"""Why a call gave no reward: the function raised, ran past ``task.reward_timeout_s``, returned
NaN or an infinity, returned something that is not a number or a dict of numbers, or its worker
process died (a segfault, ``sys.exit``, the sandbox's memory limit) or a replacement worker could
not start."""


MAX_COMPONENTS = 32
"""The most named components one call may return (and distinct names one pool accepts)."""
MAX_COMPONENT_NAME = 64
COMPONENT_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
RESERVED_COMPONENTS = frozenset({"failed", "mean", "max", "min", "std", "sum", "count", "total"})
"""Component names that would stand in for specrl's own figures (``reward/failed``, the
learner's ``reward_mean``...); ``failed_*`` is reserved too."""


class RewardSpecError(ValueError):
    """A ``task.reward`` that does not name a usable function."""


def parse_reward_spec(spec: str) -> tuple[str, str]:
    """``(target, function)`` of ``spec``: a ``.py`` file path or a dotted module name, then the
    function's name after the last ``:``. Only the form is checked here (the file or module is
    looked up where the function is loaded)."""
    target, sep, function = spec.rpartition(":")
    if not sep or not target or not function:
        raise RewardSpecError(
            f"task.reward={spec!r}: expected <module or file.py>:<function>, "
            "e.g. my_rewards:score or rewards/math.py:score"
        )
    if not function.isidentifier():
        raise RewardSpecError(f"task.reward={spec!r}: {function!r} is not a function name")
    if not target.endswith(".py") and not all(p.isidentifier() for p in target.split(".")):
        raise RewardSpecError(
            f"task.reward={spec!r}: {target!r} is neither a .py file nor a dotted module name"
        )
    return target, function


def absolute_spec(spec: str, base: Path | None = None) -> str:
    """``spec`` with a file target made absolute (from ``base``, default the working directory),
    so a worker started elsewhere (the sandbox's empty directory) loads the same file."""
    target, function = parse_reward_spec(spec)
    if not target.endswith(".py"):
        return spec
    return f"{((base or Path.cwd()) / target).resolve()}:{function}"


def load_reward_function(spec: str) -> Callable[..., Any]:
    """The function ``spec`` names, checked to accept the three reward arguments."""
    target, name = parse_reward_spec(spec)
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise RewardSpecError(f"task.reward={spec!r}: no file {path}")
        return load_reward_source(path.read_bytes(), str(path), spec)
    try:
        module = importlib.import_module(target)
    except ModuleNotFoundError as err:
        raise RewardSpecError(f"task.reward={spec!r}: no module {target!r} ({err})") from err
    return _checked(module, spec)


def load_reward_source(source: bytes, filename: str, spec: str) -> Callable[..., Any]:
    """The function ``spec`` names in ``source``, the text of its file ``filename`` (the copy the
    pool took at actor start: the file itself may have changed since)."""
    module_name = f"specrl_user_reward_{Path(filename).stem}"
    module = types.ModuleType(module_name)
    module.__file__ = filename
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - the user's reward
    return _checked(module, spec)


def _checked(module: types.ModuleType, spec: str) -> Callable[..., Any]:
    target, name = parse_reward_spec(spec)
    function = getattr(module, name, None)
    if function is None or not callable(function):
        raise RewardSpecError(f"task.reward={spec!r}: {target} has no function {name!r}")
    try:
        inspect.signature(function).bind(**dict.fromkeys(REWARD_ARGUMENTS))
    except TypeError as err:
        raise RewardSpecError(
            f"task.reward={spec!r}: {name} must accept the keyword arguments "
            f"{', '.join(REWARD_ARGUMENTS)} (or **kwargs): {err}"
        ) from err
    except ValueError:
        pass  # no signature to read (a builtin): the call itself will tell
    return function


@dataclass(frozen=True)
class RewardOutcome:
    """One call's result: the reward the completion gets and its components, or why it failed
    (then ``reward`` is the failure reward and ``components`` is empty)."""

    reward: float
    components: dict[str, float] = field(default_factory=dict)
    failure: str | None = None
    """One of :data:`FAILURE_KINDS`, or None."""
    detail: str = ""
    """The failure's message (the exception, the limit that was hit)."""


def combine(value: Any, weights: Mapping[str, float], failure_reward: float = 0.0) -> RewardOutcome:
    """The outcome of a function that returned ``value``: a real number is the reward; a dict of
    named real numbers is summed with ``weights``. Anything else, or a non-finite number anywhere,
    is a failure with ``failure_reward``."""
    if isinstance(value, Mapping):
        if len(value) > MAX_COMPONENTS:
            why = f"{len(value)} components (at most {MAX_COMPONENTS})"
            return _failed(failure_reward, "invalid", why)
        components: dict[str, float] = {}
        for key, part in value.items():
            refusal = component_name_refusal(key)
            if refusal is not None:
                return _failed(failure_reward, "invalid", refusal)
            if not _is_real(part):
                return _failed(failure_reward, "invalid", f"component {key!r}={part!r:.80}")
            components[key] = float(part)
        if not components:
            return _failed(failure_reward, "invalid", "an empty dict of components")
        total = sum(weights.get(k, 1.0) * v for k, v in components.items())
    elif _is_real(value):
        total, components = float(value), {}
    else:
        return _failed(failure_reward, "invalid", f"returned {type(value).__name__} {value!r:.80}")
    if not all(math.isfinite(v) for v in (total, *components.values())):
        return _failed(failure_reward, "nonfinite", f"returned {value!r:.80}")
    return RewardOutcome(reward=total, components=components)


def component_name_refusal(name: Any) -> str | None:
    """Why ``name`` cannot name a component (it becomes the metric ``reward/<name>``), or None:
    a letter then letters, digits or ``_``, at most :data:`MAX_COMPONENT_NAME` characters, not
    one of :data:`RESERVED_COMPONENTS` nor ``failed_*``."""
    if not isinstance(name, str):
        return f"component name {name!r:.80} is not a string"
    if len(name) > MAX_COMPONENT_NAME:
        return f"component name {name[:40]!r}... is over {MAX_COMPONENT_NAME} characters"
    if not COMPONENT_NAME.fullmatch(name):
        return f"component name {name!r} is not a letter then letters, digits or _"
    if name.lower() in RESERVED_COMPONENTS or name.lower().startswith("failed"):
        return f"component name {name!r} is reserved for specrl's own reward figures"
    return None


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real)  # bool too: ``return answer == expected`` is 0 or 1


def _failed(reward: float, kind: str, detail: str) -> RewardOutcome:
    return RewardOutcome(reward=reward, failure=kind, detail=detail)
