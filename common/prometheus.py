"""Prometheus ``/metrics`` of the learner and of each actor: one registry and server per process.

Ports (``learner.metrics_port``, ``actor.metrics_port``; actor i serves on ``metrics_port + i``):
-1 is off, 0 is any free port. While a server is on, its port is written to
``{run_dir}/prometheus/{role}.port`` (``learner.port``, ``actor-{index}.port``) so operators and
tests can find it. A port that is taken is logged and the process runs on without metrics:
observability never stops a job.

The learner and actors already hold their counters as cumulative totals (receiver, buffer,
sender), so counters are exported from the latest snapshot by a custom collector
(``CounterMetricFamily``), the standard pattern for counters held elsewhere. Distributions
observed here (staleness, publish and fetch seconds) are ordinary histograms.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from common.config import SpecRLConfig

log = logging.getLogger(__name__)

STALENESS_BUCKETS = tuple(float(s) for s in range(9))  # 0..8 versions behind, then +Inf
PUBLISH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
FETCH_BUCKETS = PUBLISH_BUCKETS

_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")

# Learner: externally held cumulative totals → counter name, help.
_LEARNER_COUNTERS = {
    "receiver/received": ("groups_received", "Trajectory groups received and accepted."),
    "learner/dropped_stale": ("groups_dropped_stale", "Groups dropped beyond max_staleness."),
    "receiver/duplicates": ("groups_duplicated", "Resent groups dropped by (actor_id, seq)."),
    "learner/rejected_groups": ("groups_rejected", "Groups refused by the shape check."),
    "learner/skipped_steps": (
        "skipped_steps",
        "Optimizer steps skipped because the loss or the gradients were not finite.",
    ),
    "learner/wal_skipped": (
        "wal_skipped",
        "Groups replayed from the write-ahead log or a checkpoint that this learner refused.",
    ),
    "receiver/unauthenticated": (
        "unauthenticated_refused",
        "Connections refused by CurveZMQ authentication.",
    ),
}
# Learner: cumulative totals by reason (``{prefix}{reason}``) → counter name, help.
_LEARNER_BY_REASON = {
    "receiver/bad_frames/": ("bad_frames", "Frames refused by validation, by reason."),
    "receiver/refused/": (
        "groups_refused",
        "Well-formed groups refused by admission (acked as refused, never trained), by reason.",
    ),
}
# Learner: latest values → gauge name, help.
_LEARNER_GAUGES = {
    "learner/version": ("version", "Newest published policy version."),
    "learner/step": ("step", "Optimizer steps taken."),
    "learner/reward_mean": ("reward_mean", "Mean reward of the last step's batch."),
    "actor/tokens_per_s": ("actor_tokens_per_s", "Generated tokens/s, sum over live actors."),
    "actor/live": ("live_actors", "Actors heard from recently."),
    "receiver/queue_size": ("queue_depth", "Groups received, not yet trained on."),
}
# Actor: externally held cumulative totals.
_ACTOR_COUNTERS = {
    "actor/batches": ("batches", "Rollout batches generated."),
    "actor/groups_sent": ("groups_sent", "Trajectory groups submitted to the learner."),
    "sender/acked_total": ("groups_acked", "Groups acked by the learner."),
    "sender/refused_total": ("groups_refused", "Groups the learner refused (never trained)."),
    "sender/resent_total": ("groups_resent", "Groups sent again after a timeout or reconnect."),
    "sender/reconnects": ("reconnects", "Reconnections to the learner."),
    "sender/bad_replies": ("bad_replies", "Undecodable replies from the learner."),
    "actor/wait_s": ("wait_seconds", "Idle time waiting for a new version (synchronous mode)."),
}
_ACTOR_GAUGES = {
    "actor/tokens_per_s": ("tokens_per_s", "Generated tokens/s of the last batch."),
    "actor/reward_mean": ("reward_mean", "Mean reward of every completion generated so far."),
    "sender/unacked": ("outbox_depth", "Groups in the outbox, not yet acked."),
    "sender/unsent": ("outbox_unsent", "Outbox groups waiting to be sent."),
}
# Actor: per-batch amounts (the engine resets them at each stats() call), summed here.
_ACTOR_SUMS = {
    "actor/tokens": ("tokens", "Tokens generated."),
    "actor/gen_time_s": ("generation_seconds", "Time spent generating."),
    "verify/swaps": ("verify_swaps", "Weight swaps applied to rollouts in flight."),
    "verify/inflight_tokens": ("verify_inflight_tokens", "Tokens in flight at weight swaps."),
    "verify/salvaged_tokens": ("verify_salvaged_tokens", "In-flight tokens kept by verification."),
    "verify/wasted_tokens": ("verify_wasted_tokens", "In-flight tokens discarded."),
    "verify/forward_tokens": ("verify_forward_tokens", "Tokens re-run by delayed verification."),
}


def metric_suffix(key: str) -> str:
    """``verify/acceptance_gap1`` → ``verify_acceptance_gap1`` (a valid Prometheus name part)."""
    return _UNSAFE.sub("_", key)


class SnapshotCollector(Collector):
    """Counter and gauge families from the latest values stored with :meth:`set`.

    Every sample carries ``base_labels`` (an actor's ``actor_id``) before its own labels.
    """

    def __init__(
        self,
        prefix: str,
        base_labels: Mapping[str, str] | None = None,
        refresh: Callable[[], None] | None = None,
    ) -> None:
        """``refresh`` runs at every scrape, before the families are read: values held by a
        live object (the learner's receiver) are exported as they are then, not as of the last
        optimizer step."""
        self.prefix = prefix
        self.base_labels = dict(base_labels or {})
        self.refresh = refresh
        self._lock = threading.Lock()
        # name → (kind, help, label names, {label values: value})
        self._families: dict[str, tuple[str, str, tuple[str, ...], dict[tuple, float]]] = {}

    def set(
        self,
        kind: str,
        name: str,
        doc: str,
        value: float,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        labels = {**self.base_labels, **(labels or {})}
        with self._lock:
            family = self._families.setdefault(name, (kind, doc, tuple(labels), {}))
            family[3][tuple(labels.values())] = float(value)

    def collect(self) -> Iterator[Metric]:
        if self.refresh is not None:
            self.refresh()
        with self._lock:
            families = [(n, k, d, ln, dict(s)) for n, (k, d, ln, s) in self._families.items()]
        for name, kind, doc, label_names, samples in sorted(families):
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            family = cls(f"{self.prefix}_{name}", doc, labels=list(label_names))
            for values, value in samples.items():
                family.add_metric(list(values), value)
            yield family


class _Exporter:
    """A registry, its HTTP server (or none) and the port file; the base of both exporters."""

    def __init__(self, role: str, port: int, host: str, run_dir: Path) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        self.port: int | None = None
        self._server: Any = None
        self._port_file = run_dir / "prometheus" / f"{role}.port"
        if port < 0:
            return
        if port > 65535:
            log.warning("%s: metrics port %d is out of range; running without /metrics", role, port)
            return
        try:
            self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:  # taken, or a host that cannot be bound
            log.warning(
                "%s: cannot serve /metrics on %s:%d (%s); running without metrics",
                role,
                host,
                port,
                e,
            )
            return
        self.port = int(self._server.server_port)
        self._port_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._port_file.with_suffix(".port.tmp")
        tmp.write_text(f"{self.port}\n")
        tmp.replace(self._port_file)
        log.info("%s: Prometheus /metrics on http://%s:%d/metrics", role, host, self.port)

    @property
    def enabled(self) -> bool:
        return self._server is not None

    def close(self) -> None:
        """Stop the server and remove the port file (a stale port would point at nothing)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server = None
        self._port_file.unlink(missing_ok=True)

    def __enter__(self) -> _Exporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LearnerExporter(_Exporter):
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
            buckets=PUBLISH_BUCKETS,
            registry=self.registry,
        )
        self._groups_trained = 0.0
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
            if _number(value) and key.startswith(("spec/", "verify/")):
                snap.set("gauge", metric_suffix(key), f"Actors' {key}, mean over the step.", value)

        self._groups_trained += float(metrics.get("learner/groups") or 0)
        snap.set("counter", "groups_trained", "Groups trained on.", self._groups_trained)
        publish_s = float(metrics.get("learner/publish_s") or 0.0)
        step = int(metrics.get("learner/step") or 0)
        if step % self.publish_every == 0:
            self._publish.observe(publish_s)
        self._busy_s += float(metrics.get("learner/train_s") or 0.0) + publish_s
        self._wait_s += float(metrics.get("learner/wait_s") or 0.0)
        snap.set("counter", "busy_seconds", "Time training and publishing.", self._busy_s)
        snap.set("counter", "wait_seconds", "Time waiting for groups.", self._wait_s)
        wall_s = float(metrics.get("learner/wall_s") or 0.0)
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
        snap = self._snapshot
        for key, (name, doc) in _LEARNER_COUNTERS.items():
            if _number(metrics.get(key)):
                snap.set("counter", name, doc, metrics[key])
        for key, (name, doc) in _LEARNER_GAUGES.items():
            if _number(metrics.get(key)):
                snap.set("gauge", name, doc, metrics[key])
        for key, value in metrics.items():
            if not _number(value):
                continue
            for prefix, (name, doc) in _LEARNER_BY_REASON.items():
                if key.startswith(prefix):
                    snap.set("counter", name, doc, value, {"reason": key[len(prefix) :]})


class ActorExporter(_Exporter):
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
            buckets=FETCH_BUCKETS,
            registry=self.registry,
        ).labels(actor_id)
        self._sums: dict[str, float] = dict.fromkeys(_ACTOR_SUMS, 0.0)

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
        for key, (name, doc) in _ACTOR_COUNTERS.items():
            if _number(status.get(key)):
                snap.set("counter", name, doc, status[key])
        for key, (name, doc) in _ACTOR_GAUGES.items():
            if _number(status.get(key)):
                snap.set("gauge", name, doc, status[key])
        for key, (name, doc) in _ACTOR_SUMS.items():
            if _number(status.get(key)):
                self._sums[key] += float(status[key])
            snap.set("counter", name, doc, self._sums[key])
        for key, value in status.items():
            if _number(value) and key.startswith(("spec/", "verify/")) and key not in _ACTOR_SUMS:
                snap.set("gauge", metric_suffix(key), f"{key} of the last batch.", value)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value
