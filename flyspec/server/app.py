"""The FastAPI app: OpenAI-compatible routes, /health and /metrics (SPEC 8).

Handlers parse and validate, tokenize, and hand token ids to the engine loop; they never touch the engine.
Every error leaves as OpenAI-style JSON: 400 for bad input, 401 for a bad key, 500 when the engine fails,
503 while shutting down.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from flyspec.chat import render_chat
from flyspec.outputs import RequestOutput
from flyspec.sampling_params import SamplingParams
from flyspec.server.engine_loop import EngineLoop, RequestStream
from flyspec.server.metrics import ServerMetrics
from flyspec.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    chat_json,
    completion_json,
    invalid_request,
    parse_body,
    spec_decode_json,
    usage_json,
)
from flyspec.server.streaming import EngineStreamResponse, chat_events, completion_events

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions


class ServerState:
    """What the handlers share: the engine loop, a private tokenizer, limits and names."""

    def __init__(self, engine: Any, served_model_name: str, api_key: str | None) -> None:
        self.served_model_name = served_model_name
        self.api_key = api_key
        # A copy of our own: the engine thread detokenizes with its tokenizer while handlers encode.
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.vocab_size = int(engine.vocab_size)
        self.max_model_len = int(engine.max_model_len)
        num_spec = len(engine.stats.accepted_per_position)  # K, or 0 without speculation
        self.metrics = ServerMetrics(num_spec, bool(engine.is_lossy))
        self.engine_loop = EngineLoop(engine, self.metrics)
        self.created = int(time.time())


def build_app(engine: Any, *, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """An app serving `engine` (an LLMEngine) under `served_model_name`.

    With `api_key`, every /v1 route needs `Authorization: Bearer <api_key>`; /health and /metrics stay
    open (probes and scrapers). The engine loop thread starts and stops with the app's lifespan.
    """
    state = ServerState(engine, served_model_name, api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine_loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.engine_loop.stop)

    app = FastAPI(title="flyspec", lifespan=lifespan)
    app.state.flyspec = state
    _install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        if not state.engine_loop.alive:
            return _error_response(
                OpenAIError("the engine loop is not running", status=503, type="server_error")
            )
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(_v1_router(state))
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> Response:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return _error_response(OpenAIError(f"{param}: {first.get('msg', 'invalid request')}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return _error_response(OpenAIError(str(exc.detail), status=exc.status_code, type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return _error_response(OpenAIError(f"internal error: {exc}", status=500, type="server_error"))


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _v1_router(state: ServerState) -> APIRouter:
    async def check_api_key(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), state.api_key):
            raise OpenAIError(
                "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                status=401,
                code="invalid_api_key",
            )

    router = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @router.get("/models")
    async def models() -> Response:
        card = {
            "id": state.served_model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "flyspec",
            "max_model_len": state.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @router.post("/completions")
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = parse_body(CompletionRequest, await request.body())
        req.check()
        _check_model(state, req.model)
        prompts = [_prompt_ids(state, p) for p in req.prompts()]
        params = [_sampling_params(state, req, len(ids), req.max_tokens, chat=False) for ids in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await _submit(state, request_id, prompts, params, arrival)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            events = completion_events(
                request_id, state.served_model_name, stream, params[0].stop, include_usage
            )
            return EngineStreamResponse(events, stream)
        finals = await _collect(stream, request)
        outs = [finals[i] for i in range(len(prompts))]
        body = completion_json(
            request_id,
            state.served_model_name,
            [{"text": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason} for o in outs],
            usage_json(outs),
            spec_decode_json([o.metrics for o in outs]),
        )
        return JSONResponse(body)

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req = parse_body(ChatCompletionRequest, await request.body())
        req.check()
        _check_model(state, req.model)
        ids = _chat_prompt_ids(state, req)
        params = [_sampling_params(state, req, len(ids), req.requested_max_tokens(), chat=True)]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await _submit(state, request_id, [ids], params, arrival)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            events = chat_events(request_id, state.served_model_name, stream, params[0].stop, include_usage)
            return EngineStreamResponse(events, stream)
        out = (await _collect(stream, request))[0]
        body = chat_json(
            request_id,
            state.served_model_name,
            out.outputs[0].text,
            out.outputs[0].finish_reason,
            usage_json([out]),
            spec_decode_json(out.metrics),
        )
        return JSONResponse(body)

    return router


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.served_model_name:
        raise OpenAIError(
            f"model '{model}' is not served here; this server serves '{state.served_model_name}'",
            param="model",
            code="model_not_found",
        )


def _prompt_ids(state: ServerState, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        ids = state.tokenizer.encode(prompt, add_special_tokens=True) if prompt else []
    else:
        bad = [t for t in prompt if not 0 <= t < state.vocab_size]
        if bad:
            raise OpenAIError(
                f"prompt: token id {bad[0]} is outside the vocabulary [0, {state.vocab_size})",
                param="prompt",
            )
        ids = list(prompt)
    if not ids:
        raise OpenAIError("prompt: must not be empty", param="prompt")
    return ids


def _chat_prompt_ids(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        ids, _ = render_chat(state.tokenizer, messages)
    except ValueError as exc:
        raise OpenAIError(f"messages: {exc}", param="messages") from None
    return ids


def _sampling_params(
    state: ServerState,
    req: CompletionRequest | ChatCompletionRequest,
    prompt_len: int,
    max_tokens: int | None,
    *,
    chat: bool,
) -> SamplingParams:
    room = state.max_model_len - prompt_len
    if room < 1:
        raise OpenAIError(
            f"the prompt is {prompt_len} tokens, which leaves no room to generate within "
            f"max_model_len={state.max_model_len}",
            param="messages" if chat else "prompt",
            code="context_length_exceeded",
        )
    name = "max_completion_tokens" if chat and req.max_tokens is None else "max_tokens"
    if max_tokens is None:
        max_tokens = room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    elif max_tokens < 1:
        raise OpenAIError(f"{name}={max_tokens}: must be at least 1", param=name)
    elif max_tokens > room:
        raise OpenAIError(
            f"{name}={max_tokens} is too large: the prompt is {prompt_len} tokens and "
            f"max_model_len={state.max_model_len}, so at most {room} tokens can be generated",
            param=name,
            code="context_length_exceeded",
        )
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            max_tokens=max_tokens,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            verification=req.verification,
        )
    except ValueError as exc:
        raise invalid_request(exc) from None


async def _submit(
    state: ServerState,
    request_id: str,
    prompts: list[list[int]],
    params: list[SamplingParams],
    arrival: float,
) -> RequestStream:
    # One engine request per choice; a single-choice request keeps the response id as its engine id.
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    return await state.engine_loop.submit(list(zip(ids, prompts, params, strict=True)), arrival)


async def _collect(stream: RequestStream, request: Request) -> dict[int, RequestOutput]:
    """Wait for every choice to finish; abort them all if the client hangs up first."""

    async def drain() -> dict[int, RequestOutput]:
        finals: dict[int, RequestOutput] = {}
        async for index, out in stream:
            if out.finished:
                finals[index] = out
        return finals

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(drain())
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        raise OpenAIError("the client disconnected", status=499)
    finally:
        work.cancel()
        watch.cancel()
        stream.close()
