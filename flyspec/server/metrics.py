"""Prometheus metrics of the server (SPEC 8), named like vLLM's with the `flyspec:` prefix.

Each app gets its own CollectorRegistry so several servers can live in one process (tests, benchmarks).
Counters follow the engine's cumulative `stats`: after every step the engine loop adds the difference to
the previous snapshot, so /metrics and the per-response `spec_decode` numbers come from the same counts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flyspec.spec_decode.metrics import SpecDecodeStats

# Seconds; covers a tiny CPU model (milliseconds) up to long generations of a real one.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

# Engine counter (SpecDecodeStats attribute) -> metric name without the `_total` suffix.
_COUNTERS = {
    "num_drafts": ("flyspec:spec_decode_num_drafts", "Verification steps that had at least one draft token."),
    "num_draft_tokens": ("flyspec:spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "num_accepted_tokens": (
        "flyspec:spec_decode_num_accepted_tokens",
        "Draft tokens kept by verification (FLy-forgiven tokens included).",
    ),
    "num_forgiven_tokens": (
        "flyspec:spec_decode_num_forgiven_tokens",
        "Draft tokens kept only because FLy forgave a native rejection (lossy).",
    ),
    "generation_tokens": ("flyspec:generation_tokens", "Tokens generated."),
    "prompt_tokens": ("flyspec:prompt_tokens", "Prompt tokens processed."),
}


class ServerMetrics:
    """All server metrics in one registry; updated only by the engine loop thread."""

    def __init__(self, num_speculative_tokens: int, lossy: bool) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.num_requests_running = Gauge(
            "flyspec:num_requests_running", "Requests in the running batch.", registry=r
        )
        self.num_requests_waiting = Gauge(
            "flyspec:num_requests_waiting", "Requests waiting to be admitted.", registry=r
        )
        self.lossy_verification_enabled = Gauge(
            "flyspec:lossy_verification_enabled",
            "1 when the engine verifies with FLy (lossy), 0 when verification is lossless.",
            registry=r,
        )
        self.lossy_verification_enabled.set(1 if lossy else 0)
        self._counters = {key: Counter(name, doc, registry=r) for key, (name, doc) in _COUNTERS.items()}
        self.accepted_per_pos = Counter(
            "flyspec:spec_decode_num_accepted_tokens_per_pos",
            "Verification steps whose draft token at this position was kept.",
            ["position"],
            registry=r,
        )
        # Create every position up front so dashboards see zeros rather than missing series.
        self._positions = [
            self.accepted_per_pos.labels(position=str(i)) for i in range(num_speculative_tokens)
        ]
        self.time_to_first_token = Histogram(
            "flyspec:time_to_first_token_seconds",
            "Seconds from request arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "flyspec:inter_token_latency_seconds",
            "Seconds per generated token after the first: the gap between two outputs of a request divided "
            "by the tokens it brought (speculative steps bring several), observed once per token.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "flyspec:e2e_request_latency_seconds",
            "Seconds from request arrival to its last token, for requests that finished (not aborted).",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self._last = SpecDecodeStats(num_speculative_tokens=num_speculative_tokens)

    def update(self, stats: SpecDecodeStats, num_running: int, num_waiting: int) -> None:
        """Move the counters by what the engine counted since the last call and set the gauges."""
        for key, counter in self._counters.items():
            delta = getattr(stats, key) - getattr(self._last, key)
            if delta:
                counter.inc(delta)
                setattr(self._last, key, getattr(stats, key))
        for i, child in enumerate(self._positions):
            delta = stats.accepted_per_position[i] - self._last.accepted_per_position[i]
            if delta:
                child.inc(delta)
                self._last.accepted_per_position[i] = stats.accepted_per_position[i]
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)
