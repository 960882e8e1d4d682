"""The learner's memory, measured for the resolve step's memory fit
(``common/config/memory_fit.py`` estimates and picks; ``common/config/resolve.py`` applies).

:func:`memory_facts` reads the model directory's ``config.json`` and the memory of one device:
``learner.device_memory_gib`` when set, else free GPU memory, or on CPU the host's available
RAM shared by the learner ranks on this host; under FSDP the least over all ranks (a
collective: every rank calls it and the ranks pick the same settings).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from common.config import SpecRLConfig
from common.config.memory_fit import GiB, Shape
from common.config.resolve import MemoryFacts

log = logging.getLogger(__name__)


def memory_facts(
    cfg: SpecRLConfig, model_dir: Path, device: torch.device, dist: Any = None
) -> MemoryFacts | None:
    """What the memory fit needs for the model in ``model_dir`` on ``device``; None (logged)
    when the fit is off or cannot estimate this model or this host's memory."""
    lcfg = cfg.learner
    if lcfg.profile == "off":
        return None
    raw = json.loads((model_dir / "config.json").read_text())
    try:
        shape = Shape.from_hf_config(raw)
    except KeyError as e:
        log.warning(
            "learner.profile=%s: no memory estimate for %s (its config has no %s); the "
            "settings are used as given",
            lcfg.profile,
            model_dir,
            e,
        )
        return None  # every rank reads the same config: none joins the collective
    available, source = device_memory(device, lcfg.device_memory_gib, dist)
    if available is None:
        log.warning(
            "learner.profile=%s: cannot read this host's available memory; set "
            "learner.device_memory_gib to check the settings against it",
            lcfg.profile,
        )
        return None
    ranks = dist.world if dist is not None else 1
    return MemoryFacts(shape, available, source, ranks, str(model_dir))


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def host_available() -> float | None:
    """Bytes of RAM this process may still use: ``MemAvailable``, bounded by the cgroup's limit
    (a container's) less its usage; None where neither can be read."""
    found: list[float] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    cgroups = (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    )
    for limit_file, usage_file in cgroups:
        limit, usage = _read_int(Path(limit_file)), _read_int(Path(usage_file))
        if limit is not None and usage is not None and limit < 2**60:
            found.append(max(limit - usage, 0))
            break
    return min(found) if found else None


def device_memory(
    device: torch.device, gib: float = 0.0, dist: Any = None
) -> tuple[float | None, str]:
    """(bytes of memory per device, where the figure comes from). ``gib`` > 0: that. Else free
    GPU memory, or on CPU the host's available RAM over the learner ranks on this host; the
    smallest over ranks, so every rank picks the same settings."""
    if gib > 0:
        return gib * GiB, "learner.device_memory_gib"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        value: float | None = float(free)
        source = f"free on {device.type}:{device.index or 0}"
    else:
        value = host_available()
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        source = "available host RAM" + (f" / {local} ranks on this host" if local > 1 else "")
        if value is not None:
            value /= local
    if dist is not None:
        t = torch.tensor(
            [-1.0 if value is None else value], dtype=torch.float64, device=dist.device
        )
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        value = None if t.item() < 0 else t.item()
        source += f", least over {dist.world} ranks"
    return value, source
