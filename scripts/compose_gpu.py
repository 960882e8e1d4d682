"""Writes docker-compose.gpu.yml: the GPU compose stack laid out for this node's GPUs and model.

    python3 scripts/compose_gpu.py --gpus 8 --learner-gpus 4 --model-dir /models/Qwen2.5-7B
    docker compose -f docker-compose.yml -f docker-compose.gpu.yml up --build

The written file replaces docker-compose.override.yml (it holds everything that file holds, with
the layout below), so a command names docker-compose.yml and the written file only. Its ports are
that file's: 5555 and 6379 on ``SPECRL_PUBLISH_HOST`` (default 127.0.0.1, the host's loopback),
and the learner refuses to start published wider without ``security.curve_dir``.

Placement (Docker's ``device_ids``, one set per service; Compose cannot give the replicas of one
service different GPUs, so each actor is a service of its own: ``actor``, ``actor-1``, ...):

- on a node with one GPU, the learner and one actor share GPU 0, and the actor's vLLM engine takes
  ``--actor-gpu-memory`` of it (``gpu_memory_utilization``); the learner's fit check then plans
  for the rest less 5% (``learner.device_memory_gib``, from ``--gpu-memory-gib`` or the GPU's
  total memory as nvidia-smi reports it), not for the memory it finds free when it starts,
  which depends on whether vLLM has allocated its share yet;
- on a node with more, the learner takes GPUs 0 .. L-1 (``--learner-gpus``; above 1 it runs
  under torchrun, one rank per GPU) and each actor the next ``--gpus-per-actor`` GPUs of its own
  (vLLM tensor parallelism above 1); by default as many actors as the remaining GPUs hold.

A layout that needs more GPUs than the node has is refused. Every option also reads an
environment variable (GPUS, LEARNER_GPUS, GPUS_PER_ACTOR, ACTORS, MODEL_DIR, DATA_FILE,
RUNS_DIR, ACTOR_GPU_MEMORY); ``--gpus`` defaults to the count of ``nvidia-smi -L``.

``--model-dir`` (an HF model directory on this host) is mounted read-only at /model in the learner
and every actor (the actors read its tokenizer) and given as ``model.path``; ``--data-file`` (a
JSONL or Parquet data set) is mounted read-only under /data and given as ``task=dataset
task.path=...``. With a model, the sizes that scale with it are derived from its parameter count
(read from its safetensors headers) and V, the bytes of one published version in
``--publish-dtype`` (also given to the learner as ``learner.publish_dtype``):

- the actors' shared weights cache (tmpfs): 3 V (the two versions it keeps and the one being
  written), plus 5%;
- Redis ``maxmemory``: (1 + R + (K - 1) f) V, plus 1 GiB, with R = redis.retention (3),
  K = redis.keyframe_every (10) and f = 0.5, the largest delta the writer stores
  (common/weights/publish/writer.py): the store keeps the R newest versions and the chain back to
  the oldest one's keyframe, and the next version is written before it prunes. At worst the
  oldest kept is the chain's last delta: its keyframe (V), K - 1 deltas (f V each), the R - 1
  newer versions and the one being written (V each, a delta refused for its size being a full
  version): 8.5 V at the defaults;
- the learner's /dev/shm: ``learner.publish_max_inflight`` + 1 copies of V, plus 4 GiB (NCCL);
- how long the learner waits for a group (``learner.group_timeout_s``; the first one comes after
  every actor's cold start: reading V, building its engine, a first rollout): 600 s plus 60 s per
  GiB of V.

``--runs-dir`` (a directory on this host) is mounted at /runs in the learner and every actor in
place of the ``runs`` named volume: the run directory, checkpoints included, on a disk of your
choice.

Before it writes the file it checks the host (scripts/compose_host.py; ``--skip-host-checks``
writes it anyway, with a warning): the NVIDIA driver that ``nvidia-smi`` reports against the CUDA
of the Dockerfile's base image (driver 580 or newer for CUDA 13), and, with a model, MemAvailable
against the stack's host RAM and the free disk of the run directory (``--runs-dir``, else Docker's
data root) against the checkpoints; a shortfall is refused with the numbers.

Needs Python 3 with PyYAML (Debian/Ubuntu: python3-yaml).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "docker-compose.yml"
OVERRIDE = ROOT / "docker-compose.override.yml"
DEFAULT_OUT = ROOT / "docker-compose.gpu.yml"
MODEL_MOUNT = "/model"
DATA_MOUNT = "/data"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
GIB = 2**30
REDIS_RETENTION = 3
"""redis.retention's default (common/config/run.py); the learner keeps this many versions."""
PUBLISH_MAX_INFLIGHT = 1
"""learner.publish_max_inflight's default (common/config/learner.py)."""
KEYFRAME_EVERY = 10
"""redis.keyframe_every's default (common/config/run.py): a delta chain is at most K - 1 long."""
MAX_DELTA_FRACTION = 0.5
"""The largest delta the weight store writes, as a fraction of a full version
(common/weights/publish/writer.py); a larger one is written as a full version."""
RUNS_MOUNT = "/runs"


