"""The ``env`` section: multi-turn episodes against an environment (``env.name``), the budgets of
a turn and of an episode, how observations are capped and rendered, and what an environment
failure costs. Empty ``env.name``: single-turn, as before (every other field is then unused).

The actor's turn loop (``actors/episodes/runner.py``) reads it, as do the chat bridge
(``common/chat_bridge.py``) and the environment interface (``actors/episodes/env.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from common.config.checks import require, require_at_least, require_choice, require_positive

if TYPE_CHECKING:
    from common.config.actor import EngineConfig
    from common.config.learner import LearnerConfig

TURN_LENGTH_MODES = ("close", "end")
"""``env.turn_length``: a turn cut by ``env.max_turn_tokens`` gets the end-of-turn token(s) as
environment tokens and the episode goes on (``close``), or the episode ends (``end``)."""
OBS_ROLES = ("user", "tool")
"""``env.obs_role``: the chat role a text observation is rendered in."""
ENV_FAILURE_MODES = ("drop_group", "zero")
"""``env.on_failure``: an episode whose environment crashed, hung or answered garbage drops its
whole group, or keeps its sampled tokens and gets ``env.failure_reward``."""
CHECK_BRIDGE_MODES = ("first", "always", "off")
"""``env.check_bridge``: probe the chat bridge against full re-renders once at start, at every
bridge (debugging), or not at all."""
BUILTIN_ENVS = ("lookup", "guess_number")
"""``env.name`` values that name a built-in environment (``actors/episodes/builtin.py``)."""


OPENENV_PREFIX = "openenv:"
"""``env.name=openenv:<url>``: the environment is served by an OpenEnv server at ``url``
(``actors/episodes/openenv.py``)."""


def openenv_url(url: str) -> str:
    """The WebSocket address of an OpenEnv server's ``url``: ``ws``/``wss`` as given (``/ws``
    added to an empty path), ``http``/``https`` as ``ws``/``wss`` with ``/ws`` added to its path.
    ValueError for anything else."""
    parts = urlsplit(url)
    schemes = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}
    if parts.scheme not in schemes or not parts.hostname:
        raise ValueError(
            f"env.name={OPENENV_PREFIX}{url}: expected {OPENENV_PREFIX}ws://host:port (or "
            "http://host:port) of an OpenEnv server"
        )
    path = parts.path.rstrip("/")
    if parts.scheme.startswith("http") or not path:
        path = f"{path}/ws"
    return urlunsplit((schemes[parts.scheme], parts.netloc, path, parts.query, ""))


def env_spec_refusal(spec: str) -> str | None:
    """Why ``spec`` cannot name an environment (the form only), or None: a built-in name,
    ``openenv:<url>`` or ``<module or file.py>:<Class>``."""
    if spec in BUILTIN_ENVS:
        return None
    if spec.startswith(OPENENV_PREFIX):
        try:
            openenv_url(spec[len(OPENENV_PREFIX) :])
        except ValueError as err:
            return str(err)
        return None
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        return (
            f"env.name={spec!r}: expected a built-in environment ({', '.join(BUILTIN_ENVS)}) or "
            "<module or file.py>:<Class>, e.g. my_envs:GuessNumber or envs/guess.py:GuessNumber"
        )
    if not name.isidentifier():
        return f"env.name={spec!r}: {name!r} is not a class name"
    if not target.endswith(".py") and not all(p.isidentifier() for p in target.split(".")):
        return f"env.name={spec!r}: {target!r} is neither a .py file nor a dotted module name"
    return None


@dataclass
class EnvConfig:
    name: str = ""
    """The environment of multi-turn episodes: ``""`` (single-turn, no environment), a built-in
    (``lookup``, ``guess_number``), or ``<module>:<Class>`` / ``<file.py>:<Class>`` (your Gymnasium-shaped text
    environment: ``reset(*, seed, options)``, ``step(action)``, sync or async)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's constructor."""
    max_turns: int = 8
    """Model turns per episode, at most."""
    max_turn_tokens: int = 64
    """Tokens one model turn may sample."""
    max_total_tokens: int = 2048
    """Prompt + every turn + every observation of one episode, at most."""
    max_obs_tokens: int = 512
    """Tokens of one environment step's observation content; longer: the head is kept and a
    truncation marker appended."""
    max_obs_chars: int = 16384
    """Characters of one observation message, capped before tokenising: the head is kept and
    ``…[truncated N chars]`` appended."""
    turn_length: str = "close"
    """A turn cut by ``env.max_turn_tokens``: ``close`` (the end-of-turn token(s) are appended as
    environment tokens and the episode goes on) or ``end`` (the episode ends unfinished)."""
    obs_role: str = "user"
    """Chat role a text observation is rendered in: ``user`` or ``tool``."""
    workers: int = 0
    """Worker processes that run the environment (``actors/episodes/pool.py``), each holding
    several episodes' sessions: a crash, hang or oversize answer fails its own episode, the
    worker is replaced and its other episodes are replayed onto the new one; 0: threads of the
    actor's process (trusted environments, such as the built-ins)."""
    problems_in_flight: int = 0
    """Problems whose episodes run at once, out of a batch's ``actor.prompts_per_batch``: the
    next problem's episodes start as an earlier problem's group ends, in the same decode loop
    (continuous admission). 0: all of the batch's at once. With many problems per batch and a
    few in flight, the decode loop keeps rows to decode while other episodes wait on their
    environment, and only the last groups of the batch leave it idle."""
    sandbox: bool = False
    """Run the environment's worker processes confined, for environments that execute
    model-written code: bubblewrap as for ``task.reward_sandbox`` (read-only system and Python,
    no home, run or working directory, own pid and network namespaces, address-space, file-size
    and process limits, an allow-listed environment). Needs ``env.workers >= 1``; refused at
    start where bubblewrap is missing or cannot make namespaces."""
    step_timeout_s: float = 30.0
    """An environment ``step`` still running after this long fails its episode (``timeout``)."""
    reset_timeout_s: float = 60.0
    """An environment ``reset`` still running after this long fails its episode (``timeout``)."""
    episode_timeout_s: float = 600.0
    """An episode still running after this long fails (``timeout``)."""
    on_failure: str = "drop_group"
    """An episode whose environment crashed, hung, raised or returned something invalid:
    ``drop_group`` (its group is not sent, counted) or ``zero`` (it keeps its sampled tokens and
    gets ``env.failure_reward``, counted)."""
    failure_reward: float = 0.0
    """``env.on_failure=zero``: the reward of a failed episode."""
    check_bridge: str = "first"
    """Probe the chat template's turn-by-turn bridge against full re-renders: ``first`` (once
    at start; a template that rewrites history stops the actor), ``always`` (also every ended
    episode's conversation, for debugging: a difference is logged and counted in
    ``env/bridge_mismatches``) or ``off``."""

    def __post_init__(self) -> None:
        if self.name:
            refusal = env_spec_refusal(self.name)
            require(refusal is None, str(refusal))
        require(
            all(isinstance(k, str) for k in self.kwargs),
            f"env.kwargs must map names to values, got {dict(self.kwargs)!r}",
        )
        require_at_least(
            "env", self, max_turns=1, max_turn_tokens=1, workers=0, problems_in_flight=0
        )
        require_at_least("env", self, max_obs_tokens=1, max_obs_chars=1)
        require(
            not self.name.startswith(OPENENV_PREFIX) or (self.workers == 0 and not self.sandbox),
            f"env.name={self.name}: the OpenEnv server runs the environment; env.workers and "
            "env.sandbox are for environments specrl runs itself (set env.workers=0)",
        )
        require(
            not self.sandbox or self.workers >= 1,
            "env.sandbox=true confines the environment's worker processes: set env.workers >= 1",
        )
        require(
            self.max_turn_tokens <= self.max_total_tokens,
            f"env.max_turn_tokens={self.max_turn_tokens} must be <= "
            f"env.max_total_tokens={self.max_total_tokens}",
        )
        require(
            self.max_obs_tokens < self.max_total_tokens,
            f"env.max_obs_tokens={self.max_obs_tokens} must be below "
            f"env.max_total_tokens={self.max_total_tokens}",
        )
        require_choice("env.turn_length", self.turn_length, TURN_LENGTH_MODES)
        require_choice("env.obs_role", self.obs_role, OBS_ROLES)
        require_choice("env.on_failure", self.on_failure, ENV_FAILURE_MODES)
        require_choice("env.check_bridge", self.check_bridge, CHECK_BRIDGE_MODES)
        require_positive("env", self, "step_timeout_s", "reset_timeout_s", "episode_timeout_s")
        require(
            self.step_timeout_s <= self.episode_timeout_s
            and self.reset_timeout_s <= self.episode_timeout_s,
            f"env.step_timeout_s={self.step_timeout_s} and env.reset_timeout_s="
            f"{self.reset_timeout_s} must be <= env.episode_timeout_s={self.episode_timeout_s}",
        )
        require(
            self.failure_reward == self.failure_reward and abs(self.failure_reward) < float("inf"),
            f"env.failure_reward must be a finite number, got {self.failure_reward}",
        )

    @property
    def enabled(self) -> bool:
        """Whether episodes are multi-turn (an environment is named)."""
        return bool(self.name)


