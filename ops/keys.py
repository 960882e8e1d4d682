"""``specrl keys DIR``: write the CurveZMQ key pairs of the trajectory socket, in the layout
:mod:`common.curve_keys` describes and the sides load."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import zmq
import zmq.auth

from common.curve_keys import ACTOR, AUTHORIZED, LEARNER

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def write_keys(directory: Path, actors: tuple[str, ...] = (ACTOR,)) -> list[Path]:
    """Create the learner pair (kept if it exists: actors already hold its public key) and one
    pair per actor name, each authorized; returns the files written.

    Everything is created under umask 077: secret files are 0600 from the moment they exist
    (pyzmq writes them with the process umask; a chmod afterwards would leave a window in which
    any local user could read them), and the directories this creates are 0700."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    for name in actors:
        if not _NAME.match(name) or name == LEARNER:
            raise ValueError(f"actor key name must match {_NAME.pattern} and not be 'learner'")
    previous = os.umask(0o077)
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        authorized = directory / AUTHORIZED
        authorized.mkdir(exist_ok=True, mode=0o700)
        written: list[Path] = []
        for name in (LEARNER, *actors):
            if (directory / f"{name}.key_secret").exists():
                continue
            public, secret = zmq.auth.create_certificates(str(directory), name)
            Path(secret).chmod(0o600)  # also when the file's mode came from elsewhere
            written += [Path(public), Path(secret)]
            if name != LEARNER:
                shutil.copyfile(public, authorized / f"{name}.key")
                written.append(authorized / f"{name}.key")
    finally:
        os.umask(previous)
    return written
