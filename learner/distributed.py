"""Data-parallel learner over N ranks with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Launch: ``torchrun --nproc-per-node N -m learner.main ...`` (gloo on CPU, NCCL on GPU). Without
``WORLD_SIZE`` > 1 the learner is a single process.

Rank 0 alone talks to the outside (receiver, write-ahead log, admission, staleness buffer, Redis,
checkpoints). It broadcasts each step's groups (wire frames in a uint8 tensor; no pickle) and
version; every rank collates the same full batch and trains its shard of rows. Why N ranks give
the 1-rank update: docs/design.md §4.1 and ``learner/microbatch.py``.

Checkpoints are written sharded by default: each rank writes its own rows through
``torch.distributed.checkpoint`` (``learner/checkpoint_sharded.py``; ``learner.checkpoint_format``,
``full`` gathers the whole state dict to rank 0's CPU as before). Publishing streams the state to
rank 0 in the publish dtype, one tensor at a time (``stream_full_state``). Both are collectives every rank
joins at the same point: publishing follows ``publish_every`` and the step's (all-reduced)
skipped flag, checkpoints ``checkpoint_every``, the final checkpoint rank 0's ``stop`` message.
On resume every rank builds the model with its parameters on the meta device (``empty_policy``),
shards it, allocates its shards (``materialize``) and reads only those rows of each tensor from
the checkpoint (``learner/checkpoint.py``): no rank holds the full model or AdamW state.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist
from torch import Tensor, nn

from common.link.protocol import DecodeLimits, TrajectoryGroup, decode, encode
from common.model import CONFIG_FILE, Transformer
from common.model_args import ModelArgs
from learner.policy import PolicyModule, choose_impl, decoder_layers

log = logging.getLogger(__name__)

PREFIX = "policy."


@dataclass
class DistContext:
    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def broadcast_bytes(self, data: bytes = b"") -> bytes:
        """Rank 0's ``data`` on every rank (a length, then a uint8 tensor: no pickle)."""
        size = torch.tensor([len(data) if self.is_main else 0], device=self.device)
        dist.broadcast(size, src=0)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.is_main and data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        dist.broadcast(buf, src=0)
        return buf.cpu().numpy().tobytes()

    def send_step(self, groups: list[TrajectoryGroup], version: int) -> None:
        """Rank 0: this step's groups (as wire frames) and learner version."""
        self.broadcast_bytes(msgpack.packb(["step", version, [encode(g) for g in groups]]))

    def send_stop(self) -> None:
        self.broadcast_bytes(msgpack.packb(["stop", -1, []]))

    def receive(self, limits: DecodeLimits) -> tuple[str, int, list[TrajectoryGroup]]:
        """Ranks > 0: rank 0's next message, groups decoded and validated like any frame."""
        op, version, frames = msgpack.unpackb(self.broadcast_bytes(), raw=False)
        groups = []
        for frame in frames:
            group = decode(frame, limits)
            if not isinstance(group, TrajectoryGroup):
                raise ValueError(f"rank 0 sent a {type(group).__name__}, not a group")
            groups.append(group)
        return op, version, groups

    def barrier(self) -> None:
        dist.barrier()


def local_rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun sets for rank ``rank`` of ``world`` ranks on this host, meeting at
    127.0.0.1:``port``: for ranks that a test or benchmark spawns without torchrun."""
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
    }


def init_from_env(timeout_s: float = 3600.0) -> DistContext | None:
    """The process group from torchrun's environment, or None for a single process. The timeout
    bounds how long ranks wait for rank 0 (which may wait ``group_timeout_s`` for groups)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    log.info("learner rank %d/%d on %s (%s)", rank, world, device, backend)
    return DistContext(rank, world, local_rank, device)


def shutdown() -> None:
    if dist.is_initialized():
        try:
            # Every rank tears the group down together: a rank whose peers have already
            # closed their gloo connections can abort in the destructor.
            dist.barrier()
        except Exception as e:  # noqa: BLE001 - a peer already gone: tear down regardless
            log.warning("learner: barrier before closing the process group failed: %s", e)
        dist.destroy_process_group()


