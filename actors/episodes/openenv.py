"""Environments served by an OpenEnv server, over its WebSocket session protocol
(``env.name=openenv:ws://host:port``; ``http://host:port`` is read as ``ws://host:port/ws``).

One WebSocket per episode: the server builds an environment instance for each connection (a
session) and drops it when the socket closes. The client sends ``{"type": "reset", "data":
{seed, episode_id, ...}}``, then ``{"type": "step", "data": <action>}`` per turn and
``{"type": "close"}`` at the end; the server answers ``{"type": "observation", "data":
{"observation": {...}, "reward": r, "done": d}}`` or ``{"type": "error", "data": {"message",
"code"}}``. What each code means here:

- ``CAPACITY_REACHED`` (sent as the socket opens, when the server holds ``max_concurrent_envs``
  sessions already): retried with backoff until ``reset_timeout_s``, then a failure;
- ``VALIDATION_ERROR`` on a step (the action does not fit the environment's schema): a malformed
  action: the error is the observation, the episode goes on (``env/malformed_actions``);
- anything else, a closed socket or no answer in time: the call raises, and the runner ends the
  episode as a failed environment (``env.on_failure``).

The action is ``{action_field: <the turn's text>}`` (``message`` by default, as OpenEnv's echo
and chat environments take); the observation's text is its ``observation_field``, else its only
text field, else the observation as compact JSON. Only ``websockets`` is needed (the ``openenv``
extra), not the ``openenv`` package. The environment's code runs in the server's process (its
container, for servers that run in one), never in the actor's.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from common.config.env import openenv_url

CAPACITY_REACHED = "CAPACITY_REACHED"
VALIDATION_ERROR = "VALIDATION_ERROR"
MAX_MESSAGE_BYTES = 1 << 20
"""A server message larger than this fails the call (as the worker pool's reply cap)."""
BACKOFF_S = (0.05, 1.0)
"""First and longest wait between tries of a session refused for capacity."""


class OpenEnvError(RuntimeError):
    """An OpenEnv server's error answer (``code``) or a broken session."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class OpenEnvSession:
    """One episode's session with an OpenEnv server, in the shape of specrl's environments:
    ``reset(seed, options) -> (text, info)``, ``step(text) -> (text, reward, terminated,
    truncated, info)``, ``close()`` (module docstring)."""

    def __init__(
        self,
        url: str,
        action_field: str = "message",
        observation_field: str = "",
        reset_timeout_s: float = 60.0,
        step_timeout_s: float = 30.0,
    ) -> None:
        self.url = openenv_url(url)
        self.action_field, self.observation_field = action_field, observation_field
        self.reset_timeout_s, self.step_timeout_s = reset_timeout_s, step_timeout_s
        self._ws: Any = None

    def reset(self, *, seed: int, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        """A new session (the previous one closed), reset with ``seed``; a server at capacity
        is tried again, waiting longer each time, until ``reset_timeout_s``."""
        self.close()
        options = dict(options or {})
        data = {
            "seed": seed,
            "episode_id": f"specrl-{seed}-{options.get('sibling', 0)}",
            **options,
        }
        deadline = time.monotonic() + self.reset_timeout_s
        wait = BACKOFF_S[0]
        while True:
            try:
                self._ws = self._connect(deadline)
                reply = self._call({"type": "reset", "data": data}, deadline)
                text, _, _, _, info = self._observation(reply)
                return text, info
            except OpenEnvError as err:
                self.close()
                left = deadline - time.monotonic()
                if err.code != CAPACITY_REACHED or left <= 0:
                    raise
                time.sleep(min(wait, left))
                wait = min(2 * wait, BACKOFF_S[1])

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self._ws is None:
            raise OpenEnvError("SESSION_ERROR", "step before reset (or after close)")
        message = {"type": "step", "data": {self.action_field: action}}
        try:
            reply = self._call(message, time.monotonic() + self.step_timeout_s)
        except OpenEnvError as err:
            if err.code != VALIDATION_ERROR:
                raise
            return f"error: {err}", 0.0, False, False, {"malformed": True}
        return self._observation(reply)

    def close(self) -> None:
        """End the session (the server drops its environment); never raises."""
        ws, self._ws = self._ws, None
        if ws is None:
            return
        with contextlib.suppress(Exception):  # a session that is gone already
            ws.send(json.dumps({"type": "close"}))
        with contextlib.suppress(Exception):
            ws.close()

    # ------------------------------------------------------------------ the wire

    def _connect(self, deadline: float) -> Any:
        from websockets.exceptions import WebSocketException
        from websockets.sync.client import connect

        try:
            opened = connect(
                self.url,
                open_timeout=max(deadline - time.monotonic(), 0.1),
                max_size=MAX_MESSAGE_BYTES,
                compression=None,
            )
            return opened.__enter__()  # held for the episode; left in close()
        except (OSError, WebSocketException, TimeoutError) as err:
            raise OpenEnvError("CONNECT", f"{self.url}: {err!r}") from err

    def _call(self, message: dict, deadline: float) -> dict:
        """Send ``message``; the server's next message, an observation's ``data`` (an error
        answer raises :class:`OpenEnvError` with its code)."""
        from websockets.exceptions import ConnectionClosed, WebSocketException

        # A server that refuses the session (capacity) answers as the socket opens and closes
        # it: the send may find it closed while that answer still waits to be read.
        with contextlib.suppress(ConnectionClosed):
            self._ws.send(json.dumps(message))
        try:
            raw = self._ws.recv(timeout=max(deadline - time.monotonic(), 0.01))
        except TimeoutError as err:
            raise OpenEnvError("TIMEOUT", f"no answer from {self.url} in time") from err
        except (OSError, WebSocketException) as err:
            raise OpenEnvError("SESSION_ERROR", f"{self.url}: {err!r}") from err
        try:
            reply = json.loads(raw)
        except (TypeError, ValueError) as err:
            raise OpenEnvError("INVALID_JSON", f"the server sent {str(raw)[:80]!r}") from err
        kind = reply.get("type") if isinstance(reply, dict) else None
        data = reply.get("data") if isinstance(reply, dict) else None
        if kind == "error" and isinstance(data, dict):
            raise OpenEnvError(str(data.get("code", "ERROR")), str(data.get("message", "")))
        if kind != "observation" or not isinstance(data, dict):
            raise OpenEnvError("UNKNOWN_TYPE", f"expected an observation, got {str(raw)[:80]!r}")
        return data

    def _observation(self, data: dict) -> tuple[str, float, bool, bool, dict]:
        obs = data.get("observation")
        if not isinstance(obs, dict):
            raise OpenEnvError("INVALID", f"an observation that is not an object: {obs!r:.80}")
        reward = data.get("reward")
        return self._text(obs), 0.0 if reward is None else reward, bool(data.get("done")), False, {}

    def _text(self, obs: dict) -> str:
        if self.observation_field:
            if self.observation_field not in obs:
                raise OpenEnvError(
                    "INVALID", f"the observation has no field {self.observation_field!r}"
                )
            return str(obs[self.observation_field])
        texts = [v for k, v in obs.items() if isinstance(v, str) and k != "metadata"]
        if len(texts) == 1:
            return texts[0]
        return json.dumps(obs, sort_keys=True, separators=(",", ":"), default=str)
