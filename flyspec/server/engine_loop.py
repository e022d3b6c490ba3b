"""The one thread that owns the engine.

The engine is not thread-safe, so HTTP handlers never touch it: they put `add` / `abort` commands on a
queue and read their request's outputs from an asyncio queue that this thread feeds through
`loop.call_soon_threadsafe`. The thread blocks on the command queue when there is nothing to run (no
busy spin), and steps the engine while any request is unfinished. A request that fails inside the engine
alone (finish_reason "error"; the batch goes on) reaches its handler as a 500; an exception out of
`step()` itself fails the requests that were in flight with a 500 and the loop keeps serving.

It drives LLMEngine through its public methods (add_request, abort_request, step) rather than through
`LLM.stream`, because a server must interleave steps with requests that arrive and leave between any
two steps, which the one-caller iterator API does not offer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from flyspec.outputs import RequestOutput
from flyspec.sampling_params import SamplingParams
from flyspec.server.engine_contract import ServedEngine
from flyspec.server.errors import OpenAIError, invalid_request
from flyspec.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

_STOP = object()
_ACCEPTED = object()
# After step() raised, wait this long before stepping again so a persistently broken engine cannot spin.
_FAILED_STEP_PAUSE_S = 0.05


@dataclass
class _Tracked:
    """What the loop thread keeps per request: where its outputs go and its latency bookkeeping."""

    index: int  # the choice index inside its HTTP request
    sink: asyncio.Queue[tuple[int, Any]]
    arrival: float  # when the HTTP request arrived
    queued_at: float = 0.0  # when the engine took it
    scheduled_at: float | None = None  # when it got a slot
    first_token_at: float | None = None
    last_token_at: float = 0.0
    num_tokens: int = 0


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tracked: _Tracked


@dataclass
class _Abort:
    request_id: str


@dataclass
class RequestStream:
    """The outputs of one HTTP request's engine requests (one per choice), as they arrive.

    Iterating yields `(index, RequestOutput)` with cumulative text until every prompt's request finished;
    an engine failure, of the whole step or of one request alone (`RequestOutput.error`), raises a 500
    OpenAIError. `close()` aborts whatever has not finished (the client went away). `translate_error`
    may turn an engine failure into the error the client should see (a grammar too complex to run is
    the client's 400, flyspec/server/constraints.py).
    """

    engine_loop: EngineLoop
    request_ids: list[str]
    sink: asyncio.Queue[tuple[int, Any]]
    finished: set[int] = field(default_factory=set)
    closed: bool = False
    translate_error: Callable[[OpenAIError], OpenAIError] | None = None

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while len(self.finished) < len(self.request_ids):
            index, item = await self.sink.get()
            if isinstance(item, OpenAIError):
                self.finished.add(index)  # the loop already dropped it
                raise item
            if item.finished:
                self.finished.add(index)
            if item.error is not None:  # this request alone failed in the engine
                error = OpenAIError(
                    f"the engine failed on this request: {item.error}", status=500, type="server_error"
                )
                raise self.translate_error(error) if self.translate_error is not None else error
            yield index, item

    def close(self) -> None:
        """Abort every request of this stream that has not finished; safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        for index, request_id in enumerate(self.request_ids):
            if index not in self.finished:
                self.engine_loop.abort(request_id)


class EngineLoop:
    """Drives an LLMEngine from one dedicated thread; the asyncio side only enqueues and reads."""

    def __init__(self, engine: ServedEngine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        # Engine requests not yet seen holding a slot, in the order they were added (see _note_admissions).
        self._queued: deque[str] = deque()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def alive(self) -> bool:
        """True while the loop thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread; call from the event loop that will read the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="flyspec-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Fail in-flight requests with 503, stop the thread and wait for it."""
        if self._thread is None:
            return
        self._commands.put(_STOP)
        self._thread.join(timeout)

    async def submit(
        self, requests: list[tuple[str, list[int], SamplingParams]], arrival: float
    ) -> RequestStream:
        """Add engine requests for one HTTP request and wait until the engine took all of them.

        Raises OpenAIError (400) when the engine rejects one of them; the others are aborted then.
        """
        if not self.alive:
            raise OpenAIError("the engine loop is not running", status=503, type="server_error")
        sink: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        stream = RequestStream(self, [rid for rid, _, _ in requests], sink)
        for index, (rid, ids, params) in enumerate(requests):
            self._commands.put(_Add(rid, ids, params, _Tracked(index, sink, arrival)))
        unanswered, error, early = set(range(len(requests))), None, []
        try:
            while unanswered:
                index, item = await sink.get()
                if item is _ACCEPTED:
                    unanswered.discard(index)
                elif isinstance(item, OpenAIError):  # rejected, or failed right after admission
                    unanswered.discard(index)
                    stream.finished.add(index)
                    error = error or item
                else:  # an output may overtake the acks of later choices
                    early.append((index, item))
        except BaseException:
            stream.close()  # cancelled while waiting: nothing may stay admitted
            raise
        if error is not None:
            stream.close()
            raise error
        # Put the overtaking outputs back in front of anything that arrived after them.
        while not sink.empty():
            early.append(sink.get_nowait())
        for entry in early:
            sink.put_nowait(entry)
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished); its slot is freed by the loop thread."""
        self._commands.put(_Abort(request_id))

    # --- everything below runs on the loop thread ---

    def _run(self) -> None:
        while True:
            try:
                if not self._iteration():
                    return
            except Exception:  # a bug in bookkeeping must not take the server down with it
                logger.exception("engine loop iteration failed")
                time.sleep(_FAILED_STEP_PAUSE_S)

    def _iteration(self) -> bool:
        """Take the queued commands, then step once if anything runs; False when told to stop."""
        idle = not self.engine.has_unfinished_requests()
        try:
            commands = [self._commands.get(block=idle)]
        except queue.Empty:
            commands = []
        while True:  # take everything queued so one step serves all new arrivals
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            if command is _STOP:
                self._fail_all(OpenAIError("the server is shutting down", status=503, type="server_error"))
                return False
            self._handle(command)
        if self.engine.has_unfinished_requests():
            self._step()
        # Also after aborts alone: a freed slot must show in the gauges without waiting for a step.
        self.metrics.update(self.engine.stats, self.engine.num_running, self.engine.num_waiting)
        return True

    def _handle(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            if self._tracked.pop(command.request_id, None) is not None:
                self._abort_in_engine(command.request_id)
                self.metrics.request_success["abort"].inc()
                with contextlib.suppress(ValueError):
                    self._queued.remove(command.request_id)
            return
        tracked = command.tracked
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
        except ValueError as exc:
            self._deliver(tracked, invalid_request(exc))
            return
        except Exception as exc:
            logger.exception("add_request(%s) failed", command.request_id)
            self._deliver(
                tracked,
                OpenAIError(f"the engine failed to add the request: {exc}", status=500, type="server_error"),
            )
            return
        tracked.queued_at = time.monotonic()
        self._tracked[command.request_id] = tracked
        self._queued.append(command.request_id)
        self._deliver(tracked, _ACCEPTED)

    def _step(self) -> None:
        started = time.monotonic()
        try:
            outputs: list[RequestOutput] = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the %d requests in flight", len(self._tracked))
            self.metrics.request_success["error"].inc(len(self._tracked))
            self._fail_all(
                OpenAIError(f"the engine failed while decoding: {exc}", status=500, type="server_error")
            )
            time.sleep(_FAILED_STEP_PAUSE_S)
            return
        self._note_admissions(started)
        now = time.monotonic()
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:  # aborted while this step ran
                continue
            self._observe_latency(tracked, out, now)
            self._deliver(tracked, out)
            if out.finished:
                self._observe_finished(tracked, out, now)
                del self._tracked[out.request_id]

    def _note_admissions(self, step_started: float) -> None:
        """Mark the requests this step admitted: the scheduler admits first come, first served at the
        start of a step, so the oldest queued requests beyond the engine's waiting count got a slot."""
        while len(self._queued) > self.engine.num_waiting:
            tracked = self._tracked.get(self._queued.popleft())
            if tracked is not None:
                tracked.scheduled_at = step_started
                self.metrics.request_queue_time.observe(step_started - tracked.queued_at)

    def _observe_latency(self, tracked: _Tracked, out: RequestOutput, now: float) -> None:
        num_tokens = sum(len(sample.token_ids) for sample in out.outputs)
        new = num_tokens - tracked.num_tokens
        if new > 0:
            if tracked.first_token_at is None:
                tracked.first_token_at = now
                self.metrics.time_to_first_token.observe(now - tracked.arrival)
            else:
                per_token = (now - tracked.last_token_at) / new
                for _ in range(new):
                    self.metrics.inter_token_latency.observe(per_token)
            tracked.last_token_at = now
            tracked.num_tokens = num_tokens

    def _observe_finished(self, tracked: _Tracked, out: RequestOutput, now: float) -> None:
        # Each sample counts with its own finish reason (as vLLM counts parallel samples); a failed request
        # counts once, as error, although the engine aborted its other samples.
        reasons = ["error"] if out.error is not None else [s.finish_reason or "stop" for s in out.outputs]
        for reason in reasons:
            self.metrics.request_success[reason].inc()
        if set(reasons) == {"abort"}:
            return
        m = self.metrics
        m.e2e_request_latency.observe(now - tracked.arrival)
        m.request_prompt_tokens.observe(len(out.prompt_token_ids))
        m.request_generation_tokens.observe(sum(len(sample.token_ids) for sample in out.outputs))
        scheduled = tracked.scheduled_at if tracked.scheduled_at is not None else tracked.queued_at
        first = tracked.first_token_at if tracked.first_token_at is not None else now
        m.request_prefill_time.observe(first - scheduled)
        m.request_decode_time.observe(now - first)
        m.request_inference_time.observe(now - scheduled)

    def _fail_all(self, error: OpenAIError) -> None:
        for request_id, tracked in list(self._tracked.items()):
            self._deliver(tracked, error)
            self._abort_in_engine(request_id)
        self._tracked.clear()
        self._queued.clear()

    def _abort_in_engine(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("abort_request(%s) failed", request_id)

    def _deliver(self, tracked: _Tracked, item: Any) -> None:
        assert self._loop is not None
        # RuntimeError: the event loop is closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(tracked.sink.put_nowait, (tracked.index, item))
