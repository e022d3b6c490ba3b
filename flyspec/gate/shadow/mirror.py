"""The mirror: admits copies of requests into a bounded queue, and workers that ask the candidate (and,
for mirror-sink copies, the baseline) and hand each ``MirroredPair`` to the sink.

Production first: ``offer`` never waits (a full queue skips the copy, counted as ``queue_full``), the
workers run only on admitted copies, and the sink runs in one worker thread so a slow store never holds the
event loop that serves clients. The number of workers caps the candidate's concurrency.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import httpx

from flyspec.gate.shadow import admission
from flyspec.gate.shadow.admission import PairBudget, SamplingRule
from flyspec.gate.shadow.answers import from_json, from_stream
from flyspec.gate.shadow.metrics import ShadowMetrics
from flyspec.gate.shadow.pairs import ArmAnswer, MirroredPair, failed
from flyspec.gate.shadow.redact import Redactor
from flyspec.gate.shadow.spend import SpendCaps
from flyspec.gate.shadow.upstream import Upstream

log = logging.getLogger(__name__)

PairSink = Callable[[MirroredPair], None]
"""Where pairs go: called in one worker thread, one pair at a time (the SQLite pair store, or the gate's
store and judge)."""


@dataclass(frozen=True)
class BaselineCapture:
    """What the client received from the baseline: status, body bytes (the whole stream for a streamed
    answer), whether it was streamed, its latency and, for a stream, the time to its first chunk."""

    status: int
    body: bytes
    streamed: bool
    latency_s: float
    first_token_s: float | None = None


@dataclass(frozen=True)
class MirrorJob:
    """One admitted copy: its route, the redacted request, when it arrived, where from, and the baseline's
    answer when the proxy passed one to the client (None for a mirror-sink copy)."""

    route: str
    request: dict[str, object]
    received_at: float
    source: str
    baseline: BaselineCapture | None


class Mirror:
    """The bounded queue, its workers and the rules that admit a copy."""

    def __init__(
        self,
        *,
        baseline: Upstream,
        candidate: Upstream,
        sink: PairSink,
        rule: SamplingRule,
        budget: PairBudget,
        caps: SpendCaps,
        redactor: Redactor,
        workers: int,
        queue_size: int,
        max_request_bytes: int,
    ) -> None:
        self.baseline, self.candidate, self.sink = baseline, candidate, sink
        self.rule, self.budget, self.caps, self.redactor = rule, budget, caps, redactor
        self.max_request_bytes = max_request_bytes
        self.queue: asyncio.Queue[MirrorJob] = asyncio.Queue(maxsize=queue_size)
        self.metrics = ShadowMetrics(self.queue.qsize)
        self._workers = workers
        self._tasks: list[asyncio.Task] = []
        self._store_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shadow-sink")

    # ------------------------------------------------------------------------------------ admission

    def _reason(
        self, route: str, raw: bytes, status: int | None
    ) -> tuple[str | None, dict[str, object] | None]:
        if len(raw) > self.max_request_bytes:
            return admission.TOO_LONG, None
        body = admission.parse_body(raw)
        if body is None:
            return admission.MALFORMED, None
        if status is not None and status != 200:
            return admission.BASELINE_ERROR, None
        reason = admission.ineligible(route, body)
        if reason is None and self.budget.exhausted:
            reason = admission.STOPPED
        if reason is None and not self.rule.draws(raw):
            reason = admission.NOT_SAMPLED
        return reason, body

    def offer(self, route: str, raw: bytes, source: str, baseline: BaselineCapture | None) -> None:
        """Admit a copy of a request (with the baseline's answer when the proxy has one) or count why not.
        Never waits and never raises."""
        received_at = time.time()
        reason, body = self._reason(route, raw, baseline.status if baseline else None)
        if reason is None and body is not None:
            job = MirrorJob(route, self.redactor.value(body), received_at, source, baseline)
            try:
                self.queue.put_nowait(job)
            except asyncio.QueueFull:
                reason = admission.QUEUE_FULL
            else:
                self.budget.take()
                if self.budget.exhausted:
                    self.metrics.mirroring.set(0)
                    log.warning(
                        "shadow: %d pairs admitted (--max-pairs): mirroring stops; the proxy keeps serving",
                        self.budget.admitted,
                    )
        if reason is not None:
            self.metrics.skip(reason)

    def close(self, decision: object = None) -> None:
        """Stop mirroring because the run decided (called from the run's thread); the proxy keeps serving."""
        if not self.budget.closed:
            self.budget.close()
            self.metrics.mirroring.set(0)
            log.warning("shadow: the run decided: mirroring stops; the proxy keeps serving")

    # -------------------------------------------------------------------------------------- workers

    def start(self) -> None:
        """Start the workers on the running event loop."""
        self._tasks = [asyncio.create_task(self._work()) for _ in range(self._workers)]

    async def stop(self) -> None:
        """Stop the workers (copies still queued or in flight are not stored) and the sink thread."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._store_thread.shutdown(wait=True)

    async def _work(self) -> None:
        while True:
            job = await self.queue.get()
            try:
                await self._pair(job)
            except Exception:  # a worker must outlive any one copy; the copy is counted as not stored
                log.exception("shadow: a mirrored request failed unexpectedly")
                self.metrics.skip(admission.STORE_ERROR)
            finally:
                self.queue.task_done()

    async def _ask(self, upstream: Upstream, job: MirrorJob) -> ArmAnswer:
        """The arm's answer to the job's request; an error or timeout is an error answer."""
        start = time.monotonic()
        try:
            response = await upstream.client.post(upstream.url(job.route), json=upstream.body(job.request))
        except httpx.HTTPError as exc:
            return failed(f"{type(exc).__name__}: {exc or 'no detail'}", time.monotonic() - start)
        return from_json(job.route, response.status_code, response.content, time.monotonic() - start)

    def _passed_baseline(self, job: MirrorJob) -> ArmAnswer:
        capture = job.baseline
        assert capture is not None
        if capture.streamed:
            return from_stream(
                job.route, capture.status, capture.body, capture.latency_s, capture.first_token_s
            )
        return from_json(job.route, capture.status, capture.body, capture.latency_s)

    def _estimate(self, job: MirrorJob, baseline: ArmAnswer | None) -> int:
        """Tokens the candidate will likely use: the baseline's where known, else the request's max_tokens."""
        if baseline is not None and baseline.prompt_tokens is not None:
            return baseline.prompt_tokens + (baseline.completion_tokens or 0)
        limit = job.request.get("max_tokens") or job.request.get("max_completion_tokens")
        return limit if isinstance(limit, int) and limit > 0 else 0

    async def _pair(self, job: MirrorJob) -> None:
        baseline = self._passed_baseline(job) if job.baseline is not None else None
        if baseline is not None and not baseline.ok:  # a 200 that is not an OpenAI completion
            self.metrics.skip(admission.BASELINE_ERROR)
            return
        booking = self.caps.admit(self._estimate(job, baseline))
        if isinstance(booking, str):  # over a cap: the reason
            self.metrics.skip(booking)
            return
        if baseline is None:  # a mirror-sink copy: production's answer is asked for here
            baseline = await self._ask(self.baseline, job)
            if not baseline.ok:
                self.caps.settle(booking, 0)
                self.metrics.skip(admission.BASELINE_ERROR)
                return
        candidate = await self._ask(self.candidate, job)
        used = candidate.prompt_tokens
        self.caps.settle(booking, None if used is None else used + (candidate.completion_tokens or 0))
        pair = MirroredPair(
            received_at=job.received_at,
            source=job.source,
            route=job.route,
            request=job.request,
            baseline=self._redacted(baseline),
            candidate=self._redacted(candidate),
        )
        try:
            await asyncio.get_running_loop().run_in_executor(self._store_thread, self.sink, pair)
        except Exception:
            log.exception("shadow: the pair sink failed; the pair is lost")
            self.metrics.skip(admission.STORE_ERROR)
            return
        self.metrics.pairs.inc()

    def _redacted(self, answer: ArmAnswer) -> ArmAnswer:
        """The answer with its text and error (which may quote a response body) redacted."""
        if not self.redactor.patterns:
            return answer
        text = None if answer.text is None else self.redactor.text(answer.text)
        error = None if answer.error is None else self.redactor.text(answer.error)
        return replace(answer, text=text, error=error)
