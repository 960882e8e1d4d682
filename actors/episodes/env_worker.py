"""An environment worker process, started by :mod:`actors.episodes.pool` as
``python -I -u -c BOOT ROOT OPTIONS`` (:data:`BOOT`), as a reward worker is
(:mod:`actors.rewards.worker`, whose framing, limits and parent-death signal it reuses).

It loads the environment class once (a built-in, a module's class, or a file's from the copy
the pool took at actor start, passed as a sealed file descriptor), builds one environment and
closes it (so ``env.kwargs`` that do not fit, or a constructor that raises, refuse the start),
answers ``{"ready": true}`` (or the error) and then serves requests, one at a time, each a
4-byte big-endian length and a msgpack map: ``{"id", "op", "session", ...}`` with ``op`` one of

- ``reset`` (``seed``, ``options``): the session's environment, built on its first reset, reset;
  the reply's ``value`` is ``[observation, info]``;
- ``step`` (``action``): ``value`` is ``[observation, reward, terminated, truncated, info]``;
- ``close``: the session's environment closed and forgotten.

Every request may carry ``drop``: sessions to close and forget first (the pool's closes,
batched onto the next request). A session's environment runs in
:class:`~actors.episodes.env.CheckedEnv`, so what it raises or returns wrong comes back as
``{"ok": false, "kind": "raised" | "invalid", "error": ...}``; a good answer as ``{"ok": true,
"value": ...}`` holding plain data only (text, messages, a float, bools, an info dict whose
values msgpack cannot carry are sent as text). The parent checks it all again: the environment's
code can write to the reply channel. Prints of the environment go to stderr, which the pool
forwards to the actor's log.
"""

from __future__ import annotations

import sys
from typing import Any, BinaryIO

import msgpack

from actors.episodes.env import CheckedEnv, EnvFailure, EnvSpecError, load_env_class, make_env
from actors.rewards.worker import confine_and_read, frame, hello, read_frame
from actors.rewards.worker import main as worker_main

BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from actors.episodes.env_worker import main; sys.exit(main(sys.argv[2]))"
)
"""The ``-c`` program that starts a worker: specrl's root first on the path, nothing else."""


class Sessions:
    """The environments of the sessions this worker holds, by session id."""

    def __init__(self, options: dict[str, Any], cls: type) -> None:
        self.spec, self.cls = options["spec"], cls
        self.kwargs = options.get("kwargs") or {}
        self.max_abs_reward = float(options["max_abs_reward"])
        self.envs: dict[int, CheckedEnv] = {}

    def build(self) -> CheckedEnv:
        return make_env(self.spec, self.kwargs, self.max_abs_reward, cls=self.cls)

    def drop(self, session: Any) -> None:
        env = self.envs.pop(session, None)
        if env is not None:
            try:
                env.close()
            except Exception as err:  # noqa: BLE001 - a failing close is the user's, logged
                print(f"environment close raised {err!r:.200}", file=sys.stderr)

    def handle(self, request: dict[str, Any]) -> Any:
        """The value of one request; EnvFailure when the environment failed."""
        op, session = request.get("op"), request.get("session")
        if op == "close":
            self.drop(session)
            return None
        env = self.envs.get(session)
        if op == "reset":
            if env is None:
                try:
                    env = self.envs[session] = self.build()
                except EnvSpecError as err:
                    raise EnvFailure("raised", str(err)) from err
            obs, info = env.reset(seed=int(request["seed"]), options=request.get("options"))
            return [obs, info]
        if op == "step":
            if env is None:
                raise EnvFailure("raised", f"step of session {session!r} before its reset")
            step = env.step(str(request["action"]))
            return [step.obs, step.reward, step.terminated, step.truncated, step.info]
        if op == "drop":
            return None
        raise EnvFailure("invalid", f"unknown request {op!r}")


def reply_frame(call_id: Any, value: Any) -> bytes:
    """The good reply, or an ``invalid`` one when the value cannot go as plain data (an info
    dict with keys that are not text, integers msgpack cannot carry)."""
    try:
        data = frame({"ok": True, "id": call_id, "value": value}, lenient=True)
        msgpack.unpackb(data[4:], raw=False)  # the parent must be able to read it back
        return data
    except Exception as err:  # noqa: BLE001 - whatever the environment's answer held
        error = f"returned what cannot be sent: {type(err).__name__}: {err}"[:500]
        return frame({"ok": False, "id": call_id, "kind": "invalid", "error": error})


def load(options: dict[str, Any]) -> type:
    """The environment class the options name, confined first when they carry limits."""
    return load_env_class(options["spec"], confine_and_read(options))


def serve(options: dict[str, Any], replies: BinaryIO, requests: BinaryIO) -> int:
    def start() -> Sessions:
        sessions = Sessions(options, load(options))
        sessions.build().close()  # env.kwargs that do not fit or a constructor that raises
        return sessions

    sessions = hello(replies, start)
    if sessions is None:
        return 1
    while (request := read_frame(requests)) is not None:
        call_id = request.get("id")
        for session in request.get("drop") or ():
            sessions.drop(session)
        try:
            value = sessions.handle(request)
        except EnvFailure as err:
            reply = {"ok": False, "id": call_id, "kind": err.kind, "error": err.detail[:500]}
            replies.write(frame(reply))
            continue
        replies.write(reply_frame(call_id, value))
    for session in list(sessions.envs):
        sessions.drop(session)
    return 0


def main(options_json: str) -> int:
    """The reward worker's life (:func:`actors.rewards.worker.main`) serving sessions."""
    return worker_main(options_json, serve)
