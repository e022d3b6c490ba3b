"""The mirror: which requests are copied (eligibility, the registered sampling rule, the stop after N pairs,
the candidate's spend caps), a bounded queue, and workers that ask the arms and hand each pair to the sink.
Production first: ``offer`` never waits, and the sink runs in its own thread so a slow store never holds
the event loop that serves clients. Every request not mirrored is counted by reason (``Skip``)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from flyspec.checks import is_int, is_number
from flyspec.gate.arms import parse_arm
from flyspec.gate.arms.base import ArmSpec
from flyspec.gate.arms.endpoint import OpenAIArm
from flyspec.gate.shadow.pairs import ArmAnswer, MirroredPair, Redactor, failed, from_json, from_stream

log = logging.getLogger(__name__)

PairSink = Callable[[MirroredPair], object]
"""Where pairs go, one at a time in one thread: a ``SqlitePairStore`` or a registered ``ShadowRun``."""


class Skip(StrEnum):
    """Every reason a request is not mirrored (or a pair not stored), in the order /metrics lists them."""

    MALFORMED = "malformed_body"
    BASELINE_ERROR = "baseline_error"
    SEVERAL_CHOICES = "n_gt_1"
    TOOLS = "tools"
    SEVERAL_PROMPTS = "several_prompts"
    TOO_LONG = "too_long"
    NOT_SAMPLED = "not_sampled"
    STOPPED = "stopped"
    QUEUE_FULL = "queue_full"
    OVER_REQUEST_CAP = "over_request_cap"
    OVER_TOKEN_CAP = "over_token_cap"
    CLIENT_GONE = "client_disconnected"
    STORE_ERROR = "store_error"


@dataclass(frozen=True)
class SamplingRule:
    """The registered draw of mirrored requests: a request is drawn when the SHA-256 of the seed and its
    body, read as a number in [0, 1), is below ``share``. Deterministic (the same body is always drawn or
    never), independent of any answer, and fixed before the first request."""

    share: float
    seed: int = 0

    def draws(self, body: bytes) -> bool:
        """True when the request with this raw body is mirrored."""
        if self.share >= 1:
            return True
        digest = hashlib.sha256(self.seed.to_bytes(8, "big") + body).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.share

    def describe(self) -> dict[str, object]:
        """The rule as the run's registration records it."""
        return {
            "rule": "sha256(seed as 8 big-endian bytes + raw request body)[:8] / 2**64 < share",
            "share": self.share,
            "seed": self.seed,
        }


def ineligible(route: str, body: dict[str, object]) -> Skip | None:
    """Why a well-formed request cannot be paired (several choices, tools, several prompts), or None."""
    for key in ("n", "best_of"):
        value = body.get(key, 1)
        if value is not None and value != 1:
            return Skip.SEVERAL_CHOICES
    if any(body.get(key) for key in ("tools", "tool_choice", "functions", "function_call")):
        return Skip.TOOLS
    prompt = body.get("prompt")
    # A list of token ids is one prompt; a list of strings or of token-id lists is one prompt per item.
    several = isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)
    if route == "/completions" and several:
        return Skip.SEVERAL_PROMPTS
    return None


@dataclass
class PairBudget:
    """The stop after ``max_pairs`` admitted pairs (None: no stop), or once the run decided (``closed``)."""

    max_pairs: int | None
    admitted: int = 0
    closed: bool = False

    @property
    def exhausted(self) -> bool:
        """True once mirroring stops (the proxy keeps serving)."""
        return self.closed or (self.max_pairs is not None and self.admitted >= self.max_pairs)

    def take(self) -> None:
        """Admit one pair."""
        self.admitted += 1


@dataclass
class Booking:
    """One admitted candidate request: when, and its tokens (estimated, then as reported)."""

    at: float
    tokens: float


@dataclass
class SpendCaps:
    """Caps on the candidate's requests and tokens over a sliding minute (None: no cap); tokens are booked
    as estimated, then as reported. (The number of mirror workers caps its concurrency.)"""

    requests_per_minute: int | None
    tokens_per_minute: int | None
    clock: Callable[[], float] = time.monotonic
    booked: deque[Booking] = field(default_factory=deque, init=False)  # oldest first

    def admit(self, estimated_tokens: int) -> Booking | Skip:
        """A booking when the request fits (``settle`` it once the candidate answers), else the cap hit."""
        cutoff = self.clock() - 60.0  # a sliding minute
        while self.booked and self.booked[0].at <= cutoff:
            self.booked.popleft()
        tokens = sum(b.tokens for b in self.booked)
        if self.requests_per_minute is not None and len(self.booked) + 1 > self.requests_per_minute:
            return Skip.OVER_REQUEST_CAP
        if self.tokens_per_minute is not None and tokens + estimated_tokens > self.tokens_per_minute:
            return Skip.OVER_TOKEN_CAP
        booking = Booking(self.clock(), float(estimated_tokens))
        self.booked.append(booking)
        return booking

    @staticmethod
    def settle(booking: Booking, used_tokens: int | None) -> None:
        """Replace a booking's estimate with the tokens the candidate reported (kept when unreported)."""
        if used_tokens is not None:
            booking.tokens = float(used_tokens)


UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
"""What an upstream that did not answer raises: refused, reset, cut short or timed out."""


class Upstream:
    """An endpoint arm's connection pool (``connections`` None: unbounded) and its base URLs, in turn.

    aiohttp rather than httpx: what the proxy adds is Python run per request and per event, and on
    aiohttp's client (C-accelerated parser, no anyio or h11 layer) the added p50 at one paced stream fell
    from 2.1-4.5 ms to 0.3-1.9 ms, and throughput at 32 streams rose from 0.79-0.83x to 0.95-1.01x
    of direct (BENCHMARKS.md, 2026-12-08 later)."""

    def __init__(self, arm: OpenAIArm, connections: int | None) -> None:
        self.arm = arm
        self._next = itertools.cycle(arm.base_urls)
        self.connections = connections
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pool, opened on first use: an aiohttp session belongs to the event loop that opened it."""
        if self._session is None:
            timeout = self.arm.timeout
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.connections or 0),  # 0: no limit
                # Per connection and per read, as a client's own timeout would be: a long answer streamed
                # at a model's pace may take longer than `timeout` in all.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(timeout, 10.0), sock_read=timeout),
                headers={"Authorization": f"Bearer {self.arm.api_key}"} if self.arm.api_key else None,
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
            )
        return self._session

    def url(self, route: str) -> str:
        """The next base URL joined with ``route`` (``/chat/completions``, ``/models``)."""
        return next(self._next) + route

    async def ask(self, route: str, request: Mapping[str, object]) -> ArmAnswer:
        """This arm's whole answer, asked with its model and extra fields (an error answer on failure)."""
        body = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
        start = time.monotonic()
        try:
            sent = {**body, "model": self.arm.model, **self.arm.extra_body}
            async with self.session.post(self.url(route), json=sent) as response:
                content = await response.read()
        except UPSTREAM_ERRORS as exc:
            return failed(f"{type(exc).__name__}: {exc or 'no detail'}", time.monotonic() - start)
        return from_json(route, response.status, content, time.monotonic() - start)

    async def close(self) -> None:
        """Close the pool."""
        if self._session is not None:
            await self._session.close()


def endpoint_arm(name: str, spec: ArmSpec) -> OpenAIArm:
    """An endpoint arm from the JSON `gate run` takes; the shadow forwards HTTP, so an engine is refused."""
    arm = parse_arm(name, spec)
    if arm.kind != "openai":
        raise ValueError(
            f"--{name}: gate shadow forwards traffic to OpenAI-compatible endpoints; give "
            '{"base_urls": [...], "model": ...}, not an arm of kind ' + repr(arm.kind)
        )
    return arm


@dataclass(frozen=True)
class ShadowSettings:
    """The options of `flyspec gate shadow`'s traffic (its --help says each), checked once here (ValueError
    naming the option); queue_size: copies waiting at most, max_request_bytes: longer bodies are skipped."""

    baseline: OpenAIArm
    candidate: OpenAIArm
    sample: float = 1.0
    sample_seed: int = 0
    max_pairs: int | None = None
    candidate_concurrency: int = 4
    max_candidate_requests_per_minute: int | None = None
    max_candidate_tokens_per_minute: int | None = None
    redact: tuple[str, ...] = field(default_factory=tuple)
    queue_size: int = 256
    max_request_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if not is_number(self.sample, above=0, at_most=1):
            raise ValueError(f"--sample={self.sample!r}: the mirrored share must be in (0, 1]")
        if not is_int(self.sample_seed, 0):
            raise ValueError(f"sample_seed={self.sample_seed!r}: must be an integer >= 0")
        for option, value in (
            ("--max-pairs", self.max_pairs),
            ("--candidate-concurrency", self.candidate_concurrency),
            ("--max-candidate-requests-per-minute", self.max_candidate_requests_per_minute),
            ("--max-candidate-tokens-per-minute", self.max_candidate_tokens_per_minute),
            ("queue_size", self.queue_size),
            ("max_request_bytes", self.max_request_bytes),
        ):
            if value is not None and not is_int(value, 1):
                raise ValueError(f"{option}={value!r}: must be a positive integer")
        Redactor(self.redact)  # a bad pattern fails here, before the server starts

    def rule(self) -> SamplingRule:
        """The registered sampling rule."""
        return SamplingRule(self.sample, self.sample_seed)


class ShadowMetrics:
    """The traffic's Prometheus series, in the app's own registry (several apps may share a process)."""

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
        for reason in Skip:  # every reason is listed from the start, at 0
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

    def skip(self, reason: Skip) -> None:
        """Count one request not mirrored for ``reason``."""
        self._skipped.labels(reason=reason).inc()


@dataclass(frozen=True)
class BaselineCapture:
    """What the client received from the baseline (a stream's body is all of its events)."""

    status: int
    body: bytes
    streamed: bool
    latency_s: float
    first_token_s: float | None = None

    def answer(self, route: str) -> ArmAnswer:
        """The baseline's answer read from what the client received."""
        if self.streamed:
            return from_stream(route, self.status, self.body, self.latency_s, self.first_token_s)
        return from_json(route, self.status, self.body, self.latency_s)


