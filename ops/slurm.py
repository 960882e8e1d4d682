"""``specrl slurm``: write the sbatch script that runs specrl on a Slurm allocation.

Layout of the job (N nodes of G GPUs, the first L of them the learner's):

- node 0: Redis (the weights versions, in memory, behind a password) and learner rank 0;
- nodes 0..L-1: the learner under ``torchrun``, G ranks per node (FSDP2), static rendezvous at
  node 0 so that global rank 0, the one that binds the trajectory port, is on node 0;
- nodes L..N-1: the actors, one per GPU (``srun --gpus-per-task=1``); actor i is task i of the
  step (``SLURM_PROCID``), named ``{run}-actor-{i}``, so a resubmitted job finds its spools.

Secrets live on the shared filesystem under ``{shared}/{run}/secrets`` (0700): the Redis password
(a 0600 file made once per run, read into the environment of the steps, never on a command line)
and the CurveZMQ keys written by ``specrl keys`` (0700 directories, 0600 files). The script
refuses to start if anything there is readable beyond its owner.

The script is a pure function of the options (golden files: tests/golden/slurm_*.sbatch).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
PATH = re.compile(r"^/[A-Za-z0-9_.+/-]*$")
IMAGE = re.compile(r"^[A-Za-z0-9_.:/@#+-]+$")
SLURM_VALUE = re.compile(r"^[A-Za-z0-9_.:,+-]+$")
MEMORY = re.compile(r"^[0-9]+(b|kb|mb|gb)?$", re.IGNORECASE)
OVERRIDE = re.compile(r"^[+~]{0,2}[A-Za-z_][A-Za-z0-9_.]*=")
# Overrides the script sets itself: the run's identity, addresses and keys.
RESERVED = (
    "run.name",
    "run.dir",
    "redis.url",
    "learner.bind",
    "learner.address",
    "security.curve_dir",
    "actor.index",
    "actor.actor_id",
    "actor.device",
)

REDIS_PORT = 6379
LEARNER_PORT = 5555
RENDEZVOUS_PORT = 29500


class SlurmError(ValueError):
    """Options that cannot make a working job; the message says which and why."""


@dataclass(frozen=True)
class SlurmJob:
    run_name: str
    nodes: int
    gpus_per_node: int
    shared_dir: str
    learner_nodes: int = 1
    venv: str = ""
    """A virtual environment with specrl installed, on every node (the shared filesystem)."""
    image: str = ""
    """A container image, run through the pyxis plugin (``srun --container-image``)."""
    mounts: tuple[str, ...] = field(default_factory=tuple)
    """With ``image``: directories mounted at the same path besides the run directory (the
    model, the data set)."""
    partition: str = ""
    account: str = ""
    time: str = ""
    redis_maxmemory: str = "16gb"
    learner_args: tuple[str, ...] = field(default_factory=tuple)
    actor_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise SlurmError("; ".join(problems))

    def _problems(self) -> Iterator[str]:
        if not NAME.match(self.run_name):
            yield f"--run-name must match {NAME.pattern}, got {self.run_name!r}"
        if self.learner_nodes < 1 or self.gpus_per_node < 1:
            yield "--learner-nodes and --gpus-per-node must be at least 1"
        if self.nodes <= self.learner_nodes:
            yield (
                f"--nodes ({self.nodes}) must exceed --learner-nodes ({self.learner_nodes}): "
                "the actors run on nodes of their own (one node: docker compose, "
                "docs/deployment.md)"
            )
        if not PATH.match(self.shared_dir) or "/../" in f"{self.shared_dir}/":
            yield f"--shared-dir must be an absolute path of [A-Za-z0-9_.+/-], got {self.shared_dir!r}"
        if bool(self.venv) == bool(self.image):
            yield "give exactly one of --venv DIR and --image IMAGE"
        if self.venv and not PATH.match(self.venv):
            yield f"--venv must be an absolute path of [A-Za-z0-9_.+/-], got {self.venv!r}"
        for mount in self.mounts:
            if not self.image:
                yield "--mount needs --image (a virtual environment sees every directory)"
                break
            if not PATH.match(mount) or "," in mount:
                yield f"--mount must be an absolute path of [A-Za-z0-9_.+/-], got {mount!r}"
        if self.image and not IMAGE.match(self.image):
            yield f"--image has characters outside [A-Za-z0-9_.:/@#+-]: {self.image!r}"
        for option in ("partition", "account", "time"):
            value = getattr(self, option)
            if value and not SLURM_VALUE.match(value):
                yield f"--{option} has characters outside [A-Za-z0-9_.:,+-]: {value!r}"
        if not MEMORY.match(self.redis_maxmemory):
            yield f"--redis-maxmemory must be like 16gb, got {self.redis_maxmemory!r}"
        for option, args in (("learner", self.learner_args), ("actor", self.actor_args)):
            yield from _override_problems(f"--{option}-args", args)

    @property
    def actors(self) -> int:
        return (self.nodes - self.learner_nodes) * self.gpus_per_node

    @property
    def run_dir(self) -> str:
        return f"{self.shared_dir.rstrip('/')}/{self.run_name}"


def _override_problems(option: str, args: tuple[str, ...]) -> Iterator[str]:
    for arg in args:
        if not OVERRIDE.match(arg):
            yield f"{option}: {arg!r} is not a KEY=VALUE override"
            continue
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in RESERVED:
            yield f"{option}: {key} is set by the script"
        if "password" in arg.lower() or (key.startswith("redis.") and "@" in arg):
            yield (
                f"{option}: {arg.split('=', 1)[0]}: no secret on a command line (the script "
                "passes the Redis password in the environment)"
            )


HEADER = """\
#!/bin/bash
# specrl on Slurm: run @RUN@ on @NODES@ nodes of @GPUS@ GPUs, written by `specrl slurm` (ops/slurm.py).
#   node 0: Redis, and learner rank 0 (the trajectory port @LEARNER_PORT@)
#   the first @LEARNER_NODES@ node(s): the learner under torchrun, @GPUS@ ranks per node
#   the other @ACTOR_NODES@ node(s): @ACTORS@ actors, one per GPU
# Submit with `sbatch FILE`. Secrets stay under @RUN_DIR@/secrets (0700): the Redis password in a
# 0600 file, read into the steps' environment, never on a command line; the CurveZMQ keys from
# `specrl keys`. Logs: @RUN_DIR@/slurm-JOBID.out.
#SBATCH --job-name=specrl-@RUN@
#SBATCH --nodes=@NODES@
#SBATCH --gpus-per-node=@GPUS@
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --output=@RUN_DIR@/slurm-%j.out
# SIGTERM to every step 15 minutes before the time limit: the learner writes its final checkpoint.
#SBATCH --signal=TERM@900
@SBATCH_EXTRA@set -euo pipefail

