"""An actor's Prometheus ``/metrics`` (``specrl_actor_*{actor_id=...}``), served on
``actor.metrics_port + actor.index`` by :class:`common.prometheus.MetricsServer`: the sender's
cumulative totals, the engine's per-batch amounts (summed here), the latest gauges, and a
histogram of weight fetch times.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prometheus_client import Histogram

from common import metric_names as mn
from common.config import SpecRLConfig
from common.prometheus import (
    SECONDS_BUCKETS,
    MetricsServer,
    SnapshotCollector,
    is_number,
    metric_suffix,
)

# Status key -> (name, help) of each actor metric: a counter (a total the sender or the loop
# holds) unless the key is one of _ACTOR_GAUGES (a latest value) or _ACTOR_SUMS (a per-batch
# amount the engine resets at each stats() call, summed into a counter here).
_ACTOR_METRICS = {
    mn.ACTOR_BATCHES: ("batches", "Rollout batches generated."),
    mn.ACTOR_GROUPS_SENT: ("groups_sent", "Trajectory groups submitted to the learner."),
    mn.SENDER_ACKED_TOTAL: ("groups_acked", "Groups acked by the learner."),
    mn.SENDER_REFUSED_TOTAL: ("groups_refused", "Groups the learner refused (never trained)."),
    mn.SENDER_RESENT_TOTAL: ("groups_resent", "Groups sent again after a timeout or reconnect."),
    mn.SENDER_RECONNECTS: ("reconnects", "Reconnections to the learner."),
    mn.SENDER_BAD_REPLIES: ("bad_replies", "Undecodable replies from the learner."),
    mn.SENDER_SUBMIT_BLOCKED_S: (
        "submit_blocked_seconds",
        "Time finished groups waited for outbox space (backpressure from the learner).",
    ),
    mn.ACTOR_WAIT_S: ("wait_seconds", "Idle time waiting for a new version (synchronous mode)."),
    mn.ACTOR_TOKENS_PER_S: ("tokens_per_s", "Generated tokens/s of the last batch."),
    mn.ACTOR_REWARD_MEAN: ("reward_mean", "Mean reward of every completion generated so far."),
    mn.ACTOR_REWARD_FAILURES: (
        "reward_failures",
        "Calls of task.reward that gave no reward (raised, timed out, NaN, unusable, crashed).",
    ),
    mn.ACTOR_REWARD_GROUPS_DROPPED: (
        "reward_groups_dropped",
        "Groups not sent because a reward call failed (task.reward_on_failure=drop_group).",
    ),
    mn.SENDER_UNACKED: ("outbox_depth", "Groups in the outbox, not yet acked."),
    mn.SENDER_UNSENT: ("outbox_unsent", "Outbox groups waiting to be sent."),
    mn.ACTOR_TOKENS: ("tokens", "Tokens generated."),
    mn.ACTOR_GEN_TIME_S: ("generation_seconds", "Time spent generating."),
    mn.VERIFY_SWAPS: ("verify_swaps", "Weight swaps applied to rollouts in flight."),
    mn.VERIFY_INFLIGHT_TOKENS: ("verify_inflight_tokens", "Tokens in flight at weight swaps."),
    mn.VERIFY_SALVAGED_TOKENS: ("verify_salvaged_tokens", "In-flight tokens kept by verification."),
    mn.VERIFY_WASTED_TOKENS: ("verify_wasted_tokens", "In-flight tokens discarded."),
    mn.VERIFY_FORWARD_TOKENS: ("verify_forward_tokens", "Tokens re-run by delayed verification."),
    mn.ACTOR_PROMPTS_TOO_LONG: (
        "prompts_too_long",
        "Prompts the engine refused as longer than it serves (vLLM: engine.vllm_max_model_len "
        "minus one new token); the rest of their batch was served.",
    ),
    mn.ACTOR_DECODE_STALL_S: (
        "decode_stall_seconds",
        "Decode-loop time blocked on weights while a version was being delivered: taking it, "
        "the engine's load and the verification of rollouts in flight.",
    ),
    mn.ACTOR_DECODE_S_DURING_DELIVERY: (
        "decode_seconds_during_delivery",
        "Decode-loop time while a version was being delivered.",
    ),
    mn.ACTOR_DECODE_STALL_FRAC: (
        "decode_stall_frac",
        "Share of the decode loop's time during deliveries spent blocked on weights (taking, "
        "loading, verifying rollouts in flight).",
    ),
    mn.ACTOR_WEIGHT_LOAD_S: (
        "weight_load_seconds",
        "Seconds the engine spent loading versions (mid-rollout swaps included).",
    ),
    mn.ACTOR_HOST_CACHE_REFUSED: (
        "host_cache_refused",
        "Host-cache copies refused (not this user's alone, a symlink, or bytes that do not hash "
        "to the manifest); Redis served those fetches.",
    ),
    mn.ACTOR_REDIS_CHUNK_BYTES: (
        "redis_chunk_bytes",
        "Bytes of weight chunks read from Redis (0 for an actor the node-local plane serves).",
    ),
    mn.ACTOR_WEIGHT_REDIS_FALLBACKS: (
        "weight_redis_fallbacks",
        "Versions read from Redis chunks although this actor has a host cache (its node's copy "
        "was absent, refused or not written).",
    ),
    mn.ACTOR_WEIGHT_FETCH_FAILURES: (
        "weight_fetch_failures",
        "Versions refused or not read (the weights in use were kept).",
    ),
    mn.ACTOR_WEIGHT_SUPERSEDED: (
        "weight_versions_superseded",
        "Fetched versions a newer one replaced before the engine took them.",
    ),
    mn.ACTOR_WEIGHT_VERSIONS_COLLECTIVE: (
        "weight_versions_collective",
        "Versions received through the learner's weights group (actor.weights_group).",
    ),
    mn.ACTOR_WEIGHT_VERSIONS_REDIS: (
        "weight_versions_redis",
        "Versions fetched from Redis by an actor of the weights group (before joining, or "
        "while the group could not serve).",
    ),
    mn.ACTOR_WEIGHT_GROUP_FALLBACKS: (
        "weight_group_fallbacks",
        "Versions a member of the weights group fetched from Redis because the group had not "
        "brought them within actor.weights_group_fallback_s.",
    ),
}
_ACTOR_GAUGES = frozenset(
    {
        mn.ACTOR_TOKENS_PER_S,
        mn.ACTOR_REWARD_MEAN,
        mn.SENDER_UNACKED,
        mn.SENDER_UNSENT,
        mn.ACTOR_DECODE_STALL_FRAC,
    }
)
_ACTOR_SUMS = frozenset(
    [
        mn.ACTOR_TOKENS,
        mn.ACTOR_GEN_TIME_S,
        mn.VERIFY_SWAPS,
        mn.VERIFY_INFLIGHT_TOKENS,
        mn.VERIFY_SALVAGED_TOKENS,
        mn.VERIFY_WASTED_TOKENS,
        mn.VERIFY_FORWARD_TOKENS,
        mn.ACTOR_PROMPTS_TOO_LONG,
    ]
)
_ACTOR_TOTALS = {key: entry for key, entry in _ACTOR_METRICS.items() if key not in _ACTOR_SUMS}


class ActorExporter(MetricsServer):
    """``specrl_actor_*{actor_id=...}``: fed the status dict the actor sends with heartbeats."""

    def __init__(self, port: int, host: str, run_dir: Path, actor_id: str, index: int = 0) -> None:
        super().__init__(f"actor-{index}", port, host, run_dir)
        self.actor_id = actor_id
        self._snapshot = SnapshotCollector("specrl_actor", {"actor_id": actor_id})
        self.registry.register(self._snapshot)
        self._fetch = Histogram(
            "specrl_actor_weight_fetch_seconds",
            "Time to fetch and check one weights version from Redis.",
            labelnames=["actor_id"],
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        ).labels(actor_id)
        self._sums: dict[str, float] = dict.fromkeys(sorted(_ACTOR_SUMS), 0.0)

    @classmethod
    def start(cls, cfg: SpecRLConfig, run_dir: Path, actor_id: str) -> ActorExporter:
        """Serve on ``actor.metrics_port + actor.index`` (no-op object when off)."""
        port = cfg.actor.metrics_port
        if port > 0:
            port += cfg.actor.index
        return cls(port, cfg.security.metrics_host, run_dir, actor_id, cfg.actor.index)

    def observe_weight_fetch(self, seconds: float) -> None:
        if self.enabled:
            self._fetch.observe(seconds)

    def update(self, status: Mapping[str, Any], version: int | None = None) -> None:
        """One batch: ``status`` holds engine.stats() (per batch) and sender.stats() (totals)."""
        if not self.enabled:
            return
        snap = self._snapshot
        if version is not None:
            snap.set("gauge", "version", "Policy version the engine holds.", version)
        snap.set_known(_ACTOR_TOTALS, status, _ACTOR_GAUGES)
        for key in self._sums:
            name, doc = _ACTOR_METRICS[key]
            if is_number(status.get(key)):
                self._sums[key] += float(status[key])
            snap.set("counter", name, doc, self._sums[key])
        for key, value in status.items():
            if is_number(value) and key.startswith(mn.ROLLOUT_GROUPS) and key not in _ACTOR_SUMS:
                snap.set("gauge", metric_suffix(key), f"{key} of the last batch.", value)
