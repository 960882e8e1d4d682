"""scripts/compose_gpu.py checks the host before it writes the compose file
(scripts/compose_host.py): the NVIDIA driver against the image's CUDA, host RAM and the
checkpoints' disk for the planned layout, and Redis ``maxmemory`` sized to the longest delta
chain the weight store keeps.

``nvidia-smi`` is a fake executable first on PATH (what a node with that driver prints); RAM,
disk and Docker's data root are injected probes (``compose_host.Host``). The Redis bound is
checked against the real weight writer on the tests' Redis.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common.weights.publish.writer as writer_module
from common.config.learner import LearnerConfig
from common.config.run import RedisConfig
from common.weights.publish.writer import WeightWriter
from learner.checkpoint import save_checkpoint
from testing.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "compose_gpu.py"
compose_gpu = load_script("compose_gpu")
host_checks = compose_gpu.host_checks
GIB = 2**30
QWEN_7B = 7_615_616_512
"""Qwen2.5-7B's parameters (its safetensors headers)."""
OLD_DRIVER, NEW_DRIVER = "570.86.15", "580.65.06"

FAKE_SMI = """#!{python}
import sys
args = sys.argv[1:]
if args == ["-L"]:
    for i in range({gpus}):
        print(f"GPU {{i}}: NVIDIA H100 80GB HBM3 (UUID: GPU-{{i:08d}})")
elif "--query-gpu=driver_version" in args:
    print("\\n".join(["{driver}"] * {gpus}))
elif "--query-gpu=memory.total" in args:
    print("81559")
else:
    sys.exit("fake nvidia-smi: unexpected arguments %r" % args)
"""


def fake_nvidia_smi(bin_dir: Path, driver: str, gpus: int = 8) -> Path:
    """An ``nvidia-smi`` in ``bin_dir`` answering what compose_gpu.py asks, as a node with
    ``gpus`` H100s and driver ``driver`` does."""
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(FAKE_SMI.format(python=sys.executable, gpus=gpus, driver=driver))
    smi.chmod(0o755)
    return smi


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """Puts a fake nvidia-smi with the given driver first on PATH."""

    def install(driver: str, gpus: int = 8) -> Path:
        fake = fake_nvidia_smi(tmp_path / "bin", driver, gpus)
        monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
        return fake

    for variable in ("GPUS", "LEARNER_GPUS", "ACTORS", "MODEL_DIR", "RUNS_DIR"):
        monkeypatch.delenv(variable, raising=False)
    return install


def header_only_model(path: Path, parameters: int) -> Path:
    """An HF model directory whose safetensors file holds a header only (the script reads no
    weights): one tensor per 1e9 parameters, the rest in a last one."""
    path.mkdir()
    (path / "config.json").write_text("{}")
    header, left, i = {}, parameters, 0
    while left:
        n = min(left, 10**9)
        header[f"t{i}"] = {"dtype": "BF16", "shape": [n], "data_offsets": [0, 0]}
        left, i = left - n, i + 1
    raw = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


class Probes:
    """The RAM, disk and Docker-root probes of a host, with what was asked of them; the driver
    is read through the real probe, from the fake nvidia-smi on PATH."""

    def __init__(self, ram: int, disk: int, docker_root: Path | None = None) -> None:
        self.ram, self.disk, self.root = ram, disk, docker_root
        self.disks_asked: list[Path] = []

    def host(self):
        def disk_free(path: Path) -> int:
            self.disks_asked.append(path)
            return self.disk

        return host_checks.Host(
            mem_available=lambda: self.ram, disk_free=disk_free, docker_root=lambda: self.root
        )


def needs_7b(layout) -> object:
    """What compose_gpu.py plans for a header-only Qwen2.5-7B on ``layout`` (bf16 versions)."""
    version = 2 * QWEN_7B
    return host_checks.needs(
        QWEN_7B,
        version,
        0,
        learner_ranks=len(layout["learner"]),
        actors=len(layout) - 1,
        publish_max_inflight=compose_gpu.PUBLISH_MAX_INFLIGHT,
        redis=compose_gpu.whole_gib(compose_gpu.redis_maxmemory_bytes(version)),
        weights_cache=compose_gpu.whole_gib(compose_gpu.weights_cache_bytes(version)),
    )


def run_8_gpus(tmp_path: Path, probes: Probes, *extra: str) -> tuple[int, Path]:
    model = tmp_path / "qwen7b"
    if not model.exists():
        header_only_model(model, QWEN_7B)
    out = tmp_path / "docker-compose.gpu.yml"
    argv = ["--gpus", "8", "--learner-gpus", "4", "--model-dir", str(model), *extra]
    return compose_gpu.main([*argv, "-o", str(out)], host=probes.host()), out


