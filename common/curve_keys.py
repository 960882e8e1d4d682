"""CurveZMQ key pairs for the trajectory socket (``specrl keys DIR`` writes them).

Layout of a key directory: ``learner.key`` / ``learner.key_secret`` (the learner's pair; actors
need only ``learner.key``) and ``actor.key`` / ``actor.key_secret`` (a pair actors present).
With ``security.curve_dir`` set, the link is encrypted and an actor must know the learner's
public key to connect at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

LEARNER = "learner"
ACTOR = "actor"


@dataclass(frozen=True)
class CurveKeys:
    public: bytes
    secret: bytes
    server_public: bytes | None = None
    """Clients only: the learner's public key."""


def write_keys(directory: Path) -> list[Path]:
    """Create the learner and actor key pairs in ``directory`` (secret files are 0600)."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in (LEARNER, ACTOR):
        public, secret = zmq.auth.create_certificates(str(directory), name)
        Path(secret).chmod(0o600)
        written += [Path(public), Path(secret)]
    return written


def learner_keys(directory: Path) -> CurveKeys:
    public, secret = zmq.auth.load_certificate(str(directory / f"{LEARNER}.key_secret"))
    return CurveKeys(public=public, secret=secret)


def actor_keys(directory: Path) -> CurveKeys:
    public, secret = zmq.auth.load_certificate(str(directory / f"{ACTOR}.key_secret"))
    server_public, _ = zmq.auth.load_certificate(str(directory / f"{LEARNER}.key"))
    return CurveKeys(public=public, secret=secret, server_public=server_public)
