"""What every entry point does before ``run(cfg)``: parse Hydra overrides, set up logging."""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping

from common.config import SpecRLConfig, load_config
from common.config.actor import ActorConfig
from common.config.gpu_profile import UnusualLearningRate
from common.config.memory_fit import FitError
from common.config.run import RunConfig, is_loopback_host
from common.process_start import Role, check_saved, prepare, remember

PUBLISH_HOST_ENV = "SPECRL_PUBLISH_HOST"
"""The host interface the compose files publish the learner's and Redis' ports on (Docker's
``ports: HOST:PORT:PORT``); the learner reads it to refuse a wider one without CurveZMQ."""

DUMPABLE_ENV = "SPECRL_DUMPABLE"
"""``SPECRL_DUMPABLE=1`` keeps the learner and actors dumpable (a profiler or memory sampler of
the same, unprivileged user needs it); by default they make themselves non-dumpable."""
_PR_SET_DUMPABLE = 4

OVERRIDES_HELP = f"""\
Overrides are Hydra's KEY=VALUE (see configs/ and common/config/ for every field). Main ones:
  actor.num_actors=N        actors launched by `specrl run` (default {ActorConfig.num_actors})
  task=reverse|addition     built-in task and tiny model (task=scratchpad model=small: long answers)
  model=smollm2-135m task=word_problems   a real pretrained model (SmolLM2-135M-Instruct,
                            needs SPECRL_WITH_REAL=1 bash scripts/setup.sh) on word problems
  task=dataset task.path=FILE model.path=HF_DIR   your own JSONL/Parquet data and HF model
                            (README "Train your own model")
  run.max_wall_s=SECONDS    end the run (with its checkpoint) after this long
  run.steps=N               learner optimizer steps (default {RunConfig.steps})
  run.name=NAME             run id (Redis key prefix, run directory runs/NAME)
  learner.max_staleness=K   drop groups more than K versions behind (0 = on-policy)
  learner.address=tcp://HOST:5555   where actors reach the learner
  redis.url=redis://HOST:6379/0   external Redis (default: a private one); its password
                            goes in the environment: SPECRL_REDIS_PASSWORD=...
"""


def publish_refusal(cfg: SpecRLConfig, environ: Mapping[str, str] | None = None) -> str | None:
    """Why the learner must not start, or None: its trajectory port is published beyond the
    loopback (``$SPECRL_PUBLISH_HOST``, set by the compose files) while ``security.curve_dir``
    is empty, so anyone who reaches the port could send groups the learner trains on."""
    host = (os.environ if environ is None else environ).get(PUBLISH_HOST_ENV, "").strip()
    if not host or is_loopback_host(host) or cfg.security.curve_dir:
        return None
    return (
        f"{PUBLISH_HOST_ENV}={host} publishes the trajectory socket beyond this machine, and "
        "security.curve_dir is empty: anyone who reaches the port could send groups the learner "
        "trains on. Write keys (`specrl keys DIR`), mount DIR and add security.curve_dir=DIR to "
        f"LEARNER_ARGS and ACTOR_ARGS, or publish on the loopback ({PUBLISH_HOST_ENV}=127.0.0.1)"
    )


def make_non_dumpable(environ: Mapping[str, str] | None = None) -> bool:
    """``prctl(PR_SET_DUMPABLE, 0)``: other processes of the same user (a reward's code, say) can
    no longer read this one's ``/proc/<pid>/environ`` (the Redis password), memory or file
    descriptors, nor ptrace it, and it writes no core dump. True when done; off with
    ``SPECRL_DUMPABLE=1``."""
    if (os.environ if environ is None else environ).get(DUMPABLE_ENV) == "1":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0


def parse(argv: list[str], prog: str, description: str) -> SpecRLConfig | None:
    """Config from ``argv`` overrides; prints help and returns None for -h/--help."""
    if any(a in ("-h", "--help") for a in argv):
        print(f"usage: {prog} [KEY=VALUE ...]\n\n{description}\n\n{OVERRIDES_HELP}")
        return None
    bad = [a for a in argv if "=" not in a]
    if bad:
        raise SystemExit(f"{prog}: expected KEY=VALUE overrides, got {bad}\n\n{OVERRIDES_HELP}")
    try:
        cfg = load_config(argv)
    except Exception as e:  # noqa: BLE001 - the boundary: any config error becomes one clear line
        raise SystemExit(f"{prog}: invalid configuration: {e}") from e
    logging.basicConfig(
        level=getattr(logging, cfg.run.log_level.upper(), logging.INFO),
        format=f"%(asctime)s {prog} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    return cfg


def run_main(
    argv: list[str] | None,
    prog: str,
    description: str | None,
    run: Callable[[SpecRLConfig], object],
    role: Role | None = None,
) -> int:
    """A process entry point: ``run(cfg)`` on the config of ``argv`` (default: the command line);
    exit status 0 (help printed, or ``run`` returned). ``description`` heads the help (an entry
    module passes its docstring). ``role`` (``learner``, ``actor``): the resolve step
    (:func:`common.process_start.prepare`) runs once: here for an actor, in ``setup`` for the
    learner (which needs its memory first); a config it refuses (an unusual learning rate, a
    learner that cannot fit) exits with the reason; when ``run`` returns, the config is checked
    against the resolved one saved in the run directory. Run from its own command line, the
    process first makes itself non-dumpable (:func:`make_non_dumpable`) and creates what it
    writes (the run directory, checkpoints, logs) for its user alone (umask 077, as ``specrl
    run`` does for its children), and a fatal signal (a C++ abort in gloo, libzmq or a kernel, a
    segfault) prints every thread's Python stack to its log (stderr) before it dies."""
    if role is not None and argv is None:  # the learner's or an actor's own process
        make_non_dumpable()
        os.umask(0o077)
        faulthandler.enable()
    overrides = sys.argv[1:] if argv is None else argv
    cfg = parse(overrides, prog, description or "")
    if cfg is None:
        return 0
    try:
        if role == "actor":
            prepare(cfg, overrides, role)
        elif role == "learner":
            remember(overrides)
        run(cfg)
    except (UnusualLearningRate, FitError) as e:
        raise SystemExit(f"{prog}: invalid configuration: {e}") from e
    if role is not None:
        check_saved(cfg, role)
    return 0


class StopFlag:
    """Set by SIGTERM/SIGINT; loops poll it between phases so a stop never cuts a step in half
    (the learner checkpoints, the actor flushes its outbox)."""

    def __init__(self, who: str) -> None:
        self.who = who
        self.requested = False
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        logging.getLogger(__name__).info(
            "%s: signal %d, stopping after the current phase", self.who, signum
        )
        self.requested = True

    def __call__(self) -> bool:
        return self.requested