def room(layout=None) -> Probes:
    """A host with just enough RAM and disk for Qwen2.5-7B on 8 GPUs (4 learner ranks)."""
    need = needs_7b(layout or compose_gpu.plan(8, 4))
    return Probes(ram=need.ram, disk=need.checkpoints, docker_root=Path("/docker-root"))


# ------------------------------------------------------------------------------ the driver


def test_an_old_driver_is_refused_with_what_to_do(tmp_path, smi, capsys):
    smi(OLD_DRIVER)
    runs = tmp_path / "runs"
    runs.mkdir()
    rc, out = run_8_gpus(tmp_path, room(), "--runs-dir", str(runs))
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists(), err
    assert f"NVIDIA driver {OLD_DRIVER} found; the image needs driver 580 or newer" in err
    assert "nvidia/cuda:13.0) is CUDA 13.0" in err
    # What to do: upgrade, or the older CUDA base this driver runs (570: CUDA 12.8).
    assert "Upgrade the host's driver to R580 or newer" in err
    assert "CUDA 12.8 at most (nvidia/cuda:12.8.x)" in err
    assert "--skip-host-checks" in err
    assert "disk" not in err and "host RAM" not in err  # those fit


def test_a_new_driver_with_room_is_accepted(tmp_path, smi, capsys):
    smi(NEW_DRIVER)
    runs = tmp_path / "runs"
    runs.mkdir()
    probes = room()
    rc, out = run_8_gpus(tmp_path, probes, "--runs-dir", str(runs))
    err = capsys.readouterr().err
    assert rc == 0 and out.exists(), err
    assert "warning" not in err, err
    assert probes.disks_asked == [runs]  # the disk checked is the one the checkpoints go to


