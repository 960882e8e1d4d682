"""CurveZMQ key pairs for the trajectory socket: the layout of a key directory and how each side
loads its pair (``ops/keys.py`` writes them: ``specrl keys DIR``).

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

import logging
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

logger = logging.getLogger(__name__)

LEARNER = "learner"
ACTOR = "actor"
AUTHORIZED = "authorized"


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    secret: bytes
    server_public: bytes | None = None
    """Clients only: the learner's public key."""


def secret_key_exposure(path: Path) -> str | None:
    """Why the secret key file ``path`` is readable beyond its owner, or None (mode 0600 or
    tighter: ``specrl keys`` writes them so)."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        return (
            f"{path} has mode {mode:04o}: other local users can read this secret key "
            f"(chmod 600 {path})"
        )
    return None


def _load_secret(path: Path) -> tuple[bytes, bytes | None]:
    """``zmq.auth.load_certificate``, with a warning when the file is readable beyond its owner."""
    exposure = secret_key_exposure(path) if path.is_file() else None
    if exposure is not None:
        logger.warning("%s", exposure)
    return zmq.auth.load_certificate(str(path))


def learner_keys(directory: Path) -> CurveKeys:
    public, secret = _load_secret(directory / f"{LEARNER}.key_secret")
    return CurveKeys(public=public, secret=secret)


def authorized_dir(directory: Path) -> Path:
    return directory / AUTHORIZED


def actor_keys(directory: Path, name: str = ACTOR) -> CurveKeys:
    public, secret = _load_secret(directory / f"{name}.key_secret")
    server_public, _ = zmq.auth.load_certificate(str(directory / f"{LEARNER}.key"))
    return CurveKeys(public=public, secret=secret, server_public=server_public)