def sibling(name: str) -> ModuleType:
    """``scripts/<name>.py``, loaded by its path once and kept in ``sys.modules``: scripts/ is
    not a package, and this script runs as a file or is loaded by path (testing/scripts.py)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


host_checks = sibling("compose_host")


class LayoutError(ValueError):
    """A layout this node cannot hold, or an input that cannot be read; the message says why."""


def gpu_memory_gib() -> float | None:
    """Total memory of GPU 0 as ``nvidia-smi`` reports it, in GiB; None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"]
    out = subprocess.run(query, capture_output=True, text=True, check=False)
    try:
        return float(out.stdout.strip().splitlines()[0]) / 1024  # MiB
    except (IndexError, ValueError):
        return None


def learner_share_gib(total_gib: float, actor_share: float) -> float:
    """What the learner may plan for on a GPU whose ``actor_share`` vLLM takes: the rest, less
    5% of the GPU (CUDA contexts, the allocators' slack)."""
    return round(total_gib * (1 - actor_share - 0.05), 1)


def visible_gpus() -> int | None:
    """GPUs ``nvidia-smi -L`` lists on this host; None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return None
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def plan(
    gpus: int, learner_gpus: int = 1, gpus_per_actor: int = 1, actors: int | None = None
) -> dict[str, list[int]]:
    """Service name -> the GPU indices it reserves: ``learner``, then ``actor``, ``actor-1``, ...
    Refuses (LayoutError) a layout the node's ``gpus`` cannot hold."""
    for name, value in (("gpus", gpus), ("learner GPUs", learner_gpus)):
        if value < 1:
            raise LayoutError(f"{name} must be >= 1, got {value}")
    if gpus_per_actor < 1:
        raise LayoutError(f"GPUs per actor must be >= 1, got {gpus_per_actor}")
    if actors is not None and actors < 1:
        raise LayoutError(f"actors must be >= 1, got {actors}")
    if gpus == 1:
        # One GPU: the learner and one actor share it.
        if learner_gpus > 1 or gpus_per_actor > 1 or (actors or 1) > 1:
            raise LayoutError(
                f"a 1-GPU node holds the learner and one actor sharing GPU 0; asked for "
                f"{learner_gpus} learner GPU(s), {actors or 1} actor(s) x {gpus_per_actor} GPU(s)"
            )
        return {"learner": [0], "actor": [0]}
    free = gpus - learner_gpus
    if actors is None:
        actors = free // gpus_per_actor
        if actors < 1:
            raise LayoutError(
                f"no GPU left for an actor: the learner takes {learner_gpus} of the node's {gpus} "
                f"GPUs and an actor needs {gpus_per_actor}"
            )
    needed = learner_gpus + actors * gpus_per_actor
    if needed > gpus:
        raise LayoutError(
            f"the layout needs {needed} GPUs (learner {learner_gpus} + {actors} actor(s) x "
            f"{gpus_per_actor}), the node has {gpus}"
        )
    layout = {"learner": list(range(learner_gpus))}
    for i in range(actors):
        first = learner_gpus + i * gpus_per_actor
        layout[actor_service(i)] = list(range(first, first + gpus_per_actor))
    return layout