RUN_NAME=@Q_RUN@
RUN_DIR=@Q_RUN_DIR@
SECRETS="$RUN_DIR/secrets"
KEYS="$SECRETS/curve"
LEARNER_NODES=@LEARNER_NODES@
GPUS_PER_NODE=@GPUS@
REDIS_PORT=@REDIS_PORT@
LEARNER_PORT=@LEARNER_PORT@
RENDEZVOUS_PORT=@RENDEZVOUS_PORT@
REDIS_MAXMEMORY=@Q_MAXMEMORY@
LEARNER_ARGS=(@LEARNER_ARGS@)
ACTOR_ARGS=(@ACTOR_ARGS@)
@ENVIRONMENT@
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${NODES[0]}
LEARNER_HOSTS=$(IFS=,; echo "${NODES[*]:0:LEARNER_NODES}")
ACTOR_HOSTS=$(IFS=,; echo "${NODES[*]:LEARNER_NODES}")
ACTOR_NODES=$((${#NODES[@]} - LEARNER_NODES))
# Every CPU of a node to its learner step, a GPU's share to each actor (the nodes alike).
CPUS=${SLURM_CPUS_ON_NODE:-1}
ACTOR_CPUS=$((CPUS / GPUS_PER_NODE > 0 ? CPUS / GPUS_PER_NODE : 1))
echo "specrl: run $RUN_NAME: Redis on $HEAD, learner on $LEARNER_HOSTS, actors on $ACTOR_HOSTS"
"""

ENV_VENV = """\
# specrl from a virtual environment on the shared filesystem.
export PATH=@Q_VENV@/bin:$PATH
CONTAINER=()
"""

ENV_IMAGE = """\
# specrl from a container image, through pyxis; the run directory and --mount directories are
# mounted at the same path.
CONTAINER=(--container-image=@Q_IMAGE@ --container-mounts="$RUN_DIR:$RUN_DIR@MOUNTS@")
"""

BODY = """
STEPS=()
# shellcheck disable=SC2317 # run by the EXIT trap
stop_steps() {
  if [ "${#STEPS[@]}" -gt 0 ]; then
    kill "${STEPS[@]}" 2>/dev/null || true
    wait "${STEPS[@]}" 2>/dev/null || true
  fi
}
trap stop_steps EXIT

# A short step on node 0, beside the long ones (no GPU).
on_head() {
  srun --nodes=1 --ntasks=1 --nodelist="$HEAD" --overlap --gres=none \\
    ${CONTAINER[@]+"${CONTAINER[@]}"} "$@"
}

# Secrets, once per run: owner-only from the moment they exist (umask 077).
umask 077
mkdir -p "$RUN_DIR" "$SECRETS"
chmod 700 "$SECRETS"
if [ ! -s "$SECRETS/redis-password" ]; then
  head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \\n' >"$SECRETS/redis-password"
fi
SPECRL_REDIS_PASSWORD=$(<"$SECRETS/redis-password")
export SPECRL_REDIS_PASSWORD
printf 'requirepass %s\\n' "$SPECRL_REDIS_PASSWORD" >"$SECRETS/redis.conf"
on_head specrl keys "$KEYS" >/dev/null
exposed=$(find "$SECRETS" -perm /077 -print)
if [ -n "$exposed" ]; then
  echo "specrl: readable beyond their owner, refusing to start: $exposed" >&2
  exit 1
fi

# Redis on node 0: weights in memory only, bounded, nothing evicted; its password from the
# 0600 config file.
REDIS_SERVER=$(on_head python -c 'from ops.redis_server import find_redis_server_binary as f; print(f())')
srun --nodes=1 --ntasks=1 --nodelist="$HEAD" --overlap --gres=none --mem=0 \\
  ${CONTAINER[@]+"${CONTAINER[@]}"} "$REDIS_SERVER" "$SECRETS/redis.conf" \\
  --port "$REDIS_PORT" --bind 0.0.0.0 --appendonly no --save "" \\
  --maxmemory "$REDIS_MAXMEMORY" --maxmemory-policy noeviction &
STEPS+=("$!")
REDIS_URL="redis://$HEAD:$REDIS_PORT/0"
export SPECRL_REDIS_URL=$REDIS_URL

# Exit 0 when Redis answers (with "version": once the run's first weights version is in it).
redis_ready() {
  on_head python -c 'import os, sys, redis
r = redis.Redis.from_url(os.environ["SPECRL_REDIS_URL"], password=os.environ["SPECRL_REDIS_PASSWORD"])
sys.exit(0 if r.ping() and (len(sys.argv) < 2 or r.get(sys.argv[1])) else 1)' "$@" >/dev/null 2>&1
}
wait_for() {
  local what=$1 tries=$2
  shift 2
  until redis_ready "$@"; do
    if [ -n "${LEARNER:-}" ] && ! kill -0 "$LEARNER" 2>/dev/null; then
      echo "specrl: the learner exited while waiting for $what" >&2
      exit 1
    fi
    tries=$((tries - 1))
    if [ "$tries" -le 0 ]; then
      echo "specrl: gave up waiting for $what" >&2
      exit 1
    fi
    sleep 5
  done
}
wait_for Redis 24

# The learner: torchrun on each learner node, static rendezvous at node 0, so global rank 0 (the
# one that binds the trajectory port and publishes) runs on node 0.
# shellcheck disable=SC2016 # $SLURM_NODEID is each task's own
srun --nodes="$LEARNER_NODES" --ntasks-per-node=1 --nodelist="$LEARNER_HOSTS" --overlap \\
  --cpus-per-task="$CPUS" --mem=0 \\
  ${CONTAINER[@]+"${CONTAINER[@]}"} bash -c 'exec torchrun --nnodes="$1" --nproc-per-node="$2" \\
    --node-rank="$SLURM_NODEID" --master-addr="$3" --master-port="$4" -m learner.main "${@:5}"' \\
  learner "$LEARNER_NODES" "$GPUS_PER_NODE" "$HEAD" "$RENDEZVOUS_PORT" \\
  "run.name=$RUN_NAME" "run.dir=$RUN_DIR" "redis.url=$REDIS_URL" \\
  "learner.bind=tcp://0.0.0.0:$LEARNER_PORT" "learner.address=tcp://$HEAD:$LEARNER_PORT" \\
  "security.curve_dir=$KEYS" ${LEARNER_ARGS[@]+"${LEARNER_ARGS[@]}"} &
LEARNER=$!
STEPS+=("$LEARNER")

# The actors once the first version is published (up to an hour: a large model's load), one per
# GPU; task i of the step is actor i, named $RUN_NAME-actor-i.
wait_for "the first weights version" 720 "weights:$RUN_NAME:latest"
# shellcheck disable=SC2016 # $SLURM_PROCID is each task's own
srun --nodes="$ACTOR_NODES" --ntasks-per-node="$GPUS_PER_NODE" --gpus-per-task=1 \\
  --nodelist="$ACTOR_HOSTS" --overlap --cpus-per-task="$ACTOR_CPUS" --mem=0 \\
  ${CONTAINER[@]+"${CONTAINER[@]}"} bash -c 'name=$1; shift
    exec specrl-actor "actor.index=$SLURM_PROCID" "actor.actor_id=$name-$SLURM_PROCID" "$@"' \\
  actor "$RUN_NAME-actor" \\
  "run.name=$RUN_NAME" "run.dir=$RUN_DIR" "redis.url=$REDIS_URL" \\
  "learner.address=tcp://$HEAD:$LEARNER_PORT" "security.curve_dir=$KEYS" actor.device=cuda \\
  ${ACTOR_ARGS[@]+"${ACTOR_ARGS[@]}"} &
STEPS+=("$!")

# The run ends with the learner (run.steps, or SIGTERM); then the actors and Redis stop.
status=0
wait "$LEARNER" || status=$?
echo "specrl: the learner exited with status $status"
exit "$status"
"""


def render(job: SlurmJob) -> str:
    """The sbatch script of ``job``: every value quoted for bash, no secret in it."""
    options = {"partition": job.partition, "account": job.account, "time": job.time}
    extra = "".join(f"#SBATCH --{k}={v}\n" for k, v in options.items() if v)
    environment = ENV_VENV if job.venv else ENV_IMAGE
    values = {
        "ENVIRONMENT": environment,
        "SBATCH_EXTRA": extra,
        "RUN": job.run_name,
        "Q_RUN": shlex.quote(job.run_name),
        "RUN_DIR": job.run_dir,
        "Q_RUN_DIR": shlex.quote(job.run_dir),
        "Q_VENV": shlex.quote(job.venv.rstrip("/")),
        "Q_IMAGE": shlex.quote(job.image),
        "MOUNTS": "".join(f",{m}:{m}" for m in job.mounts),
        "Q_MAXMEMORY": shlex.quote(job.redis_maxmemory),
        "NODES": str(job.nodes),
        "GPUS": str(job.gpus_per_node),
        "LEARNER_NODES": str(job.learner_nodes),
        "ACTOR_NODES": str(job.nodes - job.learner_nodes),
        "ACTORS": str(job.actors),
        "REDIS_PORT": str(REDIS_PORT),
        "LEARNER_PORT": str(LEARNER_PORT),
        "RENDEZVOUS_PORT": str(RENDEZVOUS_PORT),
        "LEARNER_ARGS": " ".join(map(shlex.quote, job.learner_args)),
        "ACTOR_ARGS": " ".join(map(shlex.quote, job.actor_args)),
    }
    return _fill(HEADER + BODY, values)


def _fill(template: str, values: dict[str, str]) -> str:
    # Longest names first (ENVIRONMENT holds placeholders of its own), then anything left over is
    # a bug in the template.
    text = template
    for _ in range(2):
        for key in sorted(values, key=len, reverse=True):
            text = text.replace(f"@{key}@", values[key])
    leftover = re.findall(r"@[A-Z_]+@", text)
    if leftover:
        raise AssertionError(f"unfilled placeholders: {leftover}")
    return text


USAGE = "specrl slurm --run-name NAME --nodes N --gpus-per-node G --shared-dir DIR (--venv DIR | --image IMAGE) [--dry-run] ..."
DESCRIPTION = """\
Writes the sbatch script of a specrl run on Slurm: Redis on node 0, the learner under torchrun
on the first --learner-nodes nodes, one actor per GPU on the others; secrets (the Redis password,
the CurveZMQ keys) under SHARED_DIR/RUN/secrets, owner-only. --dry-run prints the script;
otherwise it is written to SHARED_DIR/RUN/specrl.sbatch (or --out) and the sbatch command to
submit it is printed. Nothing is submitted."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specrl slurm", usage=USAGE, description=DESCRIPTION)
    add = p.add_argument
    add("--run-name", required=True, help="run.name: the Redis keys, the run directory")
    add("--nodes", type=int, required=True, help="nodes of the job")
    add("--gpus-per-node", type=int, required=True)
    add("--learner-nodes", type=int, default=1, help="nodes of the learner (default 1)")
    add("--shared-dir", required=True, help="a directory every node sees (runs and secrets)")
    add("--venv", default="", help="a virtual environment with specrl, on every node")
    add("--image", default="", help="a container image with specrl (pyxis --container-image)")
    add(
        "--mount",
        action="append",
        default=[],
        metavar="DIR",
        help="with --image: a directory to mount at the same path (repeatable)",
    )
    add("--partition", default="")
    add("--account", default="")
    add("--time", default="", help="time limit (sbatch --time)")
    add("--redis-maxmemory", default="16gb", help="Redis maxmemory (docs/deployment.md Sizes)")
    add("--learner-args", default="", help='extra learner overrides, e.g. "run.steps=2000"')
    add("--actor-args", default="", help='extra actor overrides, e.g. "engine=vllm"')
    add("--out", type=Path, help="where to write the script (default SHARED_DIR/RUN/specrl.sbatch)")
    add("--dry-run", action="store_true", help="print the script (or write --out) and stop")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        job = SlurmJob(
            run_name=args.run_name,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            learner_nodes=args.learner_nodes,
            shared_dir=args.shared_dir,
            venv=args.venv,
            image=args.image,
            mounts=tuple(args.mount),
            partition=args.partition,
            account=args.account,
            time=args.time,
            redis_maxmemory=args.redis_maxmemory,
            learner_args=tuple(shlex.split(args.learner_args)),
            actor_args=tuple(shlex.split(args.actor_args)),
        )
    except (SlurmError, ValueError) as e:
        print(f"specrl slurm: {e}", file=sys.stderr)
        return 2
    script = render(job)
    if args.dry_run and args.out is None:
        sys.stdout.write(script)
        return 0
    if args.out is None and Path(job.shared_dir).is_dir():
        Path(job.run_dir).mkdir(mode=0o700, exist_ok=True)
    out = args.out or Path(job.run_dir) / "specrl.sbatch"
    if not out.parent.is_dir():
        print(f"specrl slurm: {out.parent} is not a directory", file=sys.stderr)
        return 2
    out.write_text(script)
    print(f"sbatch {shlex.quote(str(out))}")
    return 0