def check_env_bounds(env: EnvConfig, learner: LearnerConfig, engine: EngineConfig) -> None:
    """An episode the actor may build is one the learner admits and the engine can hold: with an
    environment, ``env.max_total_tokens`` is at most ``learner.max_seq_tokens`` (when set) and,
    on vLLM, ``engine.vllm_max_model_len``; ``env.failure_reward`` is within
    ``learner.max_abs_reward``."""
    if not env.enabled:
        return
    require(
        engine.name == "torch",
        f"env.name={env.name!r} runs episodes on the torch engine (its turn-request stream); "
        f"got engine={engine.name}",
    )
    require(
        not learner.max_seq_tokens or env.max_total_tokens <= learner.max_seq_tokens,
        f"env.max_total_tokens={env.max_total_tokens} must be <= learner.max_seq_tokens="
        f"{learner.max_seq_tokens}: the learner would refuse the longest episode as too_long",
    )
    require(
        engine.name != "vllm" or env.max_total_tokens <= engine.vllm_max_model_len,
        f"env.max_total_tokens={env.max_total_tokens} must be <= engine.vllm_max_model_len="
        f"{engine.vllm_max_model_len}: vLLM could not hold the longest episode",
    )
    require(
        abs(env.failure_reward) <= learner.max_abs_reward,
        f"env.failure_reward={env.failure_reward} must be within learner.max_abs_reward="
        f"{learner.max_abs_reward}: the learner would refuse the failed episode's group",
    )
