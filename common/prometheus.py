"""Prometheus ``/metrics`` plumbing shared by the learner's and the actors' exporters
(``learner/exporter.py``, ``actors/exporter.py``): one registry and server per process.

Ports, the port files and the exported families: docs/operations.md "Observability". A port that
is taken is logged and the process runs on without metrics: observability never stops a job.

The learner and actors already hold their counters as cumulative totals (receiver, buffer,
sender), so counters are exported from the latest snapshot by a custom collector
(``CounterMetricFamily``), the standard pattern for counters held elsewhere. Distributions
observed here (staleness, publish and fetch seconds) are ordinary histograms.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# Weight publish (learner) and fetch (actor) times.
SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


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

    def set_known(
        self,
        table: Mapping[str, tuple[str, str]],
        values: Mapping[str, Any],
        gauges: frozenset[str] = frozenset(),
    ) -> None:
        """For each key of ``table`` (key -> (name, help)) with a number in ``values``, set that
        family: a gauge if the key is one of ``gauges``, else a counter."""
        for key, (name, doc) in table.items():
            if is_number(values.get(key)):
                self.set("gauge" if key in gauges else "counter", name, doc, values[key])

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


class MetricsServer:
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

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_number(value: object) -> bool:
    """A real, non-NaN number (bools excluded): what a sample may carry."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value
