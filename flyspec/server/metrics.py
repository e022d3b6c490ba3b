"""Prometheus metrics of the server, named like vLLM's with the `flyspec:` prefix and a `model_name` label
on every series, so vLLM dashboards and alerts port by changing the prefix (docs/server.md lists them).

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
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's

FINISHED_REASONS = ("stop", "length", "abort", "error")

# Engine counter (SpecDecodeStats attribute) -> metric name without the `_total` suffix.
_COUNTERS = {
    "num_drafts": ("flyspec:spec_decode_num_drafts", "Verification steps that had at least one draft token."),
    "num_draft_tokens": ("flyspec:spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "num_accepted_tokens": (
        "flyspec:spec_decode_num_accepted_tokens",
        "Draft tokens kept by verification (forgiven tokens included).",
    ),
    "num_forgiven_tokens": (
        "flyspec:spec_decode_num_forgiven_tokens",
        "Draft tokens kept only because a lossy policy (FLy, typical acceptance) forgave a native rejection.",
    ),
    "generation_tokens": ("flyspec:generation_tokens", "Tokens generated."),
    "prompt_tokens": ("flyspec:prompt_tokens", "Prompt tokens processed."),
    "prefix_cache_queries": (
        "flyspec:prefix_cache_queries",
        "Prompt tokens of admitted requests looked up in the prefix cache.",
    ),
    "prefix_cache_hits": (
        "flyspec:prefix_cache_hits",
        "Prompt tokens found in the prefix cache: their KV blocks were shared, their prefill saved.",
    ),
    "num_preemptions": (
        "flyspec:num_preemptions",
        "Running requests sent back to the queue for lack of KV cache blocks (computed again later).",
    ),
}

_LABEL = ["model_name"]


class ServerMetrics:
    """All server metrics in one registry; updated only by the engine loop thread."""

    def __init__(self, model_name: str, num_speculative_tokens: int, lossy: bool, max_running: int) -> None:
        self.registry = CollectorRegistry()
        self._model_name = model_name
        # Registered in the order /metrics lists them.
        self._add_engine_gauges(lossy, max_running)
        self.iteration_tokens = self._histogram(
            "flyspec:iteration_tokens_total",
            "Tokens per engine step: prompt tokens prefilled plus tokens generated.",
            _ITERATION_BUCKETS,
        )
        self._add_counters(num_speculative_tokens)
        self._add_latency_histograms()
        self._add_length_histograms()
        self._last = SpecDecodeStats(num_speculative_tokens=num_speculative_tokens)

    def _gauge(self, metric: str, doc: str) -> Gauge:
        """A gauge of this server's model."""
        return Gauge(metric, doc, _LABEL, registry=self.registry).labels(model_name=self._model_name)

    def _histogram(self, metric: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        """A histogram of this server's model."""
        histogram = Histogram(metric, doc, _LABEL, buckets=buckets, registry=self.registry)
        return histogram.labels(model_name=self._model_name)

    def _add_engine_gauges(self, lossy: bool, max_running: int) -> None:
        """The gauges of the engine's load and setup."""
        self.num_requests_running = self._gauge(
            "flyspec:num_requests_running", "Requests in the running batch."
        )
        self.num_requests_waiting = self._gauge(
            "flyspec:num_requests_waiting", "Requests waiting to be admitted."
        )
        self.max_running_requests = self._gauge(
            "flyspec:max_running_requests",
            "The admission cap: min(max_num_seqs, max_num_batched_tokens // (1 + K)); running requests "
            "never exceed it.",
        )
        self.max_running_requests.set(max_running)
        self.kv_cache_usage_perc = self._gauge(
            "flyspec:kv_cache_usage_perc",
            "Fraction (0 to 1) of the KV cache's blocks held by running requests.",
        )
        self.lossy_verification_enabled = self._gauge(
            "flyspec:lossy_verification_enabled",
            "1 when the engine verifies with a lossy policy (FLy, typical acceptance), 0 when verification "
            "is lossless.",
        )
        self.lossy_verification_enabled.set(1 if lossy else 0)

    def _add_counters(self, num_speculative_tokens: int) -> None:
        """The engine's counters, acceptances per draft position, and finished requests by reason."""
        r, model_name = self.registry, self._model_name
        self._counters = {
            key: Counter(metric, doc, _LABEL, registry=r).labels(model_name=model_name)
            for key, (metric, doc) in _COUNTERS.items()
        }
        accepted_per_pos = Counter(
            "flyspec:spec_decode_num_accepted_tokens_per_pos",
            "Verification steps whose draft token at this position was kept.",
            ["model_name", "position"],
            registry=r,
        )
        # Create every labelled series up front so dashboards see zeros rather than missing series.
        self._positions = [
            accepted_per_pos.labels(model_name=model_name, position=str(i))
            for i in range(num_speculative_tokens)
        ]
        success = Counter(
            "flyspec:request_success",
            "Requests that finished, by reason: stop (stop string, stop token or end of sequence), length "
            "(max_tokens or max_model_len), abort (the client went away), error (the engine failed).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.request_success = {
            reason: success.labels(model_name=model_name, finished_reason=reason)
            for reason in FINISHED_REASONS
        }

    def _add_latency_histograms(self) -> None:
        """The histograms of a request's times, in seconds."""
        self.time_to_first_token = self._histogram(
            "flyspec:time_to_first_token_seconds",
            "Seconds from request arrival to its first generated token.",
            _LATENCY_BUCKETS,
        )
        self.inter_token_latency = self._histogram(
            "flyspec:inter_token_latency_seconds",
            "Seconds per generated token after the first: the gap between two outputs of a request divided "
            "by the tokens it brought (speculative steps bring several), observed once per token.",
            _LATENCY_BUCKETS,
        )
        self.e2e_request_latency = self._histogram(
            "flyspec:e2e_request_latency_seconds",
            "Seconds from request arrival to its last token, for requests that finished (not aborted).",
            _REQUEST_BUCKETS,
        )
        self.request_queue_time = self._histogram(
            "flyspec:request_queue_time_seconds",
            "Seconds a request waited in the engine's queue before it got a slot.",
            _REQUEST_BUCKETS,
        )
        self.request_prefill_time = self._histogram(
            "flyspec:request_prefill_time_seconds",
            "Seconds from getting a slot to the first generated token (the prompt's prefill).",
            _REQUEST_BUCKETS,
        )
        self.request_decode_time = self._histogram(
            "flyspec:request_decode_time_seconds",
            "Seconds from the first generated token to the last, for finished requests.",
            _REQUEST_BUCKETS,
        )
        self.request_inference_time = self._histogram(
            "flyspec:request_inference_time_seconds",
            "Seconds from getting a slot to the last token (prefill plus decode), for finished requests.",
            _REQUEST_BUCKETS,
        )

    def _add_length_histograms(self) -> None:
        """The histograms of a finished request's prompt and output lengths, in tokens."""
        self.request_prompt_tokens = self._histogram(
            "flyspec:request_prompt_tokens", "Prompt length of finished requests, in tokens.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = self._histogram(
            "flyspec:request_generation_tokens",
            "Generated length of finished requests, in tokens.",
            _TOKEN_BUCKETS,
        )

    def update(self, stats: SpecDecodeStats, num_running: int, num_waiting: int) -> None:
        """Move the counters by what the engine counted since the last call and set the gauges."""
        step_tokens = sum(
            getattr(stats, key) - getattr(self._last, key) for key in ("prompt_tokens", "generation_tokens")
        )
        if step_tokens:
            self.iteration_tokens.observe(step_tokens)
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
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
