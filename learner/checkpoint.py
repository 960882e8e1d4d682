"""Learner checkpoints: HF-format model + optimizer/step/version/dedupe state, written atomically
(layout and why: docs/design.md §5.4).

The training state lives in ``training_state/`` because vLLM loads every ``*.safetensors`` of the
directory it is given; checkpoints written before it existed (those files beside the model) are
still read. No pickle: pending groups are wire frames. Under FSDP the caller gathers a
``FullState`` on rank 0 (``learner/distributed.py``) and passes that instead of the model.

Under FSDP a resume reads shards: ``load_sharded_model`` and ``load_sharded_optimizer`` have each
rank read only its rows of each tensor, with ``torch.distributed.checkpoint`` (DCP) and its
Hugging Face reader, which plans each rank's reads from the DTensor layout and slices the
safetensors files. DCP's own sharded format would need a second copy of the weights for
``transformers`` and vLLM and a converter for one process; read this way, the files stay the
ones both open, so any checkpoint, of either layout, resumes on one rank or on N.

Every layout is read here, the sharded one's too (``export_checkpoint`` consolidates it for one
process); ``learner/checkpoint_sharded.py`` writes that layout with what this module defines and
is never imported by it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch
from safetensors.torch import load_file
from torch import nn

from common.eagle import EAGLE_FILE, EAGLE_PREFIX
from common.link.protocol import DecodeLimits, TrajectoryGroup, decode, encode
from common.model import CONFIG_FILE, DRAFT_FILE, DRAFT_PREFIX, write_weights
from common.model_args import TIED_HEAD, config_ties_head
from common.tokenizer import Tokenizer, load_tokenizer
from common.weights.format import raw_bytes, safetensors_layout
from learner.policy import hf_config, load_policy, unwrap

STATE_FILE = "trainer_state.json"
PENDING_FILE = "pending_groups.msgpack"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINING_DIR = "training_state"
GRAD_SLOT = "grad"
"""``name::grad``: a gradient held across learner steps (``learner/checkpoint_sharded.py``)."""
SHARDS_DIR = "shards"
FORMAT_KEY = "checkpoint_format"
"""``trainer_state.json``'s record of the layout (``sharded`` or ``full``)."""


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


def model_shards(checkpoint: Path) -> Path:
    """A sharded checkpoint's model files (``learner/checkpoint_sharded.py``)."""
    return checkpoint / TRAINING_DIR / SHARDS_DIR / "model"


def optimizer_shards(checkpoint: Path) -> Path:
    """A sharded checkpoint's optimizer files (``learner/checkpoint_sharded.py``)."""
    return checkpoint / TRAINING_DIR / SHARDS_DIR / "optimizer"