def mixed_precision(precision: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for ``learner.precision``.

    ``bf16-mixed``: FSDP all-gathers bf16 copies of the fp32 shards, so forward and backward run
    on bf16 weights (matmuls in bf16 as under autocast on one process; elementwise ops and the
    residual stream see bf16 too, as in a bf16 inference engine), and reduce-scatters gradients
    in fp32 into the fp32 shards that AdamW updates. Forward inputs keep their dtype: the root's
    are reference log-probs, and autocast (``learner/step.py``) casts at each op as on one
    process. ``fp32`` and ``bf16``: no casts (the parameters' own dtype throughout)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    return MixedPrecisionPolicy()


def shard(policy: nn.Module, precision: str = "fp32") -> PolicyModule:
    """FSDP2: each decoder layer is one unit; the root (embedding, final norm, LM head) another,
    with ``mixed_precision(precision)``. Parameters stay in their dtype (fp32 master weights
    unless ``precision=bf16``). A policy on the meta device (``empty_policy``) stays there until
    ``materialize``."""
    from torch.distributed.fsdp import fully_shard

    mp = mixed_precision(precision)
    module = PolicyModule(policy)
    for layer in decoder_layers(policy):
        fully_shard(layer, mp_policy=mp)
    fully_shard(module, mp_policy=mp)
    return module


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Within: each parameter a module registers moves to the meta device as it is registered
    (its values never touched); buffers are computed as usual. ``torch.device("meta")`` would
    leave empty the non-persistent buffers no checkpoint holds (a ``transformers`` model's RoPE
    frequencies); ``accelerate.init_empty_weights(include_buffers=False)`` does the same as this,
    but accelerate is not a dependency of the learner."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def empty_policy(model_dir: Path, impl: str, dtype: torch.dtype) -> nn.Module:
    """The policy of an HF-format directory (as ``load_policy`` builds it) with its parameters on
    the meta device in ``dtype``: no memory until ``shard`` and ``materialize``, then filled from
    the files by ``learner.checkpoint.load_sharded_model``."""
    with _parameters_on_meta():
        if choose_impl(model_dir, impl) == "builtin":
            config = json.loads((model_dir / CONFIG_FILE).read_text())
            return Transformer(ModelArgs.from_hf_config(config)).to(dtype)
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def materialize(module: nn.Module, device: torch.device) -> None:
    """Allocate (uninitialised) a sharded module's meta parameters on ``device``: each rank its
    shards only. Buffers keep the values they had."""
    buffers = dict(module.named_buffers())
    module.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            if not buffers[name].is_meta:
                buffer.copy_(buffers[name])


def _strip(name: str) -> str:
    return name.removeprefix(PREFIX)


def full_model_state(module: PolicyModule) -> dict[str, Tensor]:
    """Collective: the unsharded state dict on rank 0's CPU (HF names); empty on other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(
        module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {_strip(k): v for k, v in state.items()}


def shards_finite(module: nn.Module, device: torch.device) -> bool:
    """Collective: whether every floating tensor of ``module`` is finite, each rank checking
    only its own shards (a replicated tensor on every rank), the counts summed over the ranks.
    Run before :func:`stream_full_state`, a version with a NaN or an infinity is refused without
    gathering it, and the check is spread over the ranks instead of run on rank 0's gathered copy."""
    from torch.distributed.tensor import DTensor

    bad = torch.zeros((), dtype=torch.int64, device=device)
    seen: set[int] = set()
    for value in module.state_dict(keep_vars=True).values():
        if id(value) in seen:
            continue
        seen.add(id(value))
        local = value.detach()
        local = local.to_local() if isinstance(local, DTensor) else local
        if local.is_floating_point() and local.numel():
            bad += (~torch.isfinite(local)).sum().to(device)
    torch.distributed.all_reduce(bad)
    return int(bad.item()) == 0


def stream_full_state(
    module: nn.Module, dtype: torch.dtype, into: dict[str, Tensor] | None
) -> dict[str, Tensor] | None:
    """Collective: the unsharded state (HF names) in ``dtype`` gathered one tensor at a time into
    ``into`` on rank 0's CPU (tensors of the right shape and dtype, refilled in place; missing
    ones are allocated once); ranks > 0 pass None and get None.

    Each floating tensor's local shard is cast to ``dtype`` on its own device first, then
    gathered (``DTensor.full_tensor()``, every rank in the same order) and copied into its
    destination before the next one is gathered: no rank ever holds more than one full tensor,
    and no full fp32 state is built. Casting is elementwise, so the values are bit-identical to
    casting the gathered fp32 state. A tensor registered under two names (a tied LM head) is
    gathered once, and both names hold the same destination."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, str] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        name = _strip(key)
        if id(value) in seen:
            if into is not None:
                into[name] = into[seen[id(value)]]
            continue
        seen[id(value)] = name
        local = value.detach()
        if local.is_floating_point():
            local = local.to(dtype)  # on the device, on this rank's shard only
        full = local.full_tensor() if isinstance(local, DTensor) else local
        if into is None:
            continue
        dest = into.get(name)
        if dest is None or dest.shape != full.shape or dest.dtype != full.dtype:
            dest = into[name] = torch.empty(full.shape, dtype=full.dtype)
        dest.copy_(full)
        del full
    return into


def full_optimizer_state(
    module: PolicyModule, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Tensor], list[dict[str, Any]]]:
    """Collective: AdamW state as ``{name::slot: tensor}`` plus hyper-parameters, on rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(
        module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    tensors: dict[str, Tensor] = {}
    for name, slots in osd.get("state", {}).items():
        for slot, value in slots.items():
            t = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"{_strip(name)}::{slot}"] = t.detach().contiguous().cpu()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in osd.get("param_groups", [])]
    return tensors, groups


def load_optimizer_state(
    module: PolicyModule,
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, Tensor],
    param_groups: list[dict[str, Any]],
) -> None:
    """Collective: a checkpoint's full optimizer state, sharded into this rank's optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not tensors:
        return
    state: dict[str, dict[str, Tensor]] = {}
    for key, value in tensors.items():
        name, _, slot = key.partition("::")
        state.setdefault(PREFIX + name, {})[slot] = value
    name_of = {id(p): n for n, p in module.named_parameters()}
    groups = []
    # Group by group (the policy's, then the EAGLE-3 head's): its parameters' names, its current
    # hyper-parameters updated with the checkpoint's.
    for i, live in enumerate(optimizer.param_groups):
        saved = param_groups[i] if i < len(param_groups) else {}
        group = {k: v for k, v in live.items() if k != "params"}
        group.update(
            {k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()}
        )
        groups.append({**group, "params": [name_of[id(p)] for p in live["params"]]})
    set_optimizer_state_dict(
        module,
        optimizer,
        optim_state_dict={"state": state, "param_groups": groups},
        options=StateDictOptions(full_state_dict=True),
    )
