"""The learner's Prometheus ``/metrics`` (``specrl_learner_*``), served on ``learner.metrics_port``.

Counters the learner holds as cumulative totals (receiver, buffer) are exported from the latest
snapshot; staleness and weight publish times are histograms. The registry, server and port file
are :class:`common.prometheus.MetricsServer`'s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
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


def _draft_training_figure(key: str) -> bool:
    """The draft's figures of a step: its acceptance (per draft step too) measured on the batch
    before the update, the chain estimate, the head's loss and learning rate."""
    return key.startswith(mn.SPEC_DRAFT_ACCEPTANCE) or key in (
        mn.SPEC_DRAFT_CHAIN_ESTIMATE,
        mn.SPEC_EAGLE_KL,
        mn.SPEC_EAGLE_LR,
    )


STALENESS_BUCKETS = tuple(float(s) for s in range(9))  # 0..8 versions behind, then +Inf

# Metrics key -> (name, help): a counter (a cumulative total the receiver or the loop holds)
# unless the key is one of _LEARNER_GAUGES (a latest value).
_LEARNER_METRICS = {
    mn.RECEIVER_RECEIVED: ("groups_received", "Trajectory groups received and accepted."),
    mn.LEARNER_DROPPED_STALE: ("groups_dropped_stale", "Groups dropped beyond max_staleness."),
    mn.LEARNER_MAX_STALENESS: (
        "max_staleness",
        "The staleness bound in force (learner.max_staleness, or the measured weight-delivery "
        "lag + 1 up to learner.max_staleness_from_lag).",
    ),
    mn.LEARNER_WEIGHT_DELIVERY_LAG: (
        "weight_delivery_lag",
        "Versions published that the slowest live actor did not hold at its last batch (the most "
        "over the last 8 steps).",
    ),
    mn.RECEIVER_DUPLICATES: ("groups_duplicated", "Resent groups dropped by (actor_id, seq)."),
    mn.LEARNER_REJECTED_GROUPS: ("groups_rejected", "Groups refused by the shape check."),
    mn.LEARNER_GROUPS_SKIPPED_NO_SIGNAL: (
        "groups_skipped_no_signal",
        "Groups skipped by dynamic sampling: all their rewards equal (no signal).",
    ),
    mn.LEARNER_SKIPPED_STEPS: (
        "skipped_steps",
        "Optimizer steps skipped because the loss or the gradients were not finite.",
    ),
    mn.LEARNER_WAL_SKIPPED: (
        "wal_skipped",
        "Groups replayed from the write-ahead log or a checkpoint that this learner refused.",
    ),
    mn.RECEIVER_UNAUTHENTICATED: (
        "unauthenticated_refused",
        "Connections refused by CurveZMQ authentication.",
    ),
    mn.RECEIVER_DISCONNECTS: (
        "connections_closed",
        "Trajectory connections ended: the peer closed or lost it, or the learner's socket closed "
        "it (a frame over learner.max_frame_bytes, never read; a refused handshake).",
    ),
    mn.RECEIVER_HANDOVER_DROPPED: (
        "frames_handover_dropped",
        "Frames left on a connection that the actor's reconnect took over (it resends them).",
    ),
    mn.LEARNER_VERSION: ("version", "Newest published policy version."),
    mn.LEARNER_STEP: ("step", "Optimizer steps taken."),
    mn.LEARNER_REWARD_MEAN: ("reward_mean", "Mean reward of the last step's batch."),
    mn.ACTOR_TOKENS_PER_S: ("actor_tokens_per_s", "Generated tokens/s, sum over live actors."),
    mn.ACTOR_LIVE: ("live_actors", "Actors heard from recently."),
    mn.RECEIVER_QUEUE_SIZE: ("queue_depth", "Groups received, not yet trained on."),
    # learner.weights_group: the sender's figures (common/weights/publish/collective_sender.py).
    mn.LEARNER_WEIGHTS_GROUP_MEMBERS: ("weights_group_members", "Actors in the weights group."),
    mn.LEARNER_WEIGHTS_GROUP_EPOCH: ("weights_group_epoch", "Current epoch of the weights group."),
    mn.LEARNER_WEIGHTS_GROUP_VERSIONS_SENT: (
        "weights_group_versions_sent",
        "Versions broadcast to the weights group.",
    ),
    mn.LEARNER_WEIGHTS_GROUP_SENT_VERSION: (
        "weights_group_sent_version",
        "Newest version broadcast to the weights group (-1: none).",
    ),
    mn.LEARNER_WEIGHTS_GROUP_SKIPPED: (
        "weights_group_skipped",
        "Versions a newer one replaced before their broadcast started.",
    ),
    mn.LEARNER_WEIGHTS_GROUP_REFUSED: (
        "weights_group_refused",
        "Versions the sender refused (a non-finite float).",
    ),
    mn.LEARNER_WEIGHTS_GROUP_LOSSES: ("weights_group_losses", "Epochs of the weights group lost."),
    mn.LEARNER_WEIGHTS_GROUP_SEND_S: (
        "weights_group_send_seconds",
        "Seconds the last broadcast took.",
    ),
    mn.LEARNER_WEIGHTS_GROUP_JOINS_REFUSED: (
        "weights_group_joins_refused",
        "Joins refused for a missing or wrong proof of the run's secret.",
    ),
    mn.LEARNER_WEIGHTS_GROUP_ERRORS: (
        "weights_group_errors",
        "Sender errors (a version it failed to send; members fetch it from Redis).",
    ),
    mn.LEARNER_WEIGHTS_GROUP_ERROR_VERSION: (
        "weights_group_error_version",
        "The version being sent at the sender's last error (-1: none).",
    ),
}
_LEARNER_GAUGES = frozenset(
    [
        mn.LEARNER_VERSION,
        mn.LEARNER_STEP,
        mn.LEARNER_REWARD_MEAN,
        mn.LEARNER_MAX_STALENESS,
        mn.LEARNER_WEIGHT_DELIVERY_LAG,
        mn.ACTOR_TOKENS_PER_S,
        mn.ACTOR_LIVE,
        mn.RECEIVER_QUEUE_SIZE,
        mn.LEARNER_WEIGHTS_GROUP_MEMBERS,
        mn.LEARNER_WEIGHTS_GROUP_EPOCH,
        mn.LEARNER_WEIGHTS_GROUP_SENT_VERSION,
        mn.LEARNER_WEIGHTS_GROUP_SEND_S,
        mn.LEARNER_WEIGHTS_GROUP_ERROR_VERSION,
    ]
)
# Cumulative totals by reason (``{prefix}{reason}``) -> counter name, help.
_LEARNER_BY_REASON = {
    mn.RECEIVER_BAD_FRAMES_PREFIX: ("bad_frames", "Frames refused by validation, by reason."),
    mn.RECEIVER_REFUSED_PREFIX: (
        "groups_refused",
        "Well-formed groups refused by admission (acked as refused, never trained), by reason.",
    ),
}
_BY_REASON = tuple(_LEARNER_BY_REASON)


