"""The ``nccl`` plane of the specrl weight-transfer backend, for GPUs: written, never run.

No GPU run has exercised this module, so it is refused (:func:`refuse_unproven`) both where an
actor would join a sender (:meth:`NcclPlane.join`, and ``VllmEngine(weight_transfer="nccl")`` at
start) and where a sender would be built (:class:`NcclSender`), unless
``SPECRL_UNPROVEN_NCCL=1`` is set for the GPU run meant to prove it.

- Actor side, :class:`NcclPlane`: per transfer a trainer<->worker communicator from vLLM's own
  ``worker_init_process_group`` (PyNccl over a ``StatelessProcessGroup``; the sender is rank 0,
  the worker rank 1), receiving with vLLM's ``packed_nccl_broadcast_consumer`` into the model's
  ``load_weights``. ``update_weights`` still carries metadata only.
- Sender side, :class:`NcclSender`: each transfer runs in a process of its own that opens the
  trainer endpoint (``nccl_common.trainer_init``) and broadcasts one safetensors file with
  ``packed_nccl_broadcast_producer``; the caller waits at most ``deadline_s`` and then kills
  that process, so an actor that died or never joins cannot hang the caller (PyNccl has no
  watchdog) and the caller never holds an NCCL communicator. The deadline and the kill are the
  part tested on CPU (:func:`run_with_deadline`).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from typing import Any

import torch

UNPROVEN_ENV = "SPECRL_UNPROVEN_NCCL"
NCCL_UNPROVEN = (
    "the specrl weight-transfer backend's nccl plane has never run on a GPU, so specrl refuses "
    "it: use weight_transfer=specrl (in-process) or reload. To run it on GPUs in order to prove "
    f"it, set {UNPROVEN_ENV}=1"
)


class SendTimeout(TimeoutError):
    """A transfer did not finish within its deadline; its sender process was killed."""


def refuse_unproven() -> None:
    if os.environ.get(UNPROVEN_ENV) != "1":
        raise RuntimeError(NCCL_UNPROVEN)


class NcclPlane:
    """The worker's end of a sender's broadcasts: a communicator per transfer, as the sender
    opens one per transfer (see the module docstring)."""

    def __init__(self, info, parallel_config, device) -> None:
        self.info, self.parallel_config, self.device = info, parallel_config, device

    @classmethod
    def join(cls, fields: dict[str, Any], parallel_config, device) -> NcclPlane:
        """``fields``: ``master_address``, ``master_port`` and optionally the packed buffers'
        ``packed_buffer_size_bytes`` / ``packed_num_buffers`` (the sender's, which must agree)."""
        refuse_unproven()
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

        packing = ("packed_buffer_size_bytes", "packed_num_buffers")
        info = NCCLWeightTransferInitInfo(
            master_address=fields["master_address"],
            master_port=int(fields["master_port"]),
            rank_offset=1,
            world_size=2,
            packed=True,
            **{k: int(fields[k]) for k in packing if k in fields},
        )
        return cls(info, parallel_config, device)

    def receive(self, update_info, load: Callable) -> set[str]:
        """Receive ``update_info``'s tensors into ``load`` (the model's ``load_weights``); the
        names it reports loaded."""
        from vllm.distributed.weight_transfer.nccl_common import worker_init_process_group
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_consumer

        loaded: set[str] = set()
        meta = (
            (name, (list(shape), getattr(torch, dtype)))
            for name, dtype, shape in zip(
                update_info.names, update_info.dtype_names, update_info.shapes, strict=True
            )
        )
        group = worker_init_process_group(self.info, self.parallel_config)
        try:
            packed_nccl_broadcast_consumer(
                iterator=meta,
                group=group,
                src=0,
                post_unpack_func=lambda weights: loaded.update(load(weights) or ()),
                buffer_size_bytes=self.info.packed_buffer_size_bytes,
                num_buffers=self.info.packed_num_buffers,
                device=self.device,
            )
        finally:
            group.destroy()
        return loaded

    def close(self) -> None:
        """Nothing is held between transfers."""


def run_with_deadline(target: Callable, args: tuple, deadline_s: float) -> None:
    """Run ``target(*args)`` in a spawned process; kill it at ``deadline_s``
    (:class:`SendTimeout`), raise RuntimeError when it fails."""
    process = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    process.start()
    process.join(deadline_s)
    if process.is_alive():
        process.kill()
        process.join()
        raise SendTimeout(f"weight transfer still running after {deadline_s:.1f} s: killed")
    if process.exitcode != 0:
        raise RuntimeError(f"weight transfer process exited with {process.exitcode}")


def _broadcast_file(rendezvous: dict, path: str, names: list[str], packing: tuple, gpu: int):
    """Runs in the sender process: rank 0 of a fresh communicator, one file's tensors out."""
    from safetensors import safe_open
    from vllm.distributed.weight_transfer.nccl_common import trainer_init
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

    torch.cuda.set_device(gpu)
    group = trainer_init(rendezvous)
    with safe_open(path, framework="pt") as f:
        packed_nccl_broadcast_producer(
            iterator=((name, f.get_tensor(name)) for name in names),
            group=group,
            src=0,
            post_iter_func=lambda item: item[1].to("cuda", non_blocking=True),
            buffer_size_bytes=packing[0],
            num_buffers=packing[1],
        )
    torch.cuda.synchronize()
    group.destroy()


class NcclSender:
    """Sends versions to one actor, each from a safetensors file, by a process per transfer with
    a deadline (see the module docstring). The actor must be inside ``update_weights`` with the
    same names in the same order while :meth:`send` runs."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        gpu: int = 0,
        packed_buffer_size_bytes: int = 1 << 30,
        packed_num_buffers: int = 2,
    ) -> None:
        refuse_unproven()
        self.rendezvous = {
            "master_address": master_address,
            "master_port": master_port,
            "world_size": 2,
        }
        self.gpu, self.packing = gpu, (packed_buffer_size_bytes, packed_num_buffers)

    def init_info(self) -> dict[str, Any]:
        """The actor's ``init_weight_transfer_engine`` ``init_info`` for this sender."""
        fields = {k: self.rendezvous[k] for k in ("master_address", "master_port")}
        fields["packed_buffer_size_bytes"], fields["packed_num_buffers"] = self.packing
        return {"plane": "nccl", "nccl": fields}

    def send(self, path: str, names: list[str], deadline_s: float) -> None:
        run_with_deadline(
            _broadcast_file, (self.rendezvous, path, names, self.packing, self.gpu), deadline_s
        )