def actor_service(index: int) -> str:
    return "actor" if index == 0 else f"actor-{index}"


def model_parameters(model_dir: Path) -> int:
    """Parameter count of an HF model directory: the elements of every tensor in its
    ``*.safetensors`` files, read from their headers (the weights are not read)."""
    if not (model_dir / "config.json").is_file():
        raise LayoutError(f"{model_dir} is not an HF model directory (no config.json)")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise LayoutError(f"{model_dir} holds no *.safetensors file")
    total = 0
    for path in files:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                total += math.prod(entry["shape"])
    return total


def gib(nbytes: float) -> str:
    """A size for Docker and Redis: whole GiB, rounded up ("48g"; Redis reads "48gb")."""
    return f"{max(1, math.ceil(nbytes / GIB))}g"


def chain_versions() -> float:
    """The most the weight store holds at once, in full versions: 1 + R + (K - 1) f (8.5 at the
    defaults; the module doc says why)."""
    return 1 + REDIS_RETENTION + (KEYFRAME_EVERY - 1) * MAX_DELTA_FRACTION


def redis_maxmemory_bytes(version: int) -> int:
    """Redis ``maxmemory`` for versions of ``version`` bytes: :func:`chain_versions` of them
    (the longest delta chain the store keeps, the newer retained versions and the one being
    written), plus 1 GiB for Redis's own keys and overhead."""
    return math.ceil(chain_versions() * version) + GIB


def weights_cache_bytes(version: int) -> int:
    """The actors' weights cache: the 2 versions it keeps and the one being written, plus 5%."""
    return math.ceil(3 * version * 1.05)


def sizes(parameters: int, publish_dtype: str) -> dict[str, str]:
    version = parameters * DTYPE_BYTES[publish_dtype]
    return {
        "weights_cache": gib(weights_cache_bytes(version)),
        "redis_maxmemory": gib(redis_maxmemory_bytes(version)) + "b",
        "learner_shm": gib((PUBLISH_MAX_INFLIGHT + 1) * version + 4 * GIB),
        "group_timeout_s": str(600 + math.ceil(60 * version / GIB)),
    }


def merge(base: Any, over: Any) -> Any:
    """``over`` laid on ``base`` as Compose merges these services' keys: mappings key by key,
    lists joined (no duplicates), anything else replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(over, list):
        return base + [v for v in over if v not in base]
    return copy.deepcopy(over)


def gpu_reservation(ids: list[int]) -> dict[str, Any]:
    device = {"driver": "nvidia", "device_ids": [str(i) for i in ids], "capabilities": ["gpu"]}
    return {"resources": {"reservations": {"devices": [device]}}}


def set_node_args(env: dict[str, str], args: list[str]) -> None:
    """SPECRL_NODE_ARGS: the overrides the learner's command and docker/actor.sh pass on."""
    if args:
        env["SPECRL_NODE_ARGS"] = " ".join(args)
    else:
        env.pop("SPECRL_NODE_ARGS", None)


def mount_target(volume: str) -> str:
    """The container path of a short-syntax volume (``SOURCE:TARGET[:MODE]`` or ``TARGET``)."""
    parts = volume.split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def with_mounts(existing: list[str], mounts: list[str]) -> list[str]:
    """``existing`` volumes with ``mounts`` added, each replacing one at its container path (as
    Compose merges a service's volumes across files)."""
    targets = {mount_target(m) for m in mounts}
    return [v for v in existing if mount_target(v) not in targets] + mounts


