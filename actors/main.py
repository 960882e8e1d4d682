"""Runs one actor: follows weights versions in Redis, generates rollouts, streams them to the learner."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn

from actors.loop import run
from common.entrypoint import run_main


def main(argv: list[str] | None = None) -> int:
    return run_main(argv, "specrl-actor", __doc__, run, role="actor")


def exit_now(code: int) -> NoReturn:
    """End the actor process with ``code`` once :func:`main` has returned, skipping the
    interpreter's teardown.

    By then the actor has stopped: its groups are acked (or spooled, with ``actor.spool``), its
    ledger, spool, sender, weight feed and exporter are closed, and its logs are flushed here.
    What is left is Python's finalization, which garbage-collects every module's objects
    (torch's, and with ``engine=vllm`` vLLM's, whose engine shutdown runs a full collection of
    its own): 10-12 s for the tiny model on vLLM on two busy CPU cores, on top of the stop
    itself, against the launcher's 20 s grace period (``ops/processes.py`` ``STOP_GRACE_S``);
    with a real model that got vLLM actors killed. The operating system frees the memory, the
    KV cache included, at once.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing to write to
            stream.flush()
    os._exit(code)


def cli() -> NoReturn:
    """The ``specrl-actor`` console script: :func:`main`, then :func:`exit_now`."""
    exit_now(main())


if __name__ == "__main__":
    cli()
