"""The actor's parts built from the config (what :func:`actors.loop.run` then drives): its engine
on the first published version, the weight feed, the sender to the learner with its spool and the
recovery of dead incarnations' spools, the task and its prompt encoding, the exporter and ledger."""

from __future__ import annotations

import json
import logging
import random
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from actors.engines.rollout_engine import RolloutEngine
from actors.engines.torch.engine import TorchEngine
from actors.exporter import ActorExporter
from common.config import SpecRLConfig
from common.curve_keys import actor_keys
from common.entrypoint import StopFlag
from common.link.protocol import DecodeLimits
from common.link.send.sender import GroupSender, unique_actor_id
from common.link.send.spool import Spool, orphans
from common.metrics import MetricsWriter
from common.model import CONFIG_FILE, Transformer, write_weights
from common.model_args import TIED_HEAD, Layout, ModelArgs, config_ties_head, with_tied_head
from common.policy_meta import (
    check_rollout_support,
    hf_config_from_meta,
    layout_from_meta,
    tokenizer_from_meta,
)
from common.prompts import prompt_encoder
from common.tasks import Task, task_from_config
from common.tokenizer import Tokenizer
from common.weights.connection import retry_redis
from common.weights.fetch.feed import RedisWeightFeed, WeightFeed
from common.weights.fetch.reader import WeightReader
from common.weights.fetch.watcher import VersionWatcher
from common.weights.format import WeightsError

log = logging.getLogger(__name__)


def build_engine(
    store: WeightReader, version: int, cfg: SpecRLConfig, seed: int
) -> tuple[RolloutEngine, Tokenizer, Layout]:
    """The policy from a published version alone: architecture and tokenizer come from its meta,
    the weights are the published tensors (no randomly initialised model on the way)."""
    for attempt in range(3):
        manifest = store.manifest(version)
        try:
            if manifest is None:
                raise WeightsError(f"version {version} has no manifest (expired?)")
            version, state = store.fetch(version)
            break
        except WeightsError as e:
            # A learner that publishes fast can retire a version between notice and fetch.
            latest = store.latest_version()
            if attempt == 2 or latest is None:
                raise
            log.warning("actor: version %d unavailable (%s); trying latest %d", version, e, latest)
            version = latest
    layout = layout_from_meta(manifest["meta"])
    check_rollout_support(layout, cfg.engine.name, cfg.spec.method, cfg.spec.adapter)
    tokenizer = tokenizer_from_meta(manifest["meta"], cfg.model.path)
    if cfg.engine.name == "vllm":
        engine = _vllm_engine(layout, manifest["meta"], state, version, tokenizer, cfg, seed)
        return engine, tokenizer, layout
    assert isinstance(layout, ModelArgs)  # check_rollout_support refuses the rest on torch
    model = policy_from_state(
        layout, state, torch.device(cfg.actor.device), rollout_dtype(cfg, manifest)
    )
    engine = TorchEngine(
        model,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        seed=seed,
        version=version,
        spec=cfg.spec,
        inflight=cfg.actor.inflight,
        max_rows=cfg.engine.max_rows or None,
    )
    return engine, tokenizer, layout