def apply_model(
    out: dict[str, Any], base: dict[str, Any], model_dir: Path, publish_dtype: str
) -> tuple[list[str], list[str]]:
    """The sizes derived from the model, set in ``out`` as the defaults of the variables that
    set them by hand; returns the learner's and the actors' overrides."""
    services = out["services"]
    size = sizes(model_parameters(model_dir), publish_dtype)
    learner_args = [
        f"model.path={MODEL_MOUNT}",
        f"learner.publish_dtype={publish_dtype}",
        f"learner.group_timeout_s=${{LEARNER_GROUP_TIMEOUT_S:-{size['group_timeout_s']}}}",
    ]
    cache = f"size=${{ACTOR_WEIGHTS_CACHE_SIZE:-{size['weights_cache']}}},mode=1777"
    out["volumes"] = {
        "weights-cache": merge(base["volumes"]["weights-cache"], {"driver_opts": {"o": cache}})
    }
    # Redis holds the longest delta chain the weight store keeps (redis_maxmemory_bytes).
    redis_env = services["redis"].setdefault("environment", {})
    redis_env["SPECRL_REDIS_MAXMEMORY"] = f"${{REDIS_MAXMEMORY:-{size['redis_maxmemory']}}}"
    services["learner"]["shm_size"] = f"${{LEARNER_SHM_SIZE:-{size['learner_shm']}}}"
    return learner_args, [f"model.path={MODEL_MOUNT}"]


