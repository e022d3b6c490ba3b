"""Server-sent events in the OpenAI streaming format, from an engine stream of cumulative outputs.

The engine reports cumulative text; clients get only what is new. Text that could still turn into a
stop string is held back, because the engine cuts a stop string from the final text and a streamed
piece cannot be taken back: the concatenated stream always equals the non-streamed text.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from flyspec.outputs import RequestOutput
from flyspec.server.engine_loop import RequestStream
from flyspec.server.errors import OpenAIError
from flyspec.server.responses import Choice, spec_decode_json, usage_json

ChoiceOf = Callable[[RequestOutput], Awaitable[Choice]]
"""Turns a finished output into its Choice (finish and stop reason)."""


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event carrying `data` (JSON, or a literal such as [DONE])."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class EngineStreamResponse(StreamingResponse):
    """Server-sent events of one engine stream; whatever ends the response (done, error, hang-up, even
    before the first event) aborts what is still running, so no slot outlives its client."""

    def __init__(
        self, events: AsyncIterator[str], stream: RequestStream, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(
            _in_band_errors(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **(headers or {})},
        )
        self.stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.close()


async def _in_band_errors(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once headers are sent the status cannot change: report a failure as an error event, as OpenAI does."""
    try:
        async for event in events:
            yield event
    except OpenAIError as exc:
        yield sse(exc.body())
        yield sse("[DONE]")


def stream_safe_end(text: str, stop: list[str], finished: bool) -> int:
    """How much of `text` may be streamed now: hold back a tail that could still grow into a stop string
    (the engine then cuts it from the final text, and streamed text cannot be taken back)."""
    if finished or not stop:
        return len(text)
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return len(text) - hold


class TextDeltas:
    """Turns cumulative per-choice text into the pieces not yet sent."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = stop
        self.sent: dict[int, int] = {}

    def next(self, index: int, out: RequestOutput) -> str:
        """The new text of choice `index` that is safe to send now."""
        text = out.outputs[0].text
        start = self.sent.get(index, 0)
        end = max(start, stream_safe_end(text, self.stop, out.finished))
        self.sent[index] = end
        return text[start:end]


async def completion_events(
    request_id: str,
    model: str,
    fingerprint: str,
    stream: RequestStream,
    stop: list[str],
    include_usage: bool,
    choice_of: ChoiceOf,
) -> AsyncIterator[str]:
    """/v1/completions chunks: text deltas per choice, the finish and stop reason (with that choice's
    spec_decode) on its last chunk, then with include_usage a choice-less chunk with usage and spec_decode,
    then [DONE]."""
    created = int(time.time())
    deltas = TextDeltas(stop)
    finals: dict[int, RequestOutput] = {}

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": fingerprint,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = None
        body.update(extra)
        return body

    async for index, out in stream:
        piece = deltas.next(index, out)
        if not piece and not out.finished:
            continue
        choice = {"index": index, "text": piece, "logprobs": None, "finish_reason": None, "stop_reason": None}
        if out.finished:
            finals[index] = out
            final = await choice_of(out)
            choice.update(finish_reason=final.finish_reason, stop_reason=final.stop_reason)
            yield sse(chunk([choice], spec_decode=spec_decode_json(out.metrics)))
        else:
            yield sse(chunk([choice]))
    if include_usage:
        outs = [finals[i] for i in sorted(finals)]
        yield sse(chunk([], usage=usage_json(outs), spec_decode=spec_decode_json([o.metrics for o in outs])))
    yield sse("[DONE]")


async def chat_events(
    request_id: str,
    model: str,
    fingerprint: str,
    stream: RequestStream,
    stop: list[str],
    include_usage: bool,
    choice_of: ChoiceOf,
) -> AsyncIterator[str]:
    """/v1/chat/completions chunks: the assistant role, content deltas, the finish and stop reason (with
    spec_decode), then with include_usage a choice-less usage chunk, then [DONE]."""
    created = int(time.time())
    deltas = TextDeltas(stop)

    def chunk(delta: dict[str, Any], finish: Choice | None = None, **extra: Any) -> dict[str, Any]:
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish.finish_reason if finish else None,
            "stop_reason": finish.stop_reason if finish else None,
        }
        body = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": fingerprint,
            "choices": [choice],
        }
        if include_usage:
            body["usage"] = None
        body.update(extra)
        return body

    yield sse(chunk({"role": "assistant", "content": ""}))
    final: RequestOutput | None = None
    async for _, out in stream:
        piece = deltas.next(0, out)
        if out.finished:
            final = out
            delta = {"content": piece} if piece else {}
            yield sse(chunk(delta, await choice_of(out), spec_decode=spec_decode_json(out.metrics)))
        elif piece:
            yield sse(chunk({"content": piece}))
    if include_usage and final is not None:
        usage_chunk = chunk({}, usage=usage_json([final]), spec_decode=spec_decode_json(final.metrics))
        usage_chunk["choices"] = []
        yield sse(usage_chunk)
    yield sse("[DONE]")
