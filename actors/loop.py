"""The actor loop: sync weights → generate G completions per prompt → score → send groups."""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from actors.engines.rollout_engine import Rollout, RolloutEngine
from actors.engines.torch_engine import TorchEngine
from actors.exporter import ActorExporter
from common import metric_names as mn
from common.config import SpecRLConfig
from common.curve_keys import actor_keys
from common.entrypoint import StopFlag
from common.link.protocol import Completion, DecodeLimits, TrajectoryGroup
from common.link.send.sender import GroupSender, unique_actor_id
from common.link.send.spool import Spool, orphans
from common.metrics import MetricsWriter
from common.model import CONFIG_FILE, Transformer, write_weights
from common.model_args import Layout, ModelArgs
from common.policy_meta import (
    check_rollout_support,
    hf_config_from_meta,
    layout_from_meta,
    tokenizer_from_meta,
)
from common.prompts import prompt_encoder
from common.tasks import Problem, Task, task_from_config
from common.tokenizer import Tokenizer
from common.weights.connection import retry_redis
from common.weights.fetch.feed import RedisWeightFeed, StallMeter, WeightFeed, meter_loads, take
from common.weights.fetch.reader import WeightReader
from common.weights.fetch.watcher import VersionWatcher
from common.weights.format import WeightsError

log = logging.getLogger(__name__)


class ActorStats:
    """The actor's running totals (what :func:`run` returns)."""

    def __init__(self) -> None:
        self.batches, self.groups_sent, self.completions = 0, 0, 0
        self.tokens, self.weight_loads, self.reward_sum = 0, 0, 0.0
        self.weight_fetch_s = 0.0  # the latest fetch
        self.wait_s = 0.0  # idle, waiting for a new version (synchronous mode only)


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
            fetched, state = store.fetch(version)
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
        engine = _vllm_engine(layout, manifest["meta"], state, fetched, tokenizer, cfg, seed)
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
        version=fetched,
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


