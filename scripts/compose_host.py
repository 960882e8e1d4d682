"""The host checks of scripts/compose_gpu.py, run before it writes the compose file: the NVIDIA
driver against the image's CUDA, free host RAM and free disk for the planned layout
(docs/deployment.md, "Host checks"). Every probe of the host is a field of :class:`Host`, which
the tests replace; what is needed is computed from the model and the layout alone.

The estimates, in bytes (P: the model's parameters; V: one published version, P times the
publish dtype's size; S: the model's safetensors files; L: learner ranks; A: actors;
I: ``learner.publish_max_inflight``):

- the learner container's host RAM peak, ``max(L S, 16 P + (I + 4) V)``: at start every rank
  reads the model's files (L S); then rank 0 keeps the fp32 state it gathered for the last
  publish (4 P) while it gathers a checkpoint (fp32 weights and AdamW's two fp32 moments, 12 P:
  more than the next publish's 4 P gather), beside the publish snapshots in /dev/shm
  ((I + 1) V) and the upload child (the serialised version, the delta base it keeps and the
  delta's temporaries: 3 V);
- the host's RAM: that peak, plus Redis ``maxmemory`` and the actors' weights cache (tmpfs), both
  sized by compose_gpu.py, plus A V (each actor holds the version it loads into its engine);
- the checkpoints' disk, ``(K + 1) 12 P + 1 GiB``: K = 2 checkpoints kept
  (``learner.checkpoint.save_checkpoint``) and the one being written, each the fp32 weights and
  AdamW's two fp32 moments (fp32 and bf16-mixed training); 1 GiB for the tokenizer, trainer state,
  WAL and logs. They go to the learner's run directory: ``--runs-dir`` (a bind mount at /runs), or
  else the ``runs`` named volume under Docker's data root.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
MEMINFO = Path("/proc/meminfo")
DOCKER_ROOT_DEFAULT = Path("/var/lib/docker")
GIB = 2**30
MIN_DRIVER = {
    (12, 0): 525,
    (12, 1): 530,
    (12, 2): 535,
    (12, 3): 545,
    (12, 4): 550,
    (12, 5): 555,
    (12, 6): 560,
    (12, 8): 570,
    (12, 9): 575,
    (13, 0): 580,
}
"""CUDA version -> the oldest Linux driver branch that runs it (NVIDIA's CUDA release notes);
the container toolkit refuses an image whose ``NVIDIA_REQUIRE_CUDA`` the driver does not meet."""
CHECKPOINT_KEEP = 2
"""Complete checkpoints the learner keeps (``learner.checkpoint.save_checkpoint``'s ``keep``)."""
CHECKPOINT_BYTES_PER_PARAMETER = 12
"""fp32 weights (4) and AdamW's two fp32 moments (8)."""
CHECKPOINT_EXTRA = GIB
"""The tokenizer, trainer state, WAL and logs beside the checkpoints."""


class HostRefused(ValueError):
    """The host cannot run the planned stack; the message says what was found and needed."""


def driver_versions() -> list[str] | None:
    """Every GPU's driver version as ``nvidia-smi`` reports it; None without nvidia-smi (or
    when it fails)."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    out = subprocess.run(query, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def mem_available(meminfo: Path = MEMINFO) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where there is none."""
    try:
        text = meminfo.read_text()
    except OSError:
        return None
    found = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(found[1]) * 1024 if found else None


def disk_free(path: Path) -> int:
    """Bytes free to an unprivileged user on ``path``'s filesystem."""
    return shutil.disk_usage(path).free


def docker_root() -> Path | None:
    """Docker's data root (named volumes live under it): ``docker info``'s, else
    /var/lib/docker where it exists; None where neither is found."""
    if shutil.which("docker") is not None:
        query = ["docker", "info", "--format", "{{.DockerRootDir}}"]
        try:
            out = subprocess.run(query, capture_output=True, text=True, check=False, timeout=30)
        except subprocess.TimeoutExpired:
            out = None
        if out is not None and out.returncode == 0 and out.stdout.strip():
            return Path(out.stdout.strip())
    return DOCKER_ROOT_DEFAULT if DOCKER_ROOT_DEFAULT.is_dir() else None


@dataclass(frozen=True)
class Host:
    """The probes of the host; a test gives fakes."""

    driver_versions: Callable[[], list[str] | None] = driver_versions
    mem_available: Callable[[], int | None] = mem_available
    disk_free: Callable[[Path], int] = disk_free
    docker_root: Callable[[], Path | None] = docker_root


def image_cuda(dockerfile: Path = DOCKERFILE) -> tuple[int, int]:
    """The CUDA version of the image's ``nvidia/cuda`` base (``FROM nvidia/cuda:13.0.0-...``)."""
    found = re.search(r"^FROM\s+nvidia/cuda:(\d+)\.(\d+)", dockerfile.read_text(), re.MULTILINE)
    if found is None:
        raise HostRefused(f"{dockerfile}: no FROM nvidia/cuda:X.Y base to check the driver for")
    return int(found[1]), int(found[2])


def driver_problem(versions: list[str], cuda: tuple[int, int]) -> str | None:
    """Why a driver of ``versions`` (one per GPU) cannot run an image of ``cuda``, with what to
    do; None where it can."""
    needed = MIN_DRIVER.get(cuda)
    if needed is None:
        raise HostRefused(
            f"no known driver floor for CUDA {cuda[0]}.{cuda[1]}: add it to MIN_DRIVER"
        )
    majors = []
    for version in versions:
        head = version.split(".")[0]
        if not head.isdigit():
            raise HostRefused(f"nvidia-smi reports driver version {version!r}: not a version")
        majors.append((int(head), version))
    major, found = min(majors)
    if major >= needed:
        return None
    cuda_text = f"{cuda[0]}.{cuda[1]}"
    runs = [c for c, floor in MIN_DRIVER.items() if floor <= major]
    if runs:
        older = max(runs)
        base = f"CUDA {older[0]}.{older[1]} at most (nvidia/cuda:{older[0]}.{older[1]}.x)"
        other = (
            f"or build the image on a base this driver runs, {base}, with torch and vLLM wheels "
            f"built for that CUDA in a lock of docker/requirements-gpu.in (not shipped here)"
        )
    else:
        other = "no CUDA 12 or 13 base runs on it"
    return (
        f"NVIDIA driver {found} found; the image needs driver {needed} or newer: its base "
        f"(Dockerfile: nvidia/cuda:{cuda_text}) is CUDA {cuda_text}, and the NVIDIA container "
        f"toolkit refuses to start it on an older driver. Upgrade the host's driver to R{needed} "
        f"or newer, {other}"
    )


@dataclass(frozen=True)
class Needs:
    """What the planned stack needs of the host, in bytes."""

    learner_ram: int
    redis: int
    weights_cache: int
    actors_ram: int
    checkpoints: int

    @property
    def ram(self) -> int:
        return self.learner_ram + self.redis + self.weights_cache + self.actors_ram


def needs(
    parameters: int,
    version: int,
    model_files: int,
    *,
    learner_ranks: int,
    actors: int,
    publish_max_inflight: int,
    redis: int,
    weights_cache: int,
) -> Needs:
    """The host RAM and checkpoint disk of the layout (formulas: this module's docstring)."""
    steady = 16 * parameters + (publish_max_inflight + 4) * version
    return Needs(
        learner_ram=max(learner_ranks * model_files, steady),
        redis=redis,
        weights_cache=weights_cache,
        actors_ram=actors * version,
        checkpoints=(CHECKPOINT_KEEP + 1) * CHECKPOINT_BYTES_PER_PARAMETER * parameters
        + CHECKPOINT_EXTRA,
    )


def gib_text(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def ram_problem(available: int, need: Needs) -> str | None:
    """Why ``available`` bytes of host RAM (MemAvailable) cannot hold ``need``; None if they can."""
    if available >= need.ram:
        return None
    return (
        f"host RAM: the stack needs {gib_text(need.ram)} (the learner's peak "
        f"{gib_text(need.learner_ram)}, Redis maxmemory {gib_text(need.redis)}, the weights "
        f"cache {gib_text(need.weights_cache)}, the actors' versions {gib_text(need.actors_ram)}), "
        f"MemAvailable is {gib_text(available)}: free memory, or use a smaller model or fewer "
        "actors"
    )


def disk_problem(free: int, where: str, need: Needs) -> str | None:
    """Why ``free`` bytes on ``where`` cannot hold the checkpoints; None if they can."""
    if free >= need.checkpoints:
        return None
    return (
        f"disk: checkpoints need {gib_text(need.checkpoints)} on {where} "
        f"({CHECKPOINT_KEEP + 1} x {CHECKPOINT_BYTES_PER_PARAMETER} bytes per parameter + "
        f"{gib_text(CHECKPOINT_EXTRA)}), {gib_text(free)} free there: give --runs-dir a "
        "directory on a disk with room"
    )


def runs_location(host: Host, runs_dir: Path | None) -> tuple[Path | None, str]:
    """The path whose filesystem holds the checkpoints (None: not found), and its name."""
    if runs_dir is not None:
        return runs_dir, f"--runs-dir {runs_dir}"
    root = host.docker_root()
    return root, f"the runs volume under Docker's data root {root}"


def memory_and_disk(host: Host, need: Needs, runs_dir: Path | None) -> tuple[list, list]:
    """The RAM and disk checks: (problems, warnings)."""
    problems, warnings = [], []
    available = host.mem_available()
    if available is None:
        warnings.append("no MemAvailable in /proc/meminfo: host RAM is not checked")
    else:
        problems.append(ram_problem(available, need))
    path, where = runs_location(host, runs_dir)
    if path is None:
        warnings.append("Docker's data root not found: give --runs-dir to check the disk")
    else:
        problems.append(disk_problem(host.disk_free(path), where, need))
    return problems, warnings


def check_host(
    host: Host, need: Needs | None, runs_dir: Path | None, dockerfile: Path = DOCKERFILE
) -> list[str]:
    """Check the driver, and with ``need`` (a model given) the RAM and the checkpoints' disk;
    raise ``HostRefused`` with every problem found, else return the warnings (what could not
    be checked)."""
    cuda = image_cuda(dockerfile)
    versions = host.driver_versions()
    if versions:
        problems, warnings = [driver_problem(versions, cuda)], []
    else:
        problems = []
        warnings = [
            f"no nvidia-smi answered: the driver is not checked (the image, CUDA "
            f"{cuda[0]}.{cuda[1]}, needs driver {MIN_DRIVER[cuda]} or newer)"
        ]
    if need is not None:
        more_problems, more_warnings = memory_and_disk(host, need, runs_dir)
        problems += more_problems
        warnings += more_warnings
    found = [p for p in problems if p is not None]
    if found:
        raise HostRefused("\n  ".join(["the host cannot run this stack:", *found]))
    return warnings