def render(
    layout: dict[str, list[int]],
    *,
    model_dir: Path | None = None,
    data_file: Path | None = None,
    runs_dir: Path | None = None,
    actor_gpu_memory: float = 0.3,
    gpu_memory: float | None = None,
    publish_dtype: str = "bfloat16",
    base: dict[str, Any] | None = None,
    override: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The compose file for ``layout``: docker-compose.override.yml with the layout's GPUs, the
    actor services, the mounts and the sizes applied."""
    import yaml

    base = base if base is not None else yaml.safe_load(BASE.read_text())
    out = copy.deepcopy(override if override is not None else yaml.safe_load(OVERRIDE.read_text()))
    services = out["services"]
    shared = [
        s for s, ids in layout.items() if s != "learner" and set(ids) & set(layout["learner"])
    ]
    volumes: list[str] = []
    learner_args: list[str] = []
    actor_args: list[str] = []
    if runs_dir is not None:
        volumes.append(f"{runs_dir.resolve()}:{RUNS_MOUNT}")  # in place of the runs volume
    if model_dir is not None:
        volumes.append(f"{model_dir.resolve()}:{MODEL_MOUNT}:ro")
        learner_args, actor_args = apply_model(out, base, model_dir, publish_dtype)
    if data_file is not None:
        if not data_file.is_file():
            raise LayoutError(f"--data-file {data_file}: no such file")
        volumes.append(f"{data_file.resolve().parent}:{DATA_MOUNT}:ro")
        task = ["task=dataset", f"task.path={DATA_MOUNT}/{data_file.name}"]
        learner_args += task
        actor_args += task

    if shared and gpu_memory is not None:
        budget = learner_share_gib(gpu_memory, actor_gpu_memory)
        learner_args.append(f"learner.device_memory_gib=${{LEARNER_DEVICE_MEMORY_GIB:-{budget}}}")
    learner = services["learner"]
    learner_env = learner.setdefault("environment", {})
    learner_env["LEARNER_GPUS"] = str(len(layout["learner"]))
    set_node_args(learner_env, learner_args)
    learner["deploy"] = gpu_reservation(layout["learner"])
    if volumes:
        learner["volumes"] = with_mounts(learner.get("volumes", []), volumes)

    template = merge(base["services"]["actor"], services["actor"])
    template.pop("deploy", None)
    for index, (name, ids) in enumerate((s, i) for s, i in layout.items() if s != "learner"):
        extra = list(actor_args)
        if len(ids) > 1:
            extra.append(f"engine.vllm_tensor_parallel_size={len(ids)}")
        if name in shared:
            share = f"${{ACTOR_GPU_MEMORY:-{actor_gpu_memory}}}"
            extra.append(f"+engine.vllm_kwargs.gpu_memory_utilization={share}")
        service = services["actor"] if name == "actor" else copy.deepcopy(template)
        env = service.setdefault("environment", {})
        env["SPECRL_ACTOR_INDEX"] = str(index)
        set_node_args(env, extra)
        service["deploy"] = {"replicas": 1, **gpu_reservation(ids)}
        if volumes:
            service["volumes"] = with_mounts(service.get("volumes", []), volumes)
        services[name] = service
    return out


def header(argv: list[str], layout: dict[str, list[int]]) -> str:
    lines = [
        "# Written by scripts/compose_gpu.py; run it again rather than editing this file:",
        f"#   python3 scripts/compose_gpu.py {' '.join(argv)}".rstrip(),
        "# Use it in place of docker-compose.override.yml:",
        "#   docker compose -f docker-compose.yml -f docker-compose.gpu.yml up --build",
        "# GPUs:",
    ]
    lines += [f"#   {name}: {', '.join(map(str, ids))}" for name, ids in layout.items()]
    return "\n".join(lines) + "\n"


ENV_OPTIONS: dict[str, tuple[Any, str, Any, str | None]] = {
    # option: (type, environment variable, default where the variable is unset or empty, help)
    "--gpus": (int, "GPUS", None, "GPUs on this node (default: nvidia-smi -L)"),
    "--learner-gpus": (int, "LEARNER_GPUS", 1, None),
    "--gpus-per-actor": (int, "GPUS_PER_ACTOR", 1, None),
    "--actors": (int, "ACTORS", None, "default: as many as the GPUs left after the learner's hold"),
    "--model-dir": (Path, "MODEL_DIR", None, None),
    "--data-file": (Path, "DATA_FILE", None, None),
    "--runs-dir": (Path, "RUNS_DIR", None, "directory mounted at /runs in place of the runs "
                   "volume: the run directory, checkpoints included (default: the volume)"),
    "--actor-gpu-memory": (float, "ACTOR_GPU_MEMORY", 0.3, "vLLM gpu_memory_utilization of an "
                           "actor sharing its GPU with the learner"),
    "--gpu-memory-gib": (float, "GPU_MEMORY_GIB", None, "memory of one GPU, for the learner's "
                         "share of a GPU it shares (default: nvidia-smi)"),
}  # fmt: skip


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="compose_gpu.py",
        description="Write docker-compose.gpu.yml for this node's GPUs and model.",
    )
    for option, (kind, variable, default, text) in ENV_OPTIONS.items():
        value = os.environ.get(variable)
        p.add_argument(option, type=kind, default=kind(value) if value else default, help=text)
    p.add_argument("--publish-dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    p.add_argument(
        "--skip-host-checks",
        action="store_true",
        help="write the file without checking the driver, host RAM and disk (with a warning)",
    )
    p.add_argument("-o", "--output", type=Path, default=DEFAULT_OUT)
    return p.parse_args(argv)


def whole_gib(nbytes: int) -> int:
    """``nbytes`` as :func:`gib` writes it for Docker and Redis, in bytes."""
    return max(1, math.ceil(nbytes / GIB)) * GIB


def host_needs(model_dir: Path, publish_dtype: str, layout: dict[str, list[int]]) -> Any:
    """What the layout needs of the host with this model (``compose_host.Needs``)."""
    parameters = model_parameters(model_dir)
    version = parameters * DTYPE_BYTES[publish_dtype]
    return host_checks.needs(
        parameters,
        version,
        sum(f.stat().st_size for f in model_dir.glob("*.safetensors")),
        learner_ranks=len(layout["learner"]),
        actors=len(layout) - 1,
        publish_max_inflight=PUBLISH_MAX_INFLIGHT,
        redis=whole_gib(redis_maxmemory_bytes(version)),
        weights_cache=whole_gib(weights_cache_bytes(version)),
    )


def check_host(args: argparse.Namespace, layout: dict[str, list[int]], host: Any) -> None:
    """The host checks of scripts/compose_host.py (a refusal raised as ``LayoutError``; what
    could not be checked printed as a warning), unless ``--skip-host-checks``."""
    if args.skip_host_checks:
        print(
            "compose_gpu.py: warning: --skip-host-checks: the NVIDIA driver, host RAM and disk "
            "are not checked",
            file=sys.stderr,
        )
        return
    need = (
        None if args.model_dir is None else host_needs(args.model_dir, args.publish_dtype, layout)
    )
    try:
        warnings = host_checks.check_host(host, need, args.runs_dir)
    except host_checks.HostRefused as e:
        raise LayoutError(f"{e}\n(--skip-host-checks writes the file anyway)") from e
    for warning in warnings:
        print(f"compose_gpu.py: warning: {warning}", file=sys.stderr)


def build(args: argparse.Namespace, host: Any) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """The layout and the compose file of ``args``, once the host is checked (``LayoutError``
    for a layout, an input or a host that cannot serve)."""
    detected = visible_gpus()
    gpus = args.gpus if args.gpus is not None else detected
    if gpus is None:
        raise LayoutError("no nvidia-smi here to count the GPUs: give --gpus N (or GPUS=N)")
    if detected is not None and gpus > detected:
        raise LayoutError(f"--gpus {gpus}, but nvidia-smi -L lists {detected} GPU(s) here")
    if args.gpu_memory_gib is not None and args.gpu_memory_gib <= 0:
        raise LayoutError(f"--gpu-memory-gib must be > 0, got {args.gpu_memory_gib}")
    if not 0 < args.actor_gpu_memory < 1:
        raise LayoutError(f"--actor-gpu-memory must be in (0, 1), got {args.actor_gpu_memory}")
    layout = plan(gpus, args.learner_gpus, args.gpus_per_actor, args.actors)
    if args.model_dir is not None and not args.model_dir.is_dir():
        raise LayoutError(f"--model-dir {args.model_dir}: no such directory")
    if args.runs_dir is not None and not args.runs_dir.is_dir():
        raise LayoutError(
            f"--runs-dir {args.runs_dir}: no such directory (create it on the disk that should "
            "hold the checkpoints)"
        )
    check_host(args, layout, host)
    config = render(
        layout,
        model_dir=args.model_dir,
        data_file=args.data_file,
        runs_dir=args.runs_dir,
        actor_gpu_memory=args.actor_gpu_memory,
        gpu_memory=args.gpu_memory_gib if args.gpu_memory_gib else gpu_memory_gib(),
        publish_dtype=args.publish_dtype,
    )
    return layout, config


def main(argv: list[str] | None = None, host: Any = None) -> int:
    """The command line; ``host``: the host's probes (``compose_host.Host``; a test's fakes)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        import yaml
    except ImportError:
        print(
            "compose_gpu.py: needs PyYAML (apt-get install python3-yaml, or pip install pyyaml)",
            file=sys.stderr,
        )
        return 2
    try:
        layout, config = build(args, host if host is not None else host_checks.Host())
    except LayoutError as e:
        print(f"compose_gpu.py: {e}", file=sys.stderr)
        return 2
    text = header(argv, layout) + yaml.safe_dump(config, sort_keys=False, width=100)
    args.output.write_text(text)
    print(f"compose_gpu.py: wrote {args.output}")
    for name, ids in layout.items():
        print(f"  {name}: GPU {', '.join(map(str, ids))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