def test_the_driver_check_runs_through_the_real_command_line(tmp_path):
    """As a user runs it, the fake nvidia-smi first on PATH: old refused, new accepted (no
    model: the driver is all there is to check)."""
    bin_dir = tmp_path / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("GPUS", "LEARNER_GPUS", "ACTORS")}
    for driver, status in ((OLD_DRIVER, 2), (NEW_DRIVER, 0)):
        fake_nvidia_smi(bin_dir, driver, gpus=2)
        env["PATH"] = f"{bin_dir}{os.pathsep}{os.defpath}"
        out = tmp_path / f"{driver}.yml"
        run = subprocess.run(
            [sys.executable, str(SCRIPT), "-o", str(out)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        assert run.returncode == status, run.stderr
        assert out.exists() == (status == 0)
        if status:
            assert f"NVIDIA driver {driver} found" in run.stderr


def test_the_driver_floor_follows_the_dockerfile(tmp_path):
    assert host_checks.image_cuda() == (13, 0)
    assert host_checks.MIN_DRIVER[host_checks.image_cuda()] == 580
    assert host_checks.driver_problem([NEW_DRIVER] * 8, (13, 0)) is None
    assert host_checks.driver_problem(["590.1"], (13, 0)) is None
    # The lowest driver of the node counts.
    assert "580.0 found" not in host_checks.driver_problem([NEW_DRIVER, "535.1"], (13, 0))
    assert "535.1 found" in host_checks.driver_problem([NEW_DRIVER, "535.1"], (13, 0))
    # A CUDA 12.8 base runs on R570.
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("# cu128\nFROM nvidia/cuda:12.8.1-base-ubuntu24.04\n")
    assert host_checks.image_cuda(dockerfile) == (12, 8)
    assert host_checks.driver_problem([OLD_DRIVER], (12, 8)) is None
    assert "no CUDA 12 or 13 base" in host_checks.driver_problem(["470.2"], (13, 0))
    with pytest.raises(host_checks.HostRefused, match="not a version"):
        host_checks.driver_problem(["N/A"], (13, 0))


def test_without_nvidia_smi_the_driver_is_a_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", os.defpath)
    if host_checks.shutil.which("nvidia-smi"):
        pytest.skip("a real nvidia-smi on the default PATH")
    assert compose_gpu.main(["--gpus", "2", "-o", str(tmp_path / "x.yml")]) == 0
    assert "the driver is not checked (the image, CUDA 13.0, needs driver 580" in (
        capsys.readouterr().err
    )


# ---------------------------------------------------------------------------- RAM and disk


def test_a_too_small_disk_is_refused_with_the_numbers(tmp_path, smi, capsys):
    smi(NEW_DRIVER)
    runs = tmp_path / "runs"
    runs.mkdir()
    need = needs_7b(compose_gpu.plan(8, 4))
    probes = room()
    probes.disk = need.checkpoints - 1
    rc, out = run_8_gpus(tmp_path, probes, "--runs-dir", str(runs))
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists(), err
    # (2 kept + 1 being written) x 12 bytes per parameter + 1 GiB: 256.3 GiB at 7.6B.
    assert need.checkpoints == 36 * QWEN_7B + GIB
    assert f"disk: checkpoints need 256.3 GiB on --runs-dir {runs}" in err
    assert "(3 x 12 bytes per parameter + 1.0 GiB), 256.3 GiB free there" in err
    assert "host RAM" not in err and "driver" not in err


def test_without_runs_dir_docker_s_data_root_is_checked(tmp_path, smi, capsys):
    smi(NEW_DRIVER)
    probes = room()
    probes.disk = GIB
    rc, _ = run_8_gpus(tmp_path, probes)
    err = capsys.readouterr().err
    assert rc == 2 and probes.disks_asked == [Path("/docker-root")], err
    assert "on the runs volume under Docker's data root /docker-root" in err
    assert "give --runs-dir a directory on a disk with room" in err
    probes.root = None  # no Docker here: said, not refused
    rc, _ = run_8_gpus(tmp_path, probes)
    assert rc == 0
    assert "Docker's data root not found" in capsys.readouterr().err


def test_too_little_ram_is_refused_with_the_numbers(tmp_path, smi, capsys):
    smi(NEW_DRIVER)
    need = needs_7b(compose_gpu.plan(8, 4))
    probes = room()
    probes.ram = need.ram - 1
    rc, _ = run_8_gpus(tmp_path, probes)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"host RAM: the stack needs {need.ram / GIB:.1f} GiB" in err
    assert f"MemAvailable is {(need.ram - 1) / GIB:.1f} GiB" in err


def test_every_problem_is_said_at_once_and_skipping_writes_with_a_warning(tmp_path, smi, capsys):
    smi(OLD_DRIVER)
    probes = Probes(ram=GIB, disk=GIB, docker_root=Path("/docker-root"))
    rc, out = run_8_gpus(tmp_path, probes)
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert all(s in err for s in (f"driver {OLD_DRIVER}", "host RAM:", "disk:")), err
    rc, out = run_8_gpus(tmp_path, probes, "--skip-host-checks")
    err = capsys.readouterr().err
    assert rc == 0 and out.exists(), err
    assert "warning: --skip-host-checks: the NVIDIA driver, host RAM and disk are not" in err


def test_the_estimates_at_7b():
    """The formulas of scripts/compose_host.py for Qwen2.5-7B on 8 GPUs (learner 4, 4 actors),
    bf16 versions: V = 2 P."""
    need = needs_7b(compose_gpu.plan(8, 4))
    p, v = QWEN_7B, 2 * QWEN_7B
    # Learner: 4 P kept + 12 P checkpoint gather + (I + 1) V shm + 3 V upload child = 26 P.
    assert need.learner_ram == 16 * p + (compose_gpu.PUBLISH_MAX_INFLIGHT + 4) * v == 26 * p
    assert 180 * GIB < need.learner_ram < 190 * GIB
    assert need.redis == compose_gpu.whole_gib(compose_gpu.chain_versions() * v + GIB)
    assert need.actors_ram == 4 * v
    assert need.ram == need.learner_ram + need.redis + need.weights_cache + need.actors_ram
    assert 400 * GIB < need.ram < 420 * GIB
    # At start every rank reads the model's files: with big files and many ranks, that counts.
    start = host_checks.needs(p, v, 10 * p, learner_ranks=8, actors=0, publish_max_inflight=1,
                              redis=0, weights_cache=0)  # fmt: skip
    assert start.learner_ram == 80 * p
    keep = inspect.signature(save_checkpoint).parameters["keep"].default
    assert host_checks.CHECKPOINT_KEEP == keep == 2


def test_mem_available_is_read_from_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemAvailable:    2048 kB\n")
    assert host_checks.mem_available(meminfo) == 2048 * 1024
    meminfo.write_text("MemTotal:       1000 kB\n")
    assert host_checks.mem_available(meminfo) is None
    assert host_checks.mem_available(tmp_path / "none") is None


# -------------------------------------------------------------------------- the runs mount


def test_runs_dir_is_mounted_at_runs_in_place_of_the_volume(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    stack = compose_gpu.render(compose_gpu.plan(4), runs_dir=runs)
    bind = f"{runs}:/runs"
    services = stack["services"]
    for name in ("learner", "actor", "actor-1", "actor-2"):
        volumes = services[name]["volumes"]
        assert bind in volumes and "runs:/runs" not in volumes, (name, volumes)
        assert sum(compose_gpu.mount_target(v) == "/runs" for v in volumes) == 1
    # Each extra actor keeps the base's other mounts.
    assert "weights-cache:/weights-cache" in services["actor-1"]["volumes"]
    # Without it, the base's named volume stays.
    assert "volumes" not in compose_gpu.render(compose_gpu.plan(4))["services"]["learner"]


def test_a_missing_runs_dir_is_refused(tmp_path, capsys):
    out = tmp_path / "x.yml"
    argv = ["--gpus", "2", "--runs-dir", str(tmp_path / "nope"), "-o", str(out)]
    assert compose_gpu.main(argv, host=Probes(0, 0).host()) == 2
    assert "no such directory (create it on the disk" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ Redis


def test_the_chain_constants_are_the_store_s():
    assert RedisConfig().retention == compose_gpu.REDIS_RETENTION
    assert RedisConfig().keyframe_every == compose_gpu.KEYFRAME_EVERY
    assert writer_module._MAX_DELTA_FRACTION == compose_gpu.MAX_DELTA_FRACTION
    assert LearnerConfig().publish_max_inflight == compose_gpu.PUBLISH_MAX_INFLIGHT
    assert compose_gpu.chain_versions() == 8.5


def test_the_generated_redis_maxmemory_covers_the_chain(tmp_path):
    """The compose file's Redis ``maxmemory`` for Qwen2.5-7B holds 8.5 versions (a keyframe,
    9 half-size deltas, 2 newer versions and the one being written), plus 1 GiB."""
    model = header_only_model(tmp_path / "qwen7b", QWEN_7B)
    stack = compose_gpu.render(compose_gpu.plan(8, 4), model_dir=model)
    setting = stack["services"]["redis"]["environment"]["SPECRL_REDIS_MAXMEMORY"]
    found = re.fullmatch(r"\$\{REDIS_MAXMEMORY:-(\d+)gb\}", setting)
    assert found, setting
    version = 2 * QWEN_7B
    assert int(found[1]) * GIB >= 8.5 * version + GIB
    assert int(found[1]) * GIB < 8.5 * version + 2 * GIB


def stored_bytes(client, run: str) -> int:
    return sum(client.strlen(k) for k in client.scan_iter(f"weights:{run}:*:chunk:*"))


def test_redis_maxmemory_holds_what_the_weight_store_keeps(redis_client, monkeypatch):
    """The real writer at the default retention and keyframe interval, driven to its worst
    case: a keyframe, 9 deltas just under half a version, then a forced keyframe and versions
    whose deltas are too big. The most it ever holds (measured when a write is committed and
    not yet pruned) fits chain_versions() full versions, and is more than the earlier
    (retention + 2) V sizing allowed."""
    run = "chain"
    writer = WeightWriter(
        redis_client,
        run,
        retention=compose_gpu.REDIS_RETENTION,
        keyframe_every=compose_gpu.KEYFRAME_EVERY,
    )
    peaks: list[int] = []
    prune = writer._prune

    def measured_prune() -> None:
        peaks.append(stored_bytes(redis_client, run))
        prune()

    monkeypatch.setattr(writer, "_prune", measured_prune)
    g = torch.Generator().manual_seed(0)
    names = [f"t{i:03d}" for i in range(100)]
    state = {n: torch.randn(4096, generator=g).to(torch.bfloat16) for n in names}
    versions = []
    for version in range(14):
        if version in range(1, 10):
            changed = names[(version * 7) % 52 :][:48]  # 48 of 100 tensors: a 0.48 V delta
        elif version > 0:
            changed = names  # all: too big for a delta, a full version
        else:
            changed = []
        for n in changed:
            state[n] = state[n] + 1
        writer.publish(version, state)
        versions.append(redis_client.get(f"weights:{run}:{version}:manifest"))
    kinds = [json.loads(m)["kind"] for m in versions]
    assert kinds == ["full"] + ["delta"] * 9 + ["full"] * 4, kinds
    full = max(stored_bytes(redis_client, run) // 3, 1)  # the last 3 are full versions
    assert max(peaks) <= compose_gpu.chain_versions() * full
    assert max(peaks) > (compose_gpu.REDIS_RETENTION + 2) * full  # the old sizing fell short
    assert max(peaks) > 8 * full
