"""Prometheus series of the shadow process, in the app's own registry (several apps may live
in one process: tests, benchmarks). The interval and decision series join when judging does."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from flyspec.gate.shadow.admission import REASONS


class ShadowMetrics:
    """``flyspec_shadow_pairs_total``, ``flyspec_shadow_skipped_total{reason}``,
    ``flyspec_shadow_queue_depth`` and ``flyspec_shadow_mirroring`` (1 while mirroring, 0 once stopped)."""

    def __init__(self, queue_depth: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.pairs = Counter(
            "flyspec_shadow_pairs", "Mirrored pairs handed to the sink.", registry=self.registry
        )
        self._skipped = Counter(
            "flyspec_shadow_skipped",
            "Requests not mirrored (or pairs not stored), by reason.",
            ["reason"],
            registry=self.registry,
        )
        for reason in REASONS:  # every reason is listed from the start, at 0
            self._skipped.labels(reason=reason)
        depth = Gauge(
            "flyspec_shadow_queue_depth", "Mirror jobs waiting for a worker.", registry=self.registry
        )
        depth.set_function(queue_depth)
        self.mirroring = Gauge(
            "flyspec_shadow_mirroring",
            "1 while requests are mirrored, 0 once mirroring stopped.",
            registry=self.registry,
        )
        self.mirroring.set(1)

    def skip(self, reason: str) -> None:
        """Count one request not mirrored for ``reason``."""
        self._skipped.labels(reason=reason).inc()
