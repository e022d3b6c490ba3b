"""A scripted OpenAI-compatible server: fixed answers, streamed or whole, for measuring a proxy (the shadow
benchmark) and for tests of proxy mechanics. Not a model: every answer is ``ANSWER`` prefixed with the
server's name, so who answered is plain to see.

Run one process of it with ``python -m flyspec.bench.scripted_openai NAME PORT [DELAY_MS GAP_MS]`` (the
wait before answering and between a stream's events: a model's pace).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

ANSWER = "The answer is 42 because six times seven is forty-two."
PIECES = 8
"""A streamed answer arrives in this many content events (then a usage event and [DONE])."""


@dataclass
class Script:
    """What the server does: its name (model id and answer prefix), a delay before answering, an optional
    event it waits for before answering, the pause between a stream's events, how long a stream stays open
    after its `[DONE]`, the request bodies it received and their Authorization headers (kept when
    ``record``), and ``reply``: the answer text for a request body (a judge that reads its prompt), instead
    of ``ANSWER`` prefixed with the name."""

    name: str
    delay_s: float = 0.0
    hold: threading.Event | None = None
    gap_s: float = 0.0
    linger_s: float = 0.0
    record: bool = False
    bodies: list[dict[str, Any]] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    reply: Callable[[dict[str, Any]], str] | None = None

    def text(self, body: dict[str, Any] | None = None) -> str:
        if self.reply is not None and body is not None:
            return self.reply(body)
        return f"{self.name}: {ANSWER}"


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "code": status}}, status
    )


def _usage(text: str) -> dict[str, int]:
    return {
        "prompt_tokens": 11,
        "completion_tokens": len(text.split()),
        "total_tokens": 11 + len(text.split()),
    }


def _spec_decode() -> dict[str, int]:
    return {"num_drafts": 3, "num_draft_tokens": 12, "num_accepted_tokens": 9, "num_forgiven_tokens": 1}


def _whole(route: str, script: Script, body: dict[str, Any]) -> dict[str, Any]:
    text = script.text(body)
    choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
    choice.update({"message": {"role": "assistant", "content": text}} if route == "chat" else {"text": text})
    kind = "chat.completion" if route == "chat" else "text_completion"
    return {
        "id": "cmpl-1",
        "object": kind,
        "created": 1700000000,
        "model": script.name,
        "choices": [choice],
        "usage": _usage(text),
        "spec_decode": _spec_decode(),
    }


async def _events(route: str, script: Script, body: dict[str, Any]) -> AsyncIterator[bytes]:
    text = script.text(body)
    words = text.split(" ")
    step = -(-len(words) // PIECES)
    for start in range(0, len(words), step):
        piece = " ".join(words[start : start + step]) + (" " if start + step < len(words) else "")
        choice: dict[str, Any] = {"index": 0, "finish_reason": None}
        choice.update({"delta": {"content": piece}} if route == "chat" else {"text": piece})
        yield f"data: {json.dumps({'id': 'cmpl-1', 'model': script.name, 'choices': [choice]})}\n\n".encode()
        await asyncio.sleep(script.gap_s)
    last = {
        "id": "cmpl-1",
        "model": script.name,
        "choices": [],
        "usage": _usage(text),
        "spec_decode": _spec_decode(),
    }
    yield f"data: {json.dumps(last)}\n\n".encode()
    yield b"data: [DONE]\n\n"
    await asyncio.sleep(script.linger_s)


def scripted_app(script: Script) -> FastAPI:
    """The app for ``script``: /v1/models, /v1/chat/completions, /v1/completions and /health. A body that
    is not a JSON object is answered 400; a prompt containing ``FAIL`` is answered 500."""
    app = FastAPI()

    async def answer(request: Request, route: str) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return _error("the body is not valid JSON", 400)
        if not isinstance(body, dict):
            return _error("the body must be a JSON object", 400)
        if script.record:
            script.bodies.append(body)
            script.authorizations.append(request.headers.get("authorization"))
        if "FAIL" in json.dumps(body.get("messages", body.get("prompt", ""))):
            return _error("scripted failure", 500)
        while script.hold is not None and not script.hold.is_set():  # set from another thread
            await asyncio.sleep(0.01)
        if script.delay_s:
            await asyncio.sleep(script.delay_s)
        if body.get("stream"):
            return StreamingResponse(_events(route, script, body), media_type="text/event-stream")
        return JSONResponse(_whole(route, script, body))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await answer(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer(request, "completions")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": script.name, "object": "model", "root": script.name}]}

    @app.get("/health")
    async def health() -> Response:
        return Response("ok")

    return app


if __name__ == "__main__":
    import uvicorn

    name, port, *pace = sys.argv[1:]
    delay_ms, gap_ms = (float(ms) for ms in pace) if pace else (0.0, 0.0)
    script = Script(name, delay_s=delay_ms / 1000, gap_s=gap_ms / 1000)
    uvicorn.run(scripted_app(script), host="127.0.0.1", port=int(port), log_level="error")
