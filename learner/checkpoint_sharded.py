"""Sharded learner checkpoints: with N ranks each rank writes its own rows of the model and of
AdamW's state, through ``torch.distributed.checkpoint`` (DCP), and no rank gathers the full state.

Layout (beside what every checkpoint has: ``config.json``, the tokenizer, and
``training_state/`` with ``trainer_state.json`` and the pending groups, written by rank 0)::

    training_state/shards/model/shard-0000R-model-0000F-of-0000N.safetensors      rank R-1's rows
    training_state/shards/optimizer/shard-0000R-model-0000F-of-0000N.safetensors  its moments

(F of N: a rank's rows cut into files of about ``FILE_BYTES``.) The files are DCP's Hugging Face format (``HuggingFaceStorageWriter(save_distributed=True)``):
safetensors whose header records each tensor's offset in the full one, no pickle, no metadata
file. A tensor every rank holds whole (AdamW's ``step``, a buffer) is written by one rank. They
sit under ``training_state/`` because vLLM and ``transformers`` load every ``*.safetensors`` at the
top of a directory: a sharded checkpoint does not open in them as it is; ``export_checkpoint``
(in ``learner/checkpoint.py``; ``python -m learner.checkpoint_sharded CHECKPOINT OUT``)
consolidates it into a full one that does, and that also resumes on one process.

A resume reads it with the reader every sharded resume uses (``load_sharded_model``,
``load_sharded_optimizer`` in ``learner/checkpoint.py``): each rank reads the rows of its shards,
whatever the number of ranks that wrote them. One process resumes through ``export_checkpoint``.
The layout's paths and files are ``learner/checkpoint.py``'s; this module only writes it (it
imports that one, never the reverse).

Atomic as the full format: all ranks write into rank 0's temporary dot directory; rank 0 writes
the rest and renames it to ``step_N`` only once every rank's files are written (``dcp.save``
returns on a rank only after all ranks' writes finished). A crash before the rename leaves a dot
directory that ``latest_checkpoint`` ignores and the next save removes.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from torch import nn

from common.config.learner import LearnerConfig
from common.link.protocol import TrajectoryGroup
from common.tokenizer import Tokenizer
from learner.checkpoint import (
    FORMAT_KEY,
    GRAD_SLOT,
    TRAINING_DIR,
    TrainerState,
    commit,
    export_checkpoint,
    model_shards,
    optimizer_shards,
    param_group_settings,
    temp_checkpoint,
    untied_state,
    write_model_config,
    write_training_state,
)
from learner.checkpoint import is_sharded as is_sharded  # re-exported: callers import it here
from learner.policy import hf_config, unwrap

HELD_GRADIENTS_KEY = "eagle_pending"
"""A parameter group's count of learner steps whose gradients it holds (``learner/step.py``)."""
FILE_BYTES = 512 * 1024 * 1024
"""About the largest file a rank writes (its rows of consecutive tensors; a larger tensor
alone)."""


def use_sharded(lcfg: LearnerConfig, dist: Any) -> bool:
    """Whether this learner writes sharded checkpoints (``learner.checkpoint_format``): only with
    several ranks (``auto`` and ``sharded``)."""
    return dist is not None and lcfg.checkpoint_format != "full"


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's view of the model's state (DTensors under FSDP) by HF name, a tied LM head
    once (as ``load_sharded_model`` reads it)."""
    return {k: v.detach() for k, v in untied_state(model).items()}


def optimizer_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """AdamW's state as ``{name::slot: tensor}`` (moments sharded as their parameter), and the
    gradients a group holds across learner steps (the EAGLE-3 head's, ``spec.eagle_accumulate``:
    ``name::grad``), so a resume mid-accumulation continues exactly."""
    names = {id(p): n for n, p in unwrap(model).named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for param, slots in optimizer.state.items():
        for slot, value in slots.items():
            tensor = value if torch.is_tensor(value) else torch.tensor(value)
            out[f"{names[id(param)]}::{slot}"] = tensor.detach()
    for group in optimizer.param_groups:
        if group.get(HELD_GRADIENTS_KEY):
            for param in group["params"]:
                if param.grad is not None:
                    out[f"{names[id(param)]}::{GRAD_SLOT}"] = param.grad.detach()
    return out


def file_index(tensors: dict[str, torch.Tensor], file_bytes: int) -> dict[str, int]:
    """Each tensor's file (1, 2, ...): consecutive tensors up to ``file_bytes`` of full-tensor
    bytes a file (a larger tensor alone). The same on every rank (full shapes, state-dict order)."""
    index: dict[str, int] = {}
    current, used = 1, 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()  # a DTensor's full size
        if used and used + size > file_bytes:
            current, used = current + 1, 0
        index[name] = current
        used += size
    return index


def write_shards(tensors: dict[str, torch.Tensor], directory: Path) -> None:
    """Collective: every rank's rows of ``tensors`` into its own files in ``directory``. DCP's
    writer serialises a file in memory (and copies a GPU shard to the CPU first), so a rank's
    files are cut at about ``FILE_BYTES``: that, not its whole shard, is what a rank holds
    beside its state while it writes."""
    import torch.distributed as torch_dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    per_rank = FILE_BYTES * torch_dist.get_world_size()  # full-tensor bytes: a rank has 1/N
    writer = HuggingFaceStorageWriter(
        str(directory), fqn_to_index_mapping=file_index(tensors, per_rank), save_distributed=True
    )
    dcp.save(tensors, storage_writer=writer)


def save_sharded_checkpoint(
    root: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    dist: Any,
    tokenizer: Tokenizer | None = None,
    state: TrainerState | None = None,
    keep: int = 2,
    pending: list[TrajectoryGroup] | None = None,
) -> Path | None:
    """Collective (``dist``: the ``DistContext``): every rank writes its shards of ``model`` and
    ``optimizer``; rank 0 (which alone passes ``tokenizer`` and ``state``) writes the rest and
    commits. Returns the checkpoint on rank 0, None on the others."""
    final = tmp = Path()
    if dist.is_main:
        if state is None or tokenizer is None:
            raise ValueError("rank 0 saves a checkpoint with its trainer state and tokenizer")
        final, tmp = temp_checkpoint(root, state.step)
        for directory in (model_shards(tmp), optimizer_shards(tmp)):
            directory.mkdir(mode=0o700, parents=True)
    # Rank 0's temporary directory, by name (a uint8 broadcast: no pickle).
    tmp = Path(dist.broadcast_bytes(str(tmp).encode()).decode())
    write_shards(model_tensors(model), model_shards(tmp))
    write_shards(optimizer_tensors(model, optimizer), optimizer_shards(tmp))
    if not dist.is_main:
        return None
    assert state is not None and tokenizer is not None
    policy = unwrap(model)
    write_model_config(tmp, hf_config(policy, next(policy.parameters()).dtype))
    tokenizer.save(tmp)
    write_training_state(
        tmp / TRAINING_DIR,
        state,
        param_group_settings(optimizer),
        pending,
        **{FORMAT_KEY: "sharded", "ranks": dist.world},
    )
    return commit(tmp, final, keep)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m learner.checkpoint_sharded",
        description="Consolidate a sharded learner checkpoint into a full one (HF format).",
    )
    parser.add_argument("checkpoint", type=Path, help="a run's checkpoints/step_N")
    parser.add_argument("out", type=Path, help="new directory for the full checkpoint")
    args = parser.parse_args(argv)
    try:
        print(export_checkpoint(args.checkpoint, args.out))
    except (ValueError, FileExistsError) as e:
        parser.error(str(e))


if __name__ == "__main__":
    main()