def write_published(meta: dict, state: dict[str, torch.Tensor], path: Path) -> None:
    """A published version as an HF model directory (``config.json`` from the meta, the
    tensors by their HF names), in the published dtype (float32 when it mixes dtypes); a tied
    LM head is left out, as HF checkpoints do."""
    config = hf_config_from_meta(meta)
    floats = {t.dtype for t in state.values() if t.is_floating_point()}
    dtype = floats.pop() if len(floats) == 1 else torch.float32
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    tied = bool(config.get("tie_word_embeddings"))
    tensors = {
        name: t.to(dtype if t.is_floating_point() else t.dtype).contiguous()
        for name, t in state.items()
        if not (tied and name == "lm_head.weight")
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    write_weights(tensors, path)  # a draft adapter's tensors in their own file


def _vllm_engine(
    layout: Layout, meta: dict, state, version: int, tokenizer: Tokenizer, cfg: SpecRLConfig, seed
):
    """vLLM opens a model directory: the published version, written there as it is (what
    ``engine.vllm_dtype=auto`` then serves on CPU)."""
    # vLLM reads the directory while it builds; later versions arrive through load_weights.
    with tempfile.TemporaryDirectory(prefix="specrl-vllm-") as model_dir:
        write_published(meta, state, Path(model_dir))
        from actors.engines.vllm_engine import VllmEngine

        max_model_len = min(cfg.engine.vllm_max_model_len, layout.max_position_embeddings)
        return VllmEngine(
            Path(model_dir),
            tokenizer.eos_id,
            replace(cfg.engine, vllm_max_model_len=max_model_len),
            spec=cfg.spec,
            inflight=cfg.actor.inflight,
            temperature=cfg.sampling.temperature,
            top_p=cfg.sampling.top_p,
            seed=seed,
            version=version,
        )


def make_groups(
    problems: list[Problem],
    prompts: list[list[int]],
    rollouts: list[list[Rollout]],
    task: Task,
    tokenizer: Tokenizer,
) -> list[TrajectoryGroup]:
    """Score every completion and wrap each prompt's completions into one TrajectoryGroup."""
    groups = []
    for problem, prompt, completions in zip(problems, prompts, rollouts, strict=True):
        scored = []
        for r in completions:
            text_ids = r.token_ids[:-1] if r.finished else r.token_ids  # reward sees text, not EOS
            scored.append(
                Completion(
                    token_ids=r.token_ids,
                    behaviour_logprobs=r.behaviour_logprobs,
                    token_versions=r.token_versions,
                    reward=float(task.reward(problem, tokenizer.decode(text_ids.tolist()))),
                    finished=r.finished,
                )
            )
        # A group counts as its oldest token's version: that is what its staleness is about.
        versions = [int(c.token_versions.min()) for c in scored if len(c.token_ids)]
        groups.append(
            TrajectoryGroup(
                actor_id="",
                seq=0,
                prompt_id=problem.prompt_id,
                prompt_ids=np.asarray(prompt, dtype=np.int32),
                version=min(versions) if versions else 0,
                completions=scored,
            )
        )
    return groups


GROUP_STAT_KEYS = (
    mn.ACTOR_TOKENS_PER_S,
    mn.SPEC_ACCEPTANCE_RATE,
    mn.SPEC_MEAN_ACCEPTED_LEN,
    mn.SPEC_TOKENS_PER_VERIFY_FORWARD,
    mn.SPEC_DRAFT_VERSION,
)


def group_stat(key: str) -> bool:
    """A rollout figure each group carries to the learner (which averages them per step):
    acceptance (by draft position too), tokens per verify, the draft's version, verification."""
    return (
        key in GROUP_STAT_KEYS
        or key.startswith(mn.SPEC_ACCEPTANCE_POS_PREFIX)
        or key.startswith(mn.VERIFY_GROUP)
    )


class GroupSubmitter:
    """``on_group`` callback of one batch: scores a group whose completions are all done and
    submits it at once, while the engine decodes the other groups."""

    def __init__(
        self,
        phases: ActorPhases,
        problems: list[Problem],
        prompts: list[list[int]],
        sender: GroupSender,
    ) -> None:
        self.phases, self.problems, self.prompts, self.sender = phases, problems, prompts, sender
        self.stopped = False

    def __call__(self, index: int, rollouts: list[Rollout]) -> None:
        if self.stopped:
            return  # a stop came while waiting out backpressure: send nothing more
        phases = self.phases
        [group] = make_groups(
            [self.problems[index]], [self.prompts[index]], [rollouts], phases.task, phases.tokenizer
        )
        # Per-group copies of the rollout figures so far (not reset): the learner averages them
        # per step, which gives acceptance against policy version.
        group.stats = {k: v for k, v in phases.engine.stats(reset=False).items() if group_stat(k)}
        if not submit_until_stopped(self.sender, group, phases.stop):
            self.stopped = True
            return
        if phases.ledger is not None:
            phases.ledger.write(
                {"actor_id": phases.actor_id, "seq": group.seq, "event": "submitted"}
            )
        phases.stats.groups_sent += 1
        phases.stats.reward_sum += sum(c.reward for c in group.completions)
        phases.stats.completions += len(group.completions)


def submit_until_stopped(sender: GroupSender, group: TrajectoryGroup, should_stop) -> bool:
    """Hand ``group`` to the outbox, waiting out backpressure; False if a stop came first."""
    while not should_stop():
        try:
            sender.submit(group, timeout_s=1.0)
            return True
        except TimeoutError:
            continue  # the learner is behind or away: keep waiting, never drop the group
    return False


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


class GenerationStopped(Exception):
    """Raised from the engine's weight source when a stop is requested mid-generate, so the
    actor leaves a long rollout at the next decoding step instead of finishing it."""


@dataclass
class ActorPhases:
    """The phases of one actor's loop and what they share (built once by :func:`run`)."""

    cfg: SpecRLConfig
    engine: RolloutEngine
    feed: WeightFeed
    stall: StallMeter
    stats: ActorStats
    exporter: ActorExporter
    task: Task
    encode: Callable[[str], list[int]]
    rng: random.Random
    tokenizer: Tokenizer
    ledger: MetricsWriter | None
    actor_id: str
    stop: StopFlag
    reader: WeightReader | None = None
    """The run's weight reader, for its host-cache figures (``actor/host_cache_refused``)."""

    def __post_init__(self) -> None:
        # The engine takes in each version on this thread, the decode loop's: its load and the
        # delayed verification of the rows in flight block decoding, so the stall meter counts
        # them beside take() (common/weights/fetch/feed.py).
        meter_loads(self.engine, self.stall, self.feed)

    def fetch(self, timeout_s: float = 0.0) -> tuple[int, dict[str, torch.Tensor]] | None:
        """A newer weights version the feed holds ready, if any (waiting up to ``timeout_s`` for
        one): fetched and verified in the background, so this never waits for Redis."""
        update = take(self.feed, self.stall, timeout_s)
        if update is not None:
            self.stats.weight_loads += 1
            self.stats.weight_fetch_s = self.feed.stats()[mn.ACTOR_WEIGHT_FETCH_S]
            self.exporter.observe_weight_fetch(self.stats.weight_fetch_s)
        return update

    def weight_source(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """What the engine polls between decoding steps: a newer version, if any, or
        :class:`GenerationStopped` once a stop is requested (finished groups are already sent)."""
        if self.stop():
            raise GenerationStopped
        return self.fetch()

    def sync_weights(self, timeout_s: float = 0.0) -> None:
        """Phase 1: pick up the newest weights (waiting up to ``timeout_s`` for one)."""
        update = self.fetch(timeout_s)
        if update is not None:
            self.engine.load_weights(*update)  # metered (meter_loads in __post_init__)

    def generate_and_send(self, sender: GroupSender) -> int:
        """Phases 2 and 3: generate G completions for each prompt of a batch, each group scored
        and sent as soon as its G completions are done. Returns the version the batch started on."""
        cfg = self.cfg
        batch_version = self.engine.version
        problems = self.task.sample(self.rng, cfg.actor.prompts_per_batch)
        prompts = [self.encode(p.prompt) for p in problems]
        submit = GroupSubmitter(self, problems, prompts, sender)
        try:
            self.engine.generate(
                prompts,
                cfg.actor.group_size,
                self.task.max_new_tokens,
                weight_source=self.weight_source,
                on_group=submit,
            )
        except GenerationStopped:
            log.info("actor %s: stop requested; left the batch in flight", self.actor_id)
        return batch_version

    def wait_for_learner(self, batch_version: int) -> None:
        """Synchronous mode (``actor.wait_for_new_version``): idle until the learner has trained
        on the batch's version."""
        if not self.cfg.actor.wait_for_new_version:
            return
        wait_started = time.perf_counter()
        while self.engine.version <= batch_version and not self.stop():
            self.sync_weights(timeout_s=0.5)
        self.stats.wait_s += time.perf_counter() - wait_started

    def run_batches(self, sender: GroupSender, recovery: Recovery | None) -> None:
        """Batch after batch until a stop (or ``actor.max_batches``): the four phases."""
        while not self.stop():
            if recovery is not None:
                recovery.poll()
            if self.cfg.actor.max_batches and self.stats.batches >= self.cfg.actor.max_batches:
                break
            with self.stall.running(self.feed):  # the decode loop, as the stall meter sees it
                self.sync_weights()  # Phase 1
                batch_version = self.generate_and_send(sender)  # Phases 2 and 3
            engine_stats = self.engine.stats()
            self.wait_for_learner(batch_version)  # synchronous mode only
            self.report(sender, engine_stats)  # Phase 4

    def report(self, sender: GroupSender, engine_stats: dict[str, float]) -> None:
        """Phase 4: the batch's figures to the learner (heartbeat status) and to Prometheus."""
        stats = self.stats
        stats.batches += 1
        stats.tokens += int(engine_stats[mn.ACTOR_TOKENS])
        status = {
            **engine_stats,
            **sender.stats(),
            **self.feed.stats(),
            **self.stall.figures(),
            **(self.reader.stats() if self.reader is not None else {}),
            mn.ACTOR_WAIT_S: stats.wait_s,
            mn.ACTOR_REWARD_MEAN: stats.reward_sum / max(stats.completions, 1),
        }
        sender.set_status(self.engine.version, status)
        self.exporter.update(
            {**status, mn.ACTOR_BATCHES: stats.batches, mn.ACTOR_GROUPS_SENT: stats.groups_sent},
            version=self.engine.version,
        )


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


def run(cfg: SpecRLConfig) -> ActorStats:
    torch.set_num_threads(cfg.run.torch_threads)
    if cfg.actor.nice:
        os.nice(cfg.actor.nice)  # on a machine shared with the learner, its steps come first
    seed = actor_seed(cfg)
    stop = StopFlag("actor")
    store = WeightReader.from_config(cfg.redis, cfg.run.name)
    watcher = VersionWatcher.of_store(store, poll_interval_s=cfg.redis.poll_interval_s)
    stats = ActorStats()
    built = first_engine(cfg, store, watcher, seed, stop)
    if built is None:
        return stats
    engine, tokenizer, model_args = built
    task = task_from_config(cfg.task)
    # Prompt text -> ids, once, here: the ids travel in the group, so the learner trains on exactly
    # the tokens generated from (chat template and system prompt included).
    encode = prompt_encoder(
        tokenizer,
        cfg.task.chat_template,
        cfg.task.system_prompt,
        dataset=cfg.task.natural_language,
    )
    rng = random.Random(seed)
    name = cfg.actor.actor_id or f"{socket.gethostname()}-{cfg.actor.index}"
    actor_id = unique_actor_id(name)
    exporter = ActorExporter.start(cfg, cfg.run.resolved_dir(), actor_id)

    # The model's vocabulary (it may be padded past the tokenizer's), as the learner validates.
    limits = DecodeLimits(vocab_size=model_args.vocab_size)
    log.info("actor %s: version %d, learner %s", actor_id, engine.version, cfg.learner.address)
    ledger = (
        MetricsWriter(cfg.run.resolved_dir() / "ledger" / f"actor-{actor_id}.jsonl")
        if cfg.run.ledger
        else None
    )

    spool = Spool(spool_root(cfg) / name / actor_id) if cfg.actor.spool else None
    recovery = Recovery(cfg, name, actor_id, limits) if cfg.actor.spool else None

    # From here on a thread fetches new versions while the engine decodes (common/weights/fetch/feed.py).
    feed: WeightFeed
    if cfg.actor.weights_group:  # the learner's weights group, with Redis where it cannot serve
        from common.weights.fetch.collective_feed import CollectiveFeed

        feed = CollectiveFeed.from_config(cfg, store, engine.version)
    else:
        feed = RedisWeightFeed(store, watcher, engine.version)
    phases = ActorPhases(  # the fields in their order
        cfg,
        engine,
        feed,
        StallMeter(),
        stats,
        exporter,
        task,
        encode,
        rng,
        tokenizer,
        ledger,
        actor_id,
        stop,
        store,
    )
    try:
        with group_sender(cfg, actor_id, limits, spool, cfg.actor.outbox_max) as sender:
            phases.run_batches(sender, recovery)
            sender.close(timeout_s=5.0)  # waits for the last acks once (leaving the block won't)
            unacked = sender.unacked_seqs()
            if ledger is not None:
                # With a spool these are not lost: the next incarnation of this actor resends them.
                ledger.write({"actor_id": actor_id, "event": "exit", "unacked": unacked})
                ledger.close()
    finally:
        feed.close()  # joins its thread
    if recovery is not None:
        recovery.close()
    if spool is not None:
        spool.release(delete=not unacked)
    watcher.close()
    exporter.close()
    log.info(
        "actor %s: stopped after %d batches, %d groups", actor_id, stats.batches, stats.groups_sent
    )
    return stats