def is_sharded(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` is in the sharded format (else the full one)."""
    return model_shards(checkpoint).is_dir()


PREFIX = "step_"


@dataclass
class TrainerState:
    step: int
    version: int
    dedupe: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    wal_from: int = 0
    """First write-ahead-log segment not covered by this checkpoint (see common/link/receive/wal.py)."""


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
        param_groups=param_group_settings(optimizer),
    )


def param_group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's hyper-parameters, group by group (without the parameter lists)."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def untied_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The policy's parameters and persistent buffers by HF name (as they are: DTensors under
    FSDP, not detached), a tied LM head once."""
    policy = unwrap(model)
    unique = {name for name, _ in policy.named_parameters()}
    tied = {name for name, _ in policy.named_parameters(remove_duplicate=False)} - unique
    return {k: v for k, v in policy.state_dict(keep_vars=True).items() if k not in tied}


def write_model_config(path: Path, config: dict[str, Any]) -> None:
    """The model's ``config.json`` in ``path``."""
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def write_model(config: dict[str, Any], state: dict[str, torch.Tensor], path: Path) -> None:
    """``config.json`` + ``model.safetensors`` that ``transformers`` and vLLM open; a tied LM
    head is omitted, as HF does (safetensors refuses shared storage)."""
    path.mkdir(parents=True, exist_ok=True)
    skip_head = config_ties_head(config)
    tensors = {
        name: t.detach().contiguous().cpu()
        for name, t in state.items()
        if not (skip_head and name == TIED_HEAD)
    }
    write_model_config(path, config)
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
    final, tmp = temp_checkpoint(root, state.step)
    write_model(full.config, full.model, tmp)
    tokenizer.save(tmp)
    training = tmp / TRAINING_DIR
    training.mkdir(exist_ok=True)
    save_file(full.optimizer, str(training / OPTIMIZER_FILE))
    write_training_state(training, state, full.param_groups, pending)
    return commit(tmp, final, keep)


def temp_checkpoint(root: Path, step: int) -> tuple[Path, Path]:
    """The final path of step ``step``'s checkpoint and the temporary directory it is written
    in (a dot name, which ``list_checkpoints`` ignores, until ``commit`` renames it). Temporary
    directories a crash left behind mid-save are removed first."""
    # This user's alone, whatever the umask: the weights of a private model (``mkdtemp`` makes
    # each checkpoint's directory 0700 too).
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    for stale in root.glob(f".{PREFIX}*.*"):
        if stale.is_dir() and not stale.name.endswith(".old"):
            shutil.rmtree(stale, ignore_errors=True)
    final = root / f"{PREFIX}{step:08d}"
    return final, Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))


def write_training_state(
    training: Path,
    state: TrainerState,
    param_groups: list[dict[str, Any]],
    pending: list[TrajectoryGroup] | None,
    **extra: Any,
) -> None:
    """``trainer_state.json`` (counters, dedupe state, optimizer hyper-parameters, ``extra``)
    and the pending groups, in a checkpoint's ``training_state/``."""
    (training / STATE_FILE).write_text(
        json.dumps(
            {
                "step": state.step,
                "version": state.version,
                "dedupe": state.dedupe,
                "metrics": state.metrics,
                "wal_from": state.wal_from,
                "optimizer_param_groups": param_groups,
                **extra,
            }
        )
    )
    (training / PENDING_FILE).write_bytes(msgpack.packb([encode(g) for g in pending or []]))


def commit(tmp: Path, final: Path, keep: int) -> Path:
    """Make the complete checkpoint in ``tmp`` the one at ``final`` (a rename: a crash before it
    leaves only a dot directory, never a checkpoint that looks complete), then keep the newest
    ``keep``."""
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
    for old in list_checkpoints(final.parent)[:-keep]:
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


def read_trainer_state(path: Path) -> tuple[TrainerState, list[dict[str, Any]]]:
    """A checkpoint's trainer state and optimizer hyper-parameters."""
    raw = json.loads(_training_file(path, STATE_FILE).read_text())
    state = TrainerState(
        step=int(raw["step"]),
        version=int(raw["version"]),
        dedupe=raw.get("dedupe", {}),
        metrics=raw.get("metrics", {}),
        wal_from=int(raw.get("wal_from", 0)),
    )
    return state, raw.get("optimizer_param_groups", [])


def load_checkpoint(
    path: Path, device: torch.device, impl: str = "auto", dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, dict[str, torch.Tensor], TrainerState, list[dict[str, Any]]]:
    """Model, optimizer tensors (by name), trainer state and optimizer hyper-parameters: the
    whole state, for one process. A sharded checkpoint (``learner/checkpoint_sharded.py``) is
    consolidated into a temporary full one first."""
    if is_sharded(path):
        with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=path.parent) as tmp:
            return load_checkpoint(
                export_checkpoint(path, Path(tmp) / path.name), device, impl, dtype
            )
    model = load_policy(path, impl, device, dtype)
    state, param_groups = read_trainer_state(path)
    tensors = load_file(str(_training_file(path, OPTIMIZER_FILE)), device=str(device))
    return model, tensors, state, param_groups


def read_full(directory: Path) -> dict[str, torch.Tensor]:
    """One process: the full tensors of the shard files in ``directory`` (every rank's rows)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(directory))
    stored = reader.read_metadata().state_dict_metadata
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in stored.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def export_checkpoint(checkpoint: Path, out: Path) -> Path:
    """A sharded checkpoint consolidated into a full one at ``out`` (one process, the whole state
    in memory): ``model.safetensors`` that ``transformers`` and vLLM open, and the training state
    one process resumes from (``out`` in a run's ``checkpoints/`` is resumed as any other)."""
    if not (checkpoint / CONFIG_FILE).is_file():
        raise ValueError(f"{checkpoint} is not a checkpoint (no config.json)")
    if not is_sharded(checkpoint):
        raise ValueError(f"{checkpoint} is not a sharded checkpoint (it opens as it is)")
    config = json.loads((checkpoint / CONFIG_FILE).read_text())
    out.mkdir(mode=0o700, parents=True, exist_ok=False)
    write_model(config, read_full(model_shards(checkpoint)), out)
    load_tokenizer(checkpoint).save(out)
    training = out / TRAINING_DIR
    training.mkdir(mode=0o700, exist_ok=True)
    save_file(read_full(optimizer_shards(checkpoint)), training / OPTIMIZER_FILE)
    raw = json.loads((checkpoint / TRAINING_DIR / STATE_FILE).read_text())
    raw[FORMAT_KEY] = "full"
    (training / STATE_FILE).write_text(json.dumps(raw))
    shutil.copyfile(checkpoint / TRAINING_DIR / PENDING_FILE, training / PENDING_FILE)
    return out


def _read_shards(directory: Path, targets: dict[str, torch.Tensor]) -> None:
    """Collective: fill ``targets`` (DTensor shards: this rank's rows; plain tensors: whole) from
    the ``*.safetensors`` files of ``directory``, reading only those rows."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(directory))
    stored = reader.read_metadata().state_dict_metadata
    missing = sorted(set(targets) - set(stored))
    if missing:
        raise ValueError(
            f"{directory} has no tensor {', '.join(missing[:5])}"
            + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
            + ": not a checkpoint of this model (move it out of the run's checkpoints/ to resume "
            "from an older one, or set learner.resume=false to start from the model)"
        )
    dcp.load(targets, storage_reader=reader)


def load_sharded_model(model: nn.Module, path: Path) -> None:
    """Collective: a sharded model's parameters and persistent buffers (allocated by
    ``learner.distributed.materialize``) from the model files of ``path``, a checkpoint or model
    directory; each rank reads its shards only."""
    targets = untied_state(model)
    if is_sharded(path):
        _read_shards(model_shards(path), targets)
        return
    # A draft adapter's and an EAGLE-3 head's tensors are in files of their own.
    for prefix, file in ((DRAFT_PREFIX, DRAFT_FILE), (EAGLE_PREFIX, EAGLE_FILE)):
        part = {k: targets.pop(k) for k in [k for k in targets if k.startswith(prefix)]}
        if part:
            _read_shards((path / file).parent, part)
    _read_shards(path, targets)


def load_sharded_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    path: Path,
    param_groups: list[dict[str, Any]],
) -> None:
    """Collective: a checkpoint's AdamW state into the optimizer of a sharded model, each rank
    reading the rows of its shards (moments) and the whole of each scalar (``step``). Parameters
    the checkpoint has no state for start without, as AdamW does."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    file = optimizer_shards(path) if is_sharded(path) else _training_file(path, OPTIMIZER_FILE)
    if not file.exists():
        raise FileNotFoundError(
            f"checkpoint {path} has no {TRAINING_DIR}/{OPTIMIZER_FILE} (a model directory, not "
            "a training checkpoint: set learner.resume=false and model.path to train from it)"
        )
    directory = file if file.is_dir() else file.parent
    stored = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    params = dict(unwrap(model).named_parameters())
    targets: dict[str, torch.Tensor] = {}
    for key, meta in stored.items():
        name, sep, _ = key.partition("::")
        if not sep:
            continue  # a model tensor (beside the optimizer's in the older layout)
        if name not in params:
            raise ValueError(
                f"{file}: optimizer state for {name!r}, a parameter this model lacks (a "
                "checkpoint of another model; set learner.resume=false to start from the model)"
            )
        param = params[name]
        if tuple(meta.size) == tuple(param.shape):
            targets[key] = torch.empty_like(param)  # sharded as the parameter
        else:
            targets[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    _read_shards(directory, targets)
    _restore_slots(optimizer, params, targets)
    restore_param_groups(optimizer, param_groups)


def _restore_slots(
    optimizer: torch.optim.Optimizer,
    params: dict[str, nn.Parameter],
    tensors: dict[str, torch.Tensor],
) -> None:
    """``{name::slot: tensor}`` into the optimizer's state; ``name::grad`` (gradients held across
    learner steps, in sharded checkpoints) into the parameter's ``.grad``."""
    for key, value in tensors.items():
        name, _, slot = key.partition("::")
        if slot == GRAD_SLOT:
            params[name].grad = value
        else:
            optimizer.state[params[name]][slot] = value


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
    _restore_slots(optimizer, dict(model.named_parameters()), tensors)
    restore_param_groups(optimizer, param_groups)


def restore_param_groups(
    optimizer: torch.optim.Optimizer, param_groups: list[dict[str, Any]]
) -> None:
    """A checkpoint's optimizer hyper-parameters (lr, betas, ...), group by group."""
    for group, saved in zip(optimizer.param_groups, param_groups, strict=False):
        for k, v in saved.items():
            if k in group and not isinstance(v, list):
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