# Every frame received and not trained on: the reason it carries in ``frames_refused``, for
# each total that counts such frames (the bad-frame and refusal reasons are added by prefix).
_NOT_TRAINED = {
    mn.LEARNER_DROPPED_STALE: "stale",
    mn.LEARNER_REJECTED_GROUPS: "wrong_group_size",
    mn.LEARNER_GROUPS_SKIPPED_NO_SIGNAL: "no_signal",
    mn.RECEIVER_DUPLICATES: "duplicate",
    mn.RECEIVER_HANDOVER_DROPPED: "handover",
    mn.LEARNER_WAL_SKIPPED: "wal_skipped",
}
_FRAMES_REFUSED_DOC = (
    "Frames received and never trained on, by reason: each bad-frame reason (oversize, ...), "
    "each admission refusal, stale (beyond max_staleness), no_signal (dynamic sampling), "
    "duplicate, handover, wal_skipped."
)


class LearnerExporter(MetricsServer):
    """``specrl_learner_*``: fed the learner loop's per-step metrics dict and staleness values."""

    def __init__(self, port: int, host: str, run_dir: Path, publish_every: int = 1) -> None:
        super().__init__("learner", port, host, run_dir)
        self.publish_every = publish_every
        self._snapshot = SnapshotCollector("specrl_learner")
        self.registry.register(self._snapshot)
        self._staleness = Histogram(
            "specrl_learner_staleness",
            "Versions between the learner and each trained group's policy.",
            buckets=STALENESS_BUCKETS,
            registry=self.registry,
        )
        self._publish = Histogram(
            "specrl_learner_weight_publish_seconds",
            "Time to publish one weights version to Redis.",
            buckets=SECONDS_BUCKETS,
            registry=self.registry,
        )
        self._groups_trained = 0.0
        # Every counter's newest total, from the step records and the live receiver alike.
        self._totals: dict[str, float] = {}
        self._totals_lock = threading.Lock()
        self._busy_s = 0.0
        self._wait_s = 0.0

    @classmethod
    def start(cls, cfg: SpecRLConfig, run_dir: Path) -> LearnerExporter:
        """Serve on ``learner.metrics_port`` (an object whose methods do nothing when off)."""
        return cls(
            cfg.learner.metrics_port,
            cfg.security.metrics_host,
            run_dir,
            publish_every=cfg.learner.publish_every,
        )

    def update(self, metrics: Mapping[str, Any], staleness: Iterable[int] | Any = ()) -> None:
        """One optimizer step: ``metrics`` is the loop's record, ``staleness`` one value per
        trained group (a list or a tensor)."""
        if not self.enabled:
            return
        snap = self._snapshot
        for value in staleness.tolist() if hasattr(staleness, "tolist") else staleness:
            self._staleness.observe(value)
        self._set_totals(metrics)
        for key, value in metrics.items():
            if is_number(value) and key.startswith(mn.ROLLOUT_GROUPS):
                snap.set("gauge", metric_suffix(key), f"Actors' {key}, mean over the step.", value)
            elif is_number(value) and key.startswith(mn.EVAL_PREFIX):
                snap.set("gauge", metric_suffix(key), f"Held-out evaluation: {key}.", value)
            elif is_number(value) and _draft_training_figure(key):
                snap.set("gauge", metric_suffix(key), f"The draft's training: {key}.", value)

        self._groups_trained += float(metrics.get(mn.LEARNER_GROUPS) or 0)
        snap.set("counter", "groups_trained", "Groups trained on.", self._groups_trained)
        publish_s = float(metrics.get(mn.LEARNER_PUBLISH_S) or 0.0)
        step = int(metrics.get(mn.LEARNER_STEP) or 0)
        if step % self.publish_every == 0:
            self._publish.observe(publish_s)
        self._busy_s += float(metrics.get(mn.LEARNER_TRAIN_S) or 0.0) + publish_s
        self._wait_s += float(metrics.get(mn.LEARNER_WAIT_S) or 0.0)
        snap.set("counter", "busy_seconds", "Time training and publishing.", self._busy_s)
        snap.set("counter", "wait_seconds", "Time waiting for groups.", self._wait_s)
        wall_s = float(metrics.get(mn.LEARNER_WALL_S) or 0.0)
        if wall_s > 0:
            snap.set(
                "gauge",
                "busy_fraction",
                "Share of wall-clock time spent training and publishing.",
                min(1.0, self._busy_s / wall_s),
            )

    def watch(self, source: Callable[[], Mapping[str, float]]) -> None:
        """Export ``source()`` (the receiver's counters: received, refused, bad frames, queue
        depth) at every scrape, so a refusal shows on ``/metrics`` when it happens even while
        no optimizer step is taken."""
        if self.enabled:
            self._snapshot.refresh = lambda: self._set_totals(source())

    def _set_totals(self, metrics: Mapping[str, Any]) -> None:
        """The counters and gauges in ``metrics`` (a step record or the live receiver's).

        A counter shows the larger of its value here and the one it had: each total only grows,
        so the larger is the newer, and a step record read before a live scrape lowers nothing.
        """
        snap = self._snapshot
        with self._totals_lock:
            for key, value in metrics.items():
                if is_number(value) and _is_total(key):
                    self._totals[key] = max(self._totals.get(key, 0.0), float(value))
            totals = dict(self._totals)
        snap.set_known(_LEARNER_METRICS, {**metrics, **totals}, _LEARNER_GAUGES)
        not_trained: dict[str, float] = {}
        for key, value in totals.items():
            for prefix, (name, doc) in _LEARNER_BY_REASON.items():
                if key.startswith(prefix):
                    snap.set("counter", name, doc, value, {"reason": key[len(prefix) :]})
            reason = _NOT_TRAINED.get(key) or (
                key.rsplit("/", 1)[1] if key.startswith(_BY_REASON) else None
            )
            if reason is not None:
                not_trained[reason] = not_trained.get(reason, 0.0) + value
        for reason, value in not_trained.items():
            snap.set("counter", "frames_refused", _FRAMES_REFUSED_DOC, value, {"reason": reason})


def _is_total(key: str) -> bool:
    """Whether ``key`` is a cumulative total the exporter shows (a counter, not a gauge)."""
    if key in _LEARNER_GAUGES:
        return False
    return key in _LEARNER_METRICS or key in _NOT_TRAINED or key.startswith(_BY_REASON)
