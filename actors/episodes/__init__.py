"""Multi-turn episodes: the environment interface and its loader (:mod:`.env`), and the
built-in environments (:mod:`.builtin`). The turn loop is not wired into the actor yet."""

from actors.episodes.env import (
    FAILURE_KINDS,
    CheckedEnv,
    EnvFailure,
    EnvSpecError,
    StepResult,
    load_env_class,
    make_env,
)

__all__ = [
    "FAILURE_KINDS",
    "CheckedEnv",
    "EnvFailure",
    "EnvSpecError",
    "StepResult",
    "load_env_class",
    "make_env",
]