def policy_from_state(
    args: ModelArgs, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> Transformer:
    """The built-in model holding a published state dict: built on the meta device, then given
    the tensors themselves (copied only to change their dtype or device)."""
    tensors = {
        name: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
        for name, t in state.items()
    }
    tensors = with_tied_head(tensors, args)  # a version leaves a tied LM head out
    with torch.device("meta"):
        model = Transformer(args)
    model.load_state_dict(tensors, strict=True, assign=True)
    model.tie_weights()
    return model.eval()


def rollout_dtype(cfg: SpecRLConfig, manifest: dict) -> torch.dtype:
    """The torch engine's model dtype: ``engine.torch_dtype``, or under ``auto`` the published
    weights' (float32 when they mix dtypes)."""
    name = cfg.engine.torch_dtype
    if name == "auto":
        name = manifest.get("dtype", "float32")
    return getattr(torch, name) if name in ("float32", "bfloat16", "float16") else torch.float32


def write_published(
    meta: dict, state: dict[str, torch.Tensor], path: Path, weights: bool = True
) -> None:
    """A published version as an HF model directory (``config.json`` from the meta, the
    tensors by their HF names), in the published dtype (float32 when it mixes dtypes); a tied
    LM head is left out, as HF checkpoints do. ``weights=False``: ``config.json`` only."""
    config = hf_config_from_meta(meta)
    floats = {t.dtype for t in state.values() if t.is_floating_point()}
    dtype = floats.pop() if len(floats) == 1 else torch.float32
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    if not weights:
        return
    tied = config_ties_head(config)
    tensors = {
        name: t.to(dtype if t.is_floating_point() else t.dtype).contiguous()
        for name, t in state.items()
        if not (tied and name == TIED_HEAD)
    }
    write_weights(tensors, path)  # a draft adapter's tensors in their own file


def _vllm_engine(
    layout: Layout, meta: dict, state, version: int, tokenizer: Tokenizer, cfg: SpecRLConfig, seed
):
    """vLLM opens a model directory. With ``engine.vllm_weight_transfer`` resolved to
    ``specrl``: ``config.json`` alone (in the run directory), the engine starting on dummy
    weights and taking the version through vLLM's weight-transfer lifecycle; with ``reload``:
    the published version written into a temporary directory as it is (what
    ``engine.vllm_dtype=auto`` then serves on CPU), read while the engine builds."""
    from actors.engines.vllm.engine import VllmEngine
    from actors.engines.vllm.setup import resolve_transfer

    transfer = resolve_transfer(cfg.engine.vllm_weight_transfer, cfg.engine, cfg.spec)
    max_model_len = min(cfg.engine.vllm_max_model_len, layout.max_position_embeddings)
    options = dict(
        spec=cfg.spec,
        inflight=cfg.actor.inflight,
        temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p,
        seed=seed,
        version=version,
    )
    engine_cfg = replace(cfg.engine, vllm_max_model_len=max_model_len)
    if transfer == "specrl":
        config_dir = cfg.run.resolved_dir() / "vllm" / f"actor-{cfg.actor.index}"
        write_published(meta, state, config_dir, weights=False)
        log.info(
            "actor: vLLM starts on dummy weights (%s); versions through its lifecycle", config_dir
        )
        return VllmEngine(
            config_dir,
            tokenizer.eos_id,
            engine_cfg,
            weight_transfer="specrl",
            start_weights=state,
            **options,
        )
    with tempfile.TemporaryDirectory(prefix="specrl-vllm-") as model_dir:
        write_published(meta, state, Path(model_dir))
        return VllmEngine(Path(model_dir), tokenizer.eos_id, engine_cfg, **options)


class Recovery:
    """Sends what dead incarnations of this actor left in their spools, under their own
    actor_ids and seqs, beside the live sender; each finished spool is deleted."""

    def __init__(self, cfg: SpecRLConfig, name: str, actor_id: str, limits: DecodeLimits) -> None:
        self.senders: list[tuple[GroupSender, Spool]] = []
        for old_id, spool in orphans(spool_root(cfg), name, exclude=actor_id):
            frames = spool.frames()
            sender = group_sender(cfg, old_id, limits, spool, max(len(frames), 1))
            sender.preload(frames)
            sender.start()
            self.senders.append((sender, spool))
            log.info(
                "actor: resending %d unacked group(s) of dead incarnation %s", len(frames), old_id
            )

    def poll(self) -> None:
        """Close the senders whose groups are all acked."""
        for sender, spool in list(self.senders):
            if sender.unacked() == 0:
                sender.close(timeout_s=0.0)
                spool.release(delete=True)
                self.senders.remove((sender, spool))

    def close(self) -> None:
        """At exit: whatever is still unacked stays spooled for the next incarnation."""
        for sender, spool in self.senders:
            sender.close(timeout_s=2.0)
            spool.release(delete=sender.unacked() == 0)
        self.senders = []


def group_sender(
    cfg: SpecRLConfig, actor_id: str, limits: DecodeLimits, spool: Spool | None, outbox_max: int
) -> GroupSender:
    """A sender of ``actor_id``'s groups to the learner, holding at most ``outbox_max``."""
    return GroupSender(
        cfg.learner.address,
        actor_id,
        outbox_max=outbox_max,
        resend_timeout_s=cfg.actor.resend_timeout_s,
        heartbeat_interval_s=cfg.actor.heartbeat_interval_s,
        limits=limits,
        curve=(
            actor_keys(Path(cfg.security.curve_dir), cfg.security.actor_key)
            if cfg.security.curve_dir
            else None
        ),
        spool=spool,
    )


def spool_root(cfg: SpecRLConfig) -> Path:
    return cfg.run.resolved_dir() / "spool"


def actor_seed(cfg: SpecRLConfig) -> int:
    """The seed of this actor's prompts and sampling (``actor.seed``, or one per index)."""
    return cfg.actor.seed if cfg.actor.seed >= 0 else cfg.run.seed * 1_000 + cfg.actor.index


def first_engine(
    cfg: SpecRLConfig, store: WeightReader, watcher: VersionWatcher, seed: int, stop: StopFlag
) -> tuple[RolloutEngine, Tokenizer, Layout] | None:
    """The engine on the first published version; None when none is published in time or a
    stop comes first."""
    first = None
    deadline = time.monotonic() + cfg.actor.wait_version_timeout_s
    while first is None and time.monotonic() < deadline and not stop():
        first = watcher.poll(timeout_s=1.0)
    if first is None:
        log.error(
            "actor: no weights version published within %.0fs", cfg.actor.wait_version_timeout_s
        )
        return None
    if stop():
        return None
    return retry_redis(
        "actor",
        "loading the first version",
        lambda: build_engine(store, first, cfg, seed),
        stop,
    )


@dataclass
class ActorParts:
    """What one actor runs with, built by :func:`wire`."""

    store: WeightReader
    watcher: VersionWatcher
    engine: RolloutEngine
    tokenizer: Tokenizer
    task: Task
    encode: Callable[[str], list[int]]
    """Prompt text -> ids, once, on the actor: the ids travel in the group, so the learner trains
    on exactly the tokens generated from (chat template and system prompt included)."""
    rng: random.Random
    actor_id: str
    exporter: ActorExporter
    limits: DecodeLimits
    """The model's vocabulary (it may be padded past the tokenizer's), as the learner validates."""
    ledger: MetricsWriter | None
    spool: Spool | None
    recovery: Recovery | None
    feed: WeightFeed
    """Fetches new versions on a thread while the engine decodes (common/weights/fetch/feed.py)."""

    def close_ledger(self, unacked: list[int]) -> None:
        if self.ledger is not None:
            # With a spool these are not lost: the next incarnation of this actor resends them.
            self.ledger.write({"actor_id": self.actor_id, "event": "exit", "unacked": unacked})
            self.ledger.close()

    def close(self, delete_spool: bool) -> None:
        """After the sender and the feed: the recovery senders, the spool (deleted when nothing
        is left unacked), the watcher and the exporter."""
        if self.recovery is not None:
            self.recovery.close()
        if self.spool is not None:
            self.spool.release(delete=delete_spool)
        self.watcher.close()
        self.exporter.close()


def wire(cfg: SpecRLConfig, stop: StopFlag) -> ActorParts | None:
    """The actor's parts, its engine on the first published version; None when none is
    published in time or a stop comes first."""
    seed = actor_seed(cfg)
    store = WeightReader.from_config(cfg.redis, cfg.run.name)
    watcher = VersionWatcher.of_store(store, poll_interval_s=cfg.redis.poll_interval_s)
    built = first_engine(cfg, store, watcher, seed, stop)
    if built is None:
        return None
    engine, tokenizer, model_args = built
    encode = prompt_encoder(
        tokenizer, cfg.task.chat_template, cfg.task.system_prompt, dataset=cfg.task.natural_language
    )
    name = cfg.actor.actor_id or f"{socket.gethostname()}-{cfg.actor.index}"
    actor_id = unique_actor_id(name)
    limits = DecodeLimits(vocab_size=model_args.vocab_size)
    log.info("actor %s: version %d, learner %s", actor_id, engine.version, cfg.learner.address)
    run_dir = cfg.run.resolved_dir()
    ledger = (
        MetricsWriter(run_dir / "ledger" / f"actor-{actor_id}.jsonl") if cfg.run.ledger else None
    )
    feed: WeightFeed
    if cfg.actor.weights_group:  # the learner's weights group, with Redis where it cannot serve
        from common.weights.fetch.collective_feed import CollectiveFeed

        feed = CollectiveFeed.from_config(cfg, store, engine.version)
    else:
        feed = RedisWeightFeed(store, watcher, engine.version)
    return ActorParts(
        store=store,
        watcher=watcher,
        engine=engine,
        tokenizer=tokenizer,
        task=task_from_config(cfg.task),
        encode=encode,
        rng=random.Random(seed),
        actor_id=actor_id,
        exporter=ActorExporter.start(cfg, run_dir, actor_id),
        limits=limits,
        ledger=ledger,
        spool=Spool(spool_root(cfg) / name / actor_id) if cfg.actor.spool else None,
        recovery=Recovery(cfg, name, actor_id, limits) if cfg.actor.spool else None,
        feed=feed,
    )
