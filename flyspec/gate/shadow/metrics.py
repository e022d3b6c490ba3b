"""Prometheus series of the shadow process, in the app's own registry (several apps may live
in one process: tests, benchmarks): the traffic's counters, and a registered run's decision as gauges."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge

from flyspec.gate.shadow.admission import REASONS

if TYPE_CHECKING:
    from flyspec.gate.shadow.run import LiveDecision


class ShadowMetrics:
    """``flyspec_shadow_pairs_total``, ``flyspec_shadow_skipped_total{reason}``,
    ``flyspec_shadow_queue_depth`` and ``flyspec_shadow_mirroring`` (1 while mirroring, 0 once stopped);
    with a registered run, ``flyspec_shadow_interval_low``/``_high``, ``flyspec_shadow_decision``,
    ``flyspec_shadow_labels_waiting`` and ``flyspec_shadow_judge_agreement``."""

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
        self._decision: dict[str, Gauge] = {}
        # Set by ``track``: brings the decision gauges up to date before a scrape.
        self.refresh: Callable[[], Awaitable[object]] | None = None

    def track(self, refresh: Callable[[], Awaitable[object]]) -> None:
        """List a registered run's decision gauges, kept up to date by ``refresh`` (called per scrape)."""
        self.refresh = refresh
        self._decision = {
            name: Gauge(name, help_text, registry=self.registry)
            for name, help_text in (
                ("flyspec_shadow_interval_low", "Low end of the run's interval of the net difference."),
                ("flyspec_shadow_interval_high", "High end of the run's interval of the net difference."),
                ("flyspec_shadow_decision", "The run's decision: -1 FAIL, 0 INCONCLUSIVE, 1 PASS."),
                ("flyspec_shadow_labels_waiting", "Drawn pairs waiting for a person's gold label."),
                ("flyspec_shadow_judge_agreement", "The judge's agreement with gold (NaN before a label)."),
            )
        }

    def show(self, state: LiveDecision) -> None:
        """Set the decision gauges from a ``LiveDecision``."""
        agreement = state.judge_agreement
        for name, value in (
            ("flyspec_shadow_interval_low", state.low),
            ("flyspec_shadow_interval_high", state.high),
            ("flyspec_shadow_decision", state.code),
            ("flyspec_shadow_labels_waiting", state.labels_waiting),
            ("flyspec_shadow_judge_agreement", float("nan") if agreement is None else agreement),
        ):
            self._decision[name].set(value)

    def skip(self, reason: str) -> None:
        """Count one request not mirrored for ``reason``."""
        self._skipped.labels(reason=reason).inc()
