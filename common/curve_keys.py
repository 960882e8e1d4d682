"""CurveZMQ key pairs for the trajectory socket (``specrl keys DIR`` writes them).

Layout of a key directory:

- ``learner.key`` / ``learner.key_secret``: the learner's pair (actors need only ``learner.key``);
- ``{name}.key`` / ``{name}.key_secret``: one pair per actor name (``actor`` unless named), which
  the actor presents (``security.actor_key=NAME``);
- ``authorized/{name}.key``: the actor public keys the learner lets in (its ZAP allow-list).
  Revoking an actor is deleting its file there; the learner notices without a restart.

With ``security.curve_dir`` set, the link is encrypted, an actor must know the learner's public
key to connect at all, and the learner accepts only the keys in ``authorized/``.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

LEARNER = "learner"
ACTOR = "actor"
AUTHORIZED = "authorized"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    secret: bytes
    server_public: bytes | None = None
    """Clients only: the learner's public key."""


def write_keys(directory: Path, actors: tuple[str, ...] = (ACTOR,)) -> list[Path]:
    """Create the learner pair (kept if it exists: actors already hold its public key) and one
    pair per actor name, each authorized; returns the files written. Secret files are 0600."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    for name in actors:
        if not _NAME.match(name) or name == LEARNER:
            raise ValueError(f"actor key name must match {_NAME.pattern} and not be 'learner'")
    directory.mkdir(parents=True, exist_ok=True)
    authorized = directory / AUTHORIZED
    authorized.mkdir(exist_ok=True)
    written: list[Path] = []
    for name in (LEARNER, *actors):
        if (directory / f"{name}.key_secret").exists():
            continue
        public, secret = zmq.auth.create_certificates(str(directory), name)
        Path(secret).chmod(0o600)
        written += [Path(public), Path(secret)]
        if name != LEARNER:
            shutil.copyfile(public, authorized / f"{name}.key")
            written.append(authorized / f"{name}.key")
    return written


def learner_keys(directory: Path) -> CurveKeys:
    public, secret = zmq.auth.load_certificate(str(directory / f"{LEARNER}.key_secret"))
    return CurveKeys(public=public, secret=secret)


def authorized_dir(directory: Path) -> Path:
    return directory / AUTHORIZED


def actor_keys(directory: Path, name: str = ACTOR) -> CurveKeys:
    public, secret = zmq.auth.load_certificate(str(directory / f"{name}.key_secret"))
    server_public, _ = zmq.auth.load_certificate(str(directory / f"{LEARNER}.key"))
    return CurveKeys(public=public, secret=secret, server_public=server_public)
