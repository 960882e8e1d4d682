"""Learner checkpoints: HF-format model + optimizer/step/version/dedupe state, written atomically
(layout and why: docs/design.md §5.4).

The training state lives in ``training_state/`` because vLLM loads every ``*.safetensors`` of the
directory it is given; checkpoints written before it existed (those files beside the model) are
still read. No pickle: pending groups are wire frames. Under FSDP the caller gathers a
``FullState`` on rank 0 (``learner/distributed.py``) and passes that instead of the model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch
from safetensors.torch import load_file
from torch import nn

from common.model import CONFIG_FILE, write_weights
from common.protocol import DecodeLimits, TrajectoryGroup, decode, encode
from common.tokenizer import Tokenizer
from common.weights.format import raw_bytes, safetensors_layout
from learner.policy import hf_config, load_policy

STATE_FILE = "trainer_state.json"
PENDING_FILE = "pending_groups.msgpack"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINING_DIR = "training_state"


def save_file(
    tensors: Mapping[str, torch.Tensor],
    path: str | Path,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` to ``path`` one tensor at a time (no copy of the whole state)."""
    order, head, _ = safetensors_layout(tensors, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for name in order:
            raw = raw_bytes(tensors[name])
            if raw.numel():
                f.write(memoryview(raw.numpy()))


def _training_file(checkpoint: Path, name: str) -> Path:
    """Where a checkpoint keeps training file ``name``: ``training_state/``, or beside the model
    in checkpoints of the older layout."""
    path = checkpoint / TRAINING_DIR / name
    return path if path.exists() or not (checkpoint / name).exists() else checkpoint / name


PREFIX = "step_"


@dataclass
class TrainerState:
    step: int
    version: int
    dedupe: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    wal_from: int = 0
    """First write-ahead-log segment not covered by this checkpoint (see learner/wal.py)."""


@dataclass
class FullState:
    """A model and its optimizer as plain CPU tensors by HF parameter name: what a checkpoint
    holds (gathered from all ranks under FSDP)."""

    config: dict[str, Any]
    """The model's ``config.json``."""
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    """AdamW moments as ``{name::slot: tensor}``."""
    param_groups: list[dict[str, Any]]
    """Optimizer hyper-parameters (without the parameter lists)."""


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> FullState:
    """A single process's model and optimizer as a ``FullState`` (no copies: views)."""
    return FullState(
        config=hf_config(model, next(model.parameters()).dtype),
        model=dict(model.state_dict()),
        optimizer=_optimizer_tensors(model, optimizer),
        param_groups=[
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ],
    )


def write_model(config: dict[str, Any], state: dict[str, torch.Tensor], path: Path) -> None:
    """``config.json`` + ``model.safetensors`` that ``transformers`` and vLLM open; a tied LM
    head is omitted, as HF does (safetensors refuses shared storage)."""
    path.mkdir(parents=True, exist_ok=True)
    skip_head = bool(config.get("tie_word_embeddings"))
    tensors = {
        name: t.detach().contiguous().cpu()
        for name, t in state.items()
        if not (skip_head and name == "lm_head.weight")
    }
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    write_weights(tensors, path)  # a draft adapter's tensors in their own file


def save_checkpoint(
    root: Path,
    model: nn.Module | FullState,
    tokenizer: Tokenizer,
    optimizer: torch.optim.Optimizer | None,
    state: TrainerState,
    keep: int = 2,
    pending: list[TrajectoryGroup] | None = None,
) -> Path:
    """``model``: a single process's model (with its ``optimizer``), or a gathered
    ``FullState`` (``optimizer`` then unused)."""
    full = model if isinstance(model, FullState) else full_state(model, optimizer)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{state.step:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    write_model(full.config, full.model, tmp)
    tokenizer.save(tmp)
    training = tmp / TRAINING_DIR
    training.mkdir()
    save_file(full.optimizer, str(training / OPTIMIZER_FILE))
    (training / STATE_FILE).write_text(
        json.dumps(
            {
                "step": state.step,
                "version": state.version,
                "dedupe": state.dedupe,
                "metrics": state.metrics,
                "wal_from": state.wal_from,
                "optimizer_param_groups": full.param_groups,
            }
        )
    )
    (training / PENDING_FILE).write_bytes(msgpack.packb([encode(g) for g in pending or []]))
    if final.exists():
        # Swap, never delete-then-rename: a crash between the two must not lose the checkpoint.
        old = final.with_name(f".{final.name}.old")
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old)
    return final


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories start with a dot)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def load_pending(path: Path, limits: DecodeLimits) -> list[TrajectoryGroup]:
    """The groups a checkpoint carried over (validated like any frame off the wire)."""
    file = _training_file(path, PENDING_FILE)
    if not file.is_file():
        return []
    groups = []
    for frame in msgpack.unpackb(file.read_bytes(), raw=False):
        message = decode(frame, limits)
        if not isinstance(message, TrajectoryGroup):
            raise ValueError(f"{file}: expected trajectory groups, found {type(message).__name__}")
        groups.append(message)
    return groups


def load_checkpoint(
    path: Path, device: torch.device, impl: str = "auto", dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, dict[str, torch.Tensor], TrainerState, list[dict[str, Any]]]:
    """Model, optimizer tensors (by name), trainer state and optimizer hyper-parameters."""
    model = load_policy(path, impl, device, dtype)
    raw = json.loads(_training_file(path, STATE_FILE).read_text())
    state = TrainerState(
        step=int(raw["step"]),
        version=int(raw["version"]),
        dedupe=raw.get("dedupe", {}),
        metrics=raw.get("metrics", {}),
        wal_from=int(raw.get("wal_from", 0)),
    )
    tensors = load_file(str(_training_file(path, OPTIMIZER_FILE)), device=str(device))
    return model, tensors, state, raw.get("optimizer_param_groups", [])


def _optimizer_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for param, param_state in optimizer.state.items():
        name = names[id(param)]
        for key, value in param_state.items():
            tensor = value if torch.is_tensor(value) else torch.tensor(value)
            out[f"{name}::{key}"] = tensor.detach().contiguous().cpu()
    return out


def restore_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, torch.Tensor],
    param_groups: list[dict[str, Any]],
) -> None:
    params = dict(model.named_parameters())
    for key, value in tensors.items():
        name, _, slot = key.partition("::")
        optimizer.state[params[name]][slot] = value
    for group, saved in zip(optimizer.param_groups, param_groups, strict=False):
        for k, v in saved.items():
            if k in group and not isinstance(v, list):
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
