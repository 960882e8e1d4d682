"""A small OpenEnv server for tests: OpenEnv's WebSocket session protocol on loopback
(``/ws``: one environment per connection, ``reset``/``step``/``close`` messages, observation and
error answers with OpenEnv's codes), without the ``openenv`` package.

Its environment counts turns: ``reset(seed)`` answers ``start <seed % 10>``; each step answers
``heard <the first 8 characters>``, rewards the message's length mod 3 and is done after
``turns`` steps. An action without a text ``message`` is a schema error (``VALIDATION_ERROR``).
``max_sessions`` caps the sessions at once (``CAPACITY_REACHED`` as a socket opens beyond it);
:meth:`die` drops every connection and stops listening, as a crashed server would.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from websockets.sync.server import ServerConnection, serve


class FakeOpenEnv:
    """The server, listening on 127.0.0.1 (an ephemeral port) from a thread of its own."""

    def __init__(self, max_sessions: int = 64, turns: int = 2) -> None:
        self.max_sessions, self.turns = max_sessions, turns
        self.lock = threading.Lock()
        self.active: set[ServerConnection] = set()
        self.opened = self.refused = self.most = self.steps = 0
        self.resets: list[dict] = []
        self._server = serve(self._session, "127.0.0.1", 0)
        self.port = self._server.socket.getsockname()[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def die(self) -> None:
        """Stop listening and drop every open session (no close message)."""
        self._server.shutdown()
        with self.lock:
            sessions = list(self.active)
        for ws in sessions:
            ws.socket.close()

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=5)

    def _session(self, ws: ServerConnection) -> None:
        with self.lock:
            full = len(self.active) >= self.max_sessions
            if full:
                self.refused += 1
            else:
                self.active.add(ws)
                self.opened += 1
                self.most = max(self.most, len(self.active))
        if full:
            ws.send(error("CAPACITY_REACHED", "the server holds its most sessions"))
            return
        try:
            self._serve(ws)
        finally:
            with self.lock:
                self.active.discard(ws)

    def _serve(self, ws: ServerConnection) -> None:
        seed, steps = 0, 0
        for raw in ws:
            message = json.loads(raw)
            kind, data = message.get("type"), message.get("data")
            if kind == "close":
                return
            if kind == "reset":
                with self.lock:
                    self.resets.append(dict(data))
                seed, steps = int(data.get("seed", 0)), 0
                ws.send(observation(f"start {seed % 10}", None, False))
            elif kind == "step":
                if not isinstance(data, dict) or not isinstance(data.get("message"), str):
                    ws.send(error("VALIDATION_ERROR", f"invalid action {data!r}"))
                    continue
                steps += 1
                with self.lock:
                    self.steps += 1
                text = data["message"]
                ws.send(observation(f"heard {text[:8]}", len(text) % 3, steps >= self.turns))
            else:
                ws.send(error("UNKNOWN_TYPE", f"unknown message type {kind!r}"))


def observation(text: str, reward: Any, done: bool) -> str:
    return json.dumps(
        {
            "type": "observation",
            "data": {"observation": {"text": text, "metadata": {}}, "reward": reward, "done": done},
        }
    )


def error(code: str, message: str) -> str:
    return json.dumps({"type": "error", "data": {"message": message, "code": code}})