@dataclass(frozen=True)
class MirrorJob:
    """One admitted copy: the redacted request, and the baseline's answer (None for a mirror-sink copy)."""

    route: str
    request: dict[str, object]
    received_at: float
    source: str
    baseline: BaselineCapture | None


class Mirror:
    """Both upstreams, the rules that admit a copy, the bounded queue and its workers."""

    def __init__(self, settings: ShadowSettings, sink: PairSink) -> None:
        self.baseline = Upstream(settings.baseline, connections=None)
        self.candidate = Upstream(settings.candidate, connections=settings.candidate_concurrency)
        self.sink = sink
        self.settings = settings
        self.rule = settings.rule()
        self.budget = PairBudget(settings.max_pairs)
        self.caps = SpendCaps(
            settings.max_candidate_requests_per_minute, settings.max_candidate_tokens_per_minute
        )
        self.redactor = Redactor(settings.redact)
        self.queue: asyncio.Queue[MirrorJob] = asyncio.Queue(maxsize=settings.queue_size)
        self.metrics = ShadowMetrics(self.queue.qsize)
        self._tasks: list[asyncio.Task] = []
        self._store_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shadow-sink")

    def _reason(self, route: str, raw: bytes, status: int | None) -> tuple[Skip | None, dict[str, object]]:
        if len(raw) > self.settings.max_request_bytes:
            return Skip.TOO_LONG, {}
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            return Skip.MALFORMED, {}
        if status is not None and status != 200:
            return Skip.BASELINE_ERROR, body
        reason = ineligible(route, body)
        if reason is None and self.budget.exhausted:
            reason = Skip.STOPPED
        if reason is None and not self.rule.draws(raw):
            reason = Skip.NOT_SAMPLED
        return reason, body

    def offer(self, route: str, raw: bytes, source: str, baseline: BaselineCapture | None) -> None:
        """Admit a copy of a request or count why not; never waits and never raises."""
        received_at = time.time()
        reason, body = self._reason(route, raw, baseline.status if baseline else None)
        if reason is None:
            job = MirrorJob(route, self.redactor.value(body), received_at, source, baseline)
            try:
                self.queue.put_nowait(job)
            except asyncio.QueueFull:
                reason = Skip.QUEUE_FULL
            else:
                self.budget.take()
                if self.budget.exhausted:
                    self.close(f"{self.budget.admitted} pairs admitted (--max-pairs)")
        if reason is not None:
            self.metrics.skip(reason)

    def close(self, why: str = "the run decided") -> None:
        """Stop mirroring, once (also from the run's thread); the proxy keeps serving."""
        if not self.budget.closed:
            self.budget.closed = True
            self.metrics.mirroring.set(0)
            log.warning("shadow: %s: mirroring stops; the proxy keeps serving", why)

    def start(self) -> None:
        """Start the workers on the running event loop."""
        self._tasks = [asyncio.create_task(self._work()) for _ in range(self.settings.candidate_concurrency)]

    async def stop(self) -> None:
        """Stop the workers (copies queued or in flight are not stored), the sink thread and both pools."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._store_thread.shutdown(wait=True)
        await self.baseline.close()
        await self.candidate.close()

    async def _work(self) -> None:
        while True:
            job = await self.queue.get()
            try:
                await self._pair(job)
            except Exception:  # a worker must outlive any one copy (a sink that failed, say): it is counted
                log.exception("shadow: a mirrored pair was not stored")
                self.metrics.skip(Skip.STORE_ERROR)
            finally:
                self.queue.task_done()

    async def _pair(self, job: MirrorJob) -> None:
        baseline = job.baseline.answer(job.route) if job.baseline is not None else None
        if baseline is not None and not baseline.ok:  # a 200 that is not an OpenAI completion
            self.metrics.skip(Skip.BASELINE_ERROR)
            return
        # The candidate's likely tokens: the baseline's where known, else the request's max_tokens.
        estimate = baseline.tokens if baseline is not None else None
        if estimate is None:
            limit = job.request.get("max_tokens") or job.request.get("max_completion_tokens")
            estimate = limit if isinstance(limit, int) and limit > 0 else 0
        booking = self.caps.admit(estimate)
        if isinstance(booking, Skip):
            self.metrics.skip(booking)
            return
        if baseline is None:  # a mirror-sink copy: production's answer is asked for here
            baseline = await self.baseline.ask(job.route, job.request)
            if not baseline.ok:
                self.caps.settle(booking, 0)
                self.metrics.skip(Skip.BASELINE_ERROR)
                return
        candidate = await self.candidate.ask(job.route, job.request)
        self.caps.settle(booking, candidate.tokens)
        answers = self.redactor.answer(baseline), self.redactor.answer(candidate)
        pair = MirroredPair(job.received_at, job.source, job.route, job.request, *answers)
        await asyncio.get_running_loop().run_in_executor(self._store_thread, self.sink, pair)
        self.metrics.pairs.inc()
