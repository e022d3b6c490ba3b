"""Server-sent events in the OpenAI streaming format, from an engine stream of cumulative outputs.

The engine reports cumulative text; clients get only what is new. Text that could still turn into a
stop string is held back, because the engine cuts a stop string from the final text and a streamed
piece cannot be taken back: the concatenated stream always equals the non-streamed text. Logprobs of new
tokens ride on the next chunk sent for their choice. Every choice (prompt x sample) streams on its own
index; an enforced tool call is sent whole on its choice's last chunk, once it parses.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi.responses import StreamingResponse

from flyspec.outputs import CompletionOutput, RequestOutput
from flyspec.server.choices import ChoiceShaper, StreamCursor
from flyspec.server.engine_loop import RequestStream
from flyspec.server.errors import OpenAIError
from flyspec.server.logprobs_json import chat_logprobs
from flyspec.server.responses import spec_decode_json, usage_json


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

    def next(self, index: int, text: str, finished: bool) -> str:
        """The new text of choice `index` (cumulative `text`, final when `finished`) safe to send now."""
        start = self.sent.get(index, 0)
        end = max(start, stream_safe_end(text, self.stop, finished))
        self.sent[index] = end
        return text[start:end]


def _samples(
    out: RequestOutput, cursors: dict[int, StreamCursor], shaper: ChoiceShaper, prompt: int
) -> Iterator[tuple[int, CompletionOutput, StreamCursor]]:
    """(choice index, sample, its cursor) for the samples of `out` whose choice has not ended."""
    for sample in out.outputs:
        index = shaper.index(prompt, sample)
        if not cursors[index].done:
            yield index, sample, cursors[index]


def _new_tokens(sample: CompletionOutput, cursor: StreamCursor) -> tuple[list[int], list[Any]]:
    """The token ids and logprob entries the cursor has not sent yet (marked sent)."""
    start, cursor.tokens_sent = cursor.tokens_sent, len(sample.token_ids)
    return sample.token_ids[start:], (sample.logprobs or [])[start:]


async def completion_events(
    request_id: str,
    model: str,
    fingerprint: str,
    stream: RequestStream,
    shaper: ChoiceShaper,
    include_usage: bool,
) -> AsyncIterator[str]:
    """/v1/completions chunks: per choice its text deltas (the echoed prompt first), logprobs of the new
    tokens, and on its last chunk the finish and stop reason with that sample's spec_decode; then with
    include_usage a choice-less chunk with usage and spec_decode; then [DONE]."""
    created = int(time.time())
    stops = shaper.params.stop
    assert isinstance(stops, list)
    deltas = TextDeltas(stops)
    cursors: dict[int, StreamCursor] = defaultdict(StreamCursor)
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

    async for prompt, out in stream:
        if out.finished:
            finals[prompt] = out
        for index, sample, cursor in _samples(out, cursors, shaper, prompt):
            finished = sample.finish_reason is not None
            piece = deltas.next(index, sample.text, finished)
            if not cursor.started and shaper.echo is not None:
                piece = shaper.echo[prompt].text + piece
                if shaper.logprobs is not None:
                    shaper.prompt_entries(out, prompt, cursor.logprobs)
            new_ids, new_logprobs = _new_tokens(sample, cursor)
            if shaper.logprobs is not None:
                for token_id, position in zip(new_ids, new_logprobs, strict=True):
                    cursor.logprobs.add(token_id, position)
            if not piece and not finished:
                continue  # logprobs of held-back text ride on the next chunk
            choice: dict[str, Any] = {
                "index": index,
                "text": piece,
                "logprobs": cursor.logprobs.take() if shaper.logprobs is not None else None,
                "finish_reason": None,
                "stop_reason": None,
            }
            if not cursor.started and shaper.prompt_logprobs:
                choice["prompt_logprobs"] = shaper.vllm_prompt_logprobs(out)
            cursor.started = True
            extra = {}
            if finished:
                cursor.done = True
                ending = await shaper.ending(sample)
                choice.update(finish_reason=ending.finish_reason, stop_reason=ending.stop_reason)
                extra["spec_decode"] = spec_decode_json(sample.metrics or out.metrics)
            yield sse(chunk([choice], **extra))
    if include_usage:
        outs = [finals[i] for i in sorted(finals)]
        yield sse(chunk([], usage=usage_json(outs), spec_decode=spec_decode_json([o.metrics for o in outs])))
    yield sse("[DONE]")


async def chat_events(
    request_id: str,
    model: str,
    fingerprint: str,
    stream: RequestStream,
    shaper: ChoiceShaper,
    include_usage: bool,
) -> AsyncIterator[str]:
    """/v1/chat/completions chunks: the assistant role per choice, content deltas with the new tokens'
    logprobs, the finish and stop reason (with spec_decode) on each choice's last chunk, then with
    include_usage a choice-less usage chunk, then [DONE]. An enforced tool call is not streamed as text:
    its parsed tool_calls come whole on the last chunk (as text only if it does not parse)."""
    created = int(time.time())
    stops = shaper.params.stop
    assert isinstance(stops, list)
    deltas = TextDeltas(stops)
    cursors: dict[int, StreamCursor] = defaultdict(StreamCursor)
    prompt_logprobs_sent = not shaper.prompt_logprobs

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, **extra: Any) -> dict[str, Any]:
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": extra.pop("finish_reason", None),
            "stop_reason": extra.pop("stop_reason", None),
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

    for index in range(shaper.params.n):
        yield sse(chunk(index, {"role": "assistant", "content": ""}))
    final: RequestOutput | None = None
    async for _, out in stream:
        if out.finished:
            final = out
        for index, sample, cursor in _samples(out, cursors, shaper, 0):
            finished = sample.finish_reason is not None
            tool_call = shaper.tool_format is not None
            piece = "" if tool_call else deltas.next(index, sample.text, finished)
            if not piece and not finished:
                continue  # logprobs of held-back text ride on the next chunk
            new_ids, new_logprobs = _new_tokens(sample, cursor)
            logprobs = None
            if shaper.logprobs is not None:
                logprobs = chat_logprobs(new_ids, new_logprobs, shaper.logprobs)
            extra: dict[str, Any] = {}
            if not prompt_logprobs_sent and out.prompt_logprobs is not None:
                extra["prompt_logprobs"] = shaper.vllm_prompt_logprobs(out)
                prompt_logprobs_sent = True
            delta: dict[str, Any] = {"content": piece} if piece else {}
            if finished:
                cursor.done = True
                ending = await shaper.ending(sample)
                if ending.tool_calls is not None:
                    delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(ending.tool_calls)]}
                elif tool_call and sample.text:
                    delta = {"content": sample.text}
                extra.update(
                    finish_reason=ending.finish_reason,
                    stop_reason=ending.stop_reason,
                    spec_decode=spec_decode_json(sample.metrics or out.metrics),
                )
            yield sse(chunk(index, delta, logprobs, **extra))
    if include_usage and final is not None:
        usage_chunk = chunk(0, {}, usage=usage_json([final]), spec_decode=spec_decode_json(final.metrics))
        usage_chunk["choices"] = []
        yield sse(usage_chunk)
    yield sse("[DONE]")
