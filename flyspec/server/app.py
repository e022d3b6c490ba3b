"""The FastAPI app: OpenAI-compatible routes, vLLM's utility routes, /health and /metrics.

Handlers read the body (bounded by --max-request-bytes and --request-read-timeout), then parse and validate
it, tokenise and compile its grammar on the worker lanes (flyspec/server/workers.py: nothing heavy runs on
the event loop), and hand token ids to the engine loop; they never touch the engine (the grammar cache of
flyspec/engine/structured.py is the one part they share: it is thread-safe, and compiling there first
spares the engine thread). Every error leaves as OpenAI-style JSON: 400 for bad input, 401 for a bad
key, 408 for a body that did not arrive in time, 413 for a body over the limit, 500 when the engine
fails, 503 while shutting down; an unexpected exception in a handler is a 500 that keeps the connection
open. docs/server.md describes the routes, fields and bounds.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import importlib.metadata
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flyspec.outputs import RequestOutput
from flyspec.sampling_params import SamplingParams
from flyspec.server.body import read_body
from flyspec.server.choices import ChoiceShaper, Echo
from flyspec.server.constraints import Constraint, constraint_of
from flyspec.server.engine_contract import ServedEngine
from flyspec.server.engine_loop import EngineLoop, RequestStream
from flyspec.server.errors import OpenAIError, error_responses
from flyspec.server.limits import (
    DEFAULT_GRAMMAR_TIMEOUT_S,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_REQUEST_READ_TIMEOUT_S,
)
from flyspec.server.metrics import ServerMetrics
from flyspec.server.openapi import install_openapi, json_body
from flyspec.server.parsing import Kind, parse_in_worker, parse_request
from flyspec.server.prompts import PromptEncoder
from flyspec.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from flyspec.server.request_params import sampling_params
from flyspec.server.responses import chat_json, completion_json, spec_decode_json, usage_json
from flyspec.server.streaming import EngineStreamResponse, chat_events, completion_events
from flyspec.server.tokenizer_info import tokenize_json, tokenizer_info
from flyspec.server.tool_calls import ToolCallFormat
from flyspec.server.workers import LARGE_BODY_BYTES, GrammarTimeout, Lane, Workers

logger = logging.getLogger(__name__)

IGNORED_FIELDS_HEADER = "x-flyspec-ignored-fields"
_MAX_NAMES_IN_HEADER = 32
_HTTP_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")

_V1_ERRORS = error_responses(400, 401, 408, 413, 500, 503)
_TOKENIZER_ERRORS = error_responses(400, 401, 408, 413)
_STREAM_OR_JSON = {
    200: {"content": {"text/event-stream": {}}, "description": "JSON, or SSE with stream=true"}
}


def flyspec_version() -> str:
    """The installed flyspec version ("unknown" when running from a source tree without metadata)."""
    try:
        return importlib.metadata.version("flyspec")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class ServerState:
    """What the handlers share: the engine loop, the worker lanes, the prompt encoder, the grammar cache,
    limits and names."""

    def __init__(
        self,
        engine: ServedEngine,
        served_model_name: str,
        api_key: str | None,
        max_request_bytes: int,
        model_root: str,
        request_read_timeout_s: float,
        grammar_timeout_s: float,
    ) -> None:
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.request_read_timeout_s = request_read_timeout_s
        self.model_root = model_root
        self.vocab_size = int(engine.vocab_size)
        self.max_model_len = int(engine.max_model_len)
        self.workers = Workers(grammar_timeout_s)
        # A tokenizer copy of our own: the engine thread detokenizes with its tokenizer while we encode.
        tokenizer = copy.deepcopy(engine.tokenizer)
        self.encoder = PromptEncoder(tokenizer, self.vocab_size, self.max_model_len, self.workers)
        self.tokenizer_info = tokenizer_info(tokenizer)
        self.grammars = engine.grammars
        num_spec = len(engine.stats.accepted_per_position)  # K, or 0 without speculation
        self.metrics = ServerMetrics(
            served_model_name, num_spec, bool(engine.is_lossy), int(engine.max_running)
        )
        self.engine_loop = EngineLoop(engine, self.metrics)
        self.created = int(time.time())
        # OpenAI's system_fingerprint identifies the backend configuration: same value, same engine setup.
        config = f"{flyspec_version()}|{engine.config!r}"
        self.system_fingerprint = "fp_" + hashlib.sha256(config.encode()).hexdigest()[:12]


def build_app(
    engine: ServedEngine,
    *,
    served_model_name: str,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    model_root: str | None = None,
    request_read_timeout_s: float = DEFAULT_REQUEST_READ_TIMEOUT_S,
    grammar_timeout_s: float = DEFAULT_GRAMMAR_TIMEOUT_S,
) -> FastAPI:
    """An app serving `engine` (an LLMEngine) under `served_model_name`.

    With `api_key`, every /v1 route and /tokenize, /detokenize, /tokenizer_info need `Authorization: Bearer
    <api_key>`; /health, /ping, /version and /metrics stay open (probes and scrapers). Bodies over
    `max_request_bytes` get 413, bodies that take longer than `request_read_timeout_s` to arrive 408, and
    a grammar that does not compile within `grammar_timeout_s` a 400. `model_root` is the model path
    reported as `root` in /v1/models (default: the served name). The engine loop thread starts and stops
    with the app's lifespan.
    """
    _check_limits(max_request_bytes, request_read_timeout_s, grammar_timeout_s)
    state = ServerState(
        engine,
        served_model_name,
        api_key,
        max_request_bytes,
        model_root or served_model_name,
        request_read_timeout_s,
        grammar_timeout_s,
    )
    app = FastAPI(title="flyspec", version=flyspec_version(), lifespan=_lifespan(state))
    app.state.flyspec = state
    app.add_middleware(_IgnoredFieldsHeader)
    _install_error_handlers(app)
    install_openapi(
        app,
        [
            CompletionRequest,
            ChatCompletionRequest,
            TokenizeCompletionRequest,
            TokenizeChatRequest,
            DetokenizeRequest,
        ],
    )
    _add_open_routes(app, state)
    app.include_router(_tokenizer_router(state))
    app.include_router(_v1_router(state))
    return app


def _check_limits(max_request_bytes: int, request_read_timeout_s: float, grammar_timeout_s: float) -> None:
    """ValueError unless the body limit is at least 1 byte and both timeouts are positive."""
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes={max_request_bytes}: must be at least 1")
    timeouts = {"request_read_timeout_s": request_read_timeout_s, "grammar_timeout_s": grammar_timeout_s}
    for name, value in timeouts.items():
        if not value > 0:
            raise ValueError(f"{name}={value}: must be > 0")


def _lifespan(state: ServerState) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the engine loop thread runs while the app does; the worker lanes close after."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine_loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.engine_loop.stop)
            state.workers.close()

    return lifespan


def _add_open_routes(app: FastAPI, state: ServerState) -> None:
    """The routes that need no key (probes and scrapers): /health, /ping, /metrics and /version."""

    async def health() -> Response:
        if not state.engine_loop.alive:
            return _error_response(
                OpenAIError("the engine loop is not running", status=503, type="server_error")
            )
        return JSONResponse({"status": "ok"})

    # /ping is vLLM's name for the same probe (GET and POST, as vLLM answers both).
    for method, route, operation in (
        ("get", "/health", "health"),
        ("get", "/ping", "ping"),
        ("post", "/ping", "ping_post"),
    ):
        getattr(app, method)(route, operation_id=operation, responses=error_responses(503))(health)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": flyspec_version()})


class _IgnoredFieldsHeader:
    """Adds the `x-flyspec-ignored-fields` header to any response whose request carried unknown fields
    (success, stream or error alike); handlers record them in the request state."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            names = scope.get("state", {}).get("ignored_fields")
            if message["type"] == "http.response.start" and names:
                headers = list(message.get("headers", []))
                headers.append((IGNORED_FIELDS_HEADER.encode(), _name_list(names).encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_header)


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
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette names the methods of one route only; a path may have several
            headers["Allow"] = ", ".join(_methods_of(request.app, request.scope))
        error = OpenAIError(str(exc.detail), status=exc.status_code, type=kind, headers=headers or None)
        return _error_response(error)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return _error_response(OpenAIError(f"internal error: {exc}", status=500, type="server_error"))


def _methods_of(app: FastAPI, scope: Scope) -> list[str]:
    """Every method some route of `app` fully matches for this request's path (asked of the routes
    themselves, so mounted routers count too)."""
    return [
        method
        for method in _HTTP_METHODS
        if any(route.matches({**scope, "method": method})[0] is Match.FULL for route in app.router.routes)
    ]


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _api_key_check(state: ServerState) -> Any:
    key = state.api_key.encode() if state.api_key is not None else None

    async def check_api_key(request: Request) -> None:
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        # Headers arrive as latin-1 text; compare the raw bytes, which compare_digest accepts whatever
        # characters the client sent (it refuses non-ASCII str).
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode("latin-1"), key):
            raise OpenAIError(
                "missing or incorrect API key: send 'Authorization: Bearer <key>'",
                status=401,
                code="invalid_api_key",
            )

    return Depends(check_api_key)


def _printable(name: str) -> str:
    # Field names are client input: escape anything but visible ASCII (HTTP header values must not carry
    # control characters, nor start or end with a space); an empty name shows as "".
    return "".join(c if "!" <= c <= "~" else f"\\u{ord(c):04x}" for c in name) or '""'


def _name_list(names: list[str]) -> str:
    """The names for the header and the log line: escaped, at most _MAX_NAMES_IN_HEADER of them."""
    shown = ", ".join(_printable(n) for n in names[:_MAX_NAMES_IN_HEADER])
    more = len(names) - _MAX_NAMES_IN_HEADER
    return shown + (f", ... ({more} more)" if more > 0 else "")


async def _read_request(state: ServerState, request: Request, kind: Kind) -> tuple[Any, Lane]:
    """The request's parsed and checked body, and the worker lane for its tokenizer work. Records what
    the response's ignored-fields header names: unknown fields (also logged as a warning) and recognised
    fields that change nothing in this request (bookkeeping fields and the like)."""
    body = await read_body(request, state.max_request_bytes, state.request_read_timeout_s)
    if len(body) > LARGE_BODY_BYTES:
        parsed = await state.workers.run_in_process(parse_in_worker, kind, body, state.max_model_len)
    else:
        parsed = await state.workers.run(lambda: parse_request(kind, body, state.max_model_len))
    names = parsed.unknown + parsed.unused
    if names:
        request.state.ignored_fields = names
    if parsed.unknown:
        shown = _name_list(parsed.unknown)
        logger.warning("%s: ignoring unknown request fields: %s", request.url.path, shown)
    if parsed.error is not None:
        raise parsed.error
    return parsed.request, state.workers.lane_for(len(body))


async def _compile_grammar(state: ServerState, constraint: Constraint | None) -> None:
    """Compile the request's grammar on the grammar lane within the budget (400 naming the field when it
    does not compile, or not in time), so that the engine thread only copies the compiled matcher."""
    if constraint is None:
        return
    grammars = state.grammars
    try:
        await state.workers.compile_grammar(grammars.prepare, lambda: grammars.compile(constraint.params))
    except GrammarTimeout as exc:
        raise constraint.error(
            f"structured_outputs.{constraint.field}: the grammar did not compile within {exc.budget_s:g} s "
            "(--grammar-timeout); simplify it (nested bounded repeats such as (x{1000}){1000} expand "
            "into huge automata)"
        ) from None
    except ValueError as exc:
        raise constraint.error(str(exc)) from None


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.served_model_name:
        raise OpenAIError(
            f"model '{model}' is not served here; this server serves '{state.served_model_name}'",
            param="model",
            code="model_not_found",
        )


class _Route(APIRoute):
    """A route whose unexpected exceptions become a 500 OpenAIError, answered by the exception middleware
    like any error. Left to Starlette's outermost ServerErrorMiddleware, an exception is answered and then
    re-raised to uvicorn, which closes the connection: a client's next pooled request would be reset."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (OpenAIError, StarletteHTTPException, RequestValidationError):
                raise
            except Exception as exc:
                logger.exception("unhandled error on %s", request.url.path)
                raise OpenAIError(f"internal error: {exc}", status=500, type="server_error") from exc

        return guarded


def _tokenizer_router(state: ServerState) -> APIRouter:
    router = APIRouter(dependencies=[_api_key_check(state)], route_class=_Route)

    @router.post(
        "/tokenize",
        openapi_extra=json_body(TokenizeCompletionRequest, TokenizeChatRequest),
        responses=_TOKENIZER_ERRORS,
    )
    async def tokenize(request: Request) -> Response:
        req, lane = await _read_request(state, request, "tokenize")
        _check_model(state, req.model)
        if isinstance(req, TokenizeChatRequest):
            messages = [m.to_template() for m in req.messages]
            ids = await state.encoder.chat_ids(messages, bounded=False, lane=lane)
        else:
            special = req.add_special_tokens
            ids = await state.encoder.text_ids(req.prompt, add_special_tokens=special, lane=lane)
        strs = await state.encoder.token_strs(ids, lane) if req.return_token_strs else None
        # Rendered on the lane too: a list of a million ids is a noticeable json.dumps.
        content = await state.workers.run(lambda: tokenize_json(ids, state.max_model_len, strs), lane)
        return Response(content, media_type="application/json")

    @router.post("/detokenize", openapi_extra=json_body(DetokenizeRequest), responses=_TOKENIZER_ERRORS)
    async def detokenize(request: Request) -> Response:
        req, lane = await _read_request(state, request, "detokenize")
        _check_model(state, req.model)
        bad = next((t for t in req.tokens if not 0 <= t < state.vocab_size), None)
        if bad is not None:
            raise OpenAIError(
                f"tokens: token id {bad} is outside the vocabulary [0, {state.vocab_size})", param="tokens"
            )
        return JSONResponse({"prompt": await state.encoder.decode(req.tokens, lane)})

    @router.get("/tokenizer_info", responses=error_responses(401))
    async def get_tokenizer_info() -> Response:
        return JSONResponse(state.tokenizer_info)

    return router


def _model_card(state: ServerState) -> dict[str, Any]:
    return {
        "id": state.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "flyspec",
        "root": state.model_root,
        "parent": None,
        "max_model_len": state.max_model_len,
    }


def _v1_router(state: ServerState) -> APIRouter:
    """The /v1 routes: models, completions and chat completions, all behind the API key."""
    router = APIRouter(prefix="/v1", dependencies=[_api_key_check(state)], route_class=_Route)
    _add_model_routes(router, state)
    _add_completions_route(router, state)
    _add_chat_completions_route(router, state)
    return router


def _add_model_routes(router: APIRouter, state: ServerState) -> None:
    """GET /models and /models/{model_id}: the one model served."""

    @router.get("/models", responses=error_responses(401))
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(state)]})

    # `:path` so that ids with slashes ("Qwen/Qwen2.5-Coder-1.5B-Instruct") match, as in vLLM.
    @router.get("/models/{model_id:path}", responses=error_responses(401, 404))
    async def model(model_id: str) -> Response:
        if model_id != state.served_model_name:
            raise OpenAIError(
                f"model '{model_id}' is not served here; this server serves '{state.served_model_name}'",
                status=404,
                param="model",
                code="model_not_found",
            )
        return JSONResponse(_model_card(state))


def _add_completions_route(router: APIRouter, state: ServerState) -> None:
    """POST /completions: one choice per prompt and sample, as JSON or as server-sent events."""

    @router.post(
        "/completions",
        openapi_extra=json_body(CompletionRequest),
        responses={**_STREAM_OR_JSON, **_V1_ERRORS},
    )
    async def completions(request: Request) -> Response:
        arrival = time.monotonic()
        req, lane = await _read_request(state, request, "completion")
        _check_model(state, req.model)
        constraint = constraint_of(req)
        texts = req.prompts()
        prompts = [
            await state.encoder.prompt_ids(p, add_special_tokens=req.add_special_tokens, lane=lane)
            for p in texts
        ]
        params = [_sampling_params(state, req, ids, constraint) for ids in prompts]
        await _compile_grammar(state, constraint)
        echo = await _echoes(state, texts, prompts, lane) if req.echo else None
        shaper = ChoiceShaper(
            params[0],
            state.encoder.decode,
            logprobs=req.logprobs,
            prompt_logprobs=req.prompt_logprobs is not None,
            echo=echo,
        )
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await _submit(state, request_id, prompts, params, arrival, constraint)
        if req.stream:
            events = completion_events(
                request_id,
                state.served_model_name,
                state.system_fingerprint,
                stream,
                shaper,
                req.include_usage,
            )
            return EngineStreamResponse(events, stream)
        return await _completion_response(state, request, request_id, stream, shaper, len(prompts))


async def _echoes(
    state: ServerState, texts: list[str | list[int]], prompts: list[list[int]], lane: Lane
) -> list[Echo]:
    """What echo=true puts before the choices of each prompt."""
    return [
        Echo(
            text if isinstance(text, str) else await state.encoder.decode(ids, lane),
            (await state.encoder.token_texts(ids[:1]))[0],
        )
        for text, ids in zip(texts, prompts, strict=True)
    ]


async def _completion_response(
    state: ServerState,
    request: Request,
    request_id: str,
    stream: RequestStream,
    shaper: ChoiceShaper,
    num_prompts: int,
) -> Response:
    """The non-streamed completion, once every choice has finished."""
    finals = await _collect(stream, request)
    outs = [finals[i] for i in range(num_prompts)]
    choices = [await shaper.completion_choice(p, out, s) for p, out in enumerate(outs) for s in out.outputs]
    body = completion_json(
        request_id,
        state.served_model_name,
        choices,
        usage_json(outs),
        spec_decode_json([o.metrics for o in outs]),
        state.system_fingerprint,
    )
    return JSONResponse(body)


def _add_chat_completions_route(router: APIRouter, state: ServerState) -> None:
    """POST /chat/completions: one conversation's samples, as JSON or as server-sent events."""

    @router.post(
        "/chat/completions",
        openapi_extra=json_body(ChatCompletionRequest),
        responses={**_STREAM_OR_JSON, **_V1_ERRORS},
    )
    async def chat_completions(request: Request) -> Response:
        arrival = time.monotonic()
        req, lane = await _read_request(state, request, "chat")
        _check_model(state, req.model)
        tool_format = ToolCallFormat.of(req)
        constraint = constraint_of(req, tool_format)
        ids = await state.encoder.chat_ids(req.template_messages(), tools=req.template_tools(), lane=lane)
        params = [_sampling_params(state, req, ids, constraint)]
        await _compile_grammar(state, constraint)
        shaper = ChoiceShaper(
            params[0],
            state.encoder.decode,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            prompt_logprobs=req.prompt_logprobs is not None,
            tool_format=tool_format,
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await _submit(state, request_id, [ids], params, arrival, constraint)
        if req.stream:
            events = chat_events(
                request_id,
                state.served_model_name,
                state.system_fingerprint,
                stream,
                shaper,
                req.include_usage,
            )
            return EngineStreamResponse(events, stream)
        return await _chat_response(state, request, request_id, stream, shaper)


async def _chat_response(
    state: ServerState, request: Request, request_id: str, stream: RequestStream, shaper: ChoiceShaper
) -> Response:
    """The non-streamed chat completion, once every sample has finished."""
    out = (await _collect(stream, request))[0]
    body = chat_json(
        request_id,
        state.served_model_name,
        [await shaper.chat_choice(sample) for sample in out.outputs],
        usage_json([out]),
        spec_decode_json(out.metrics),
        state.system_fingerprint,
        shaper.vllm_prompt_logprobs(out),
    )
    return JSONResponse(body)


def _sampling_params(
    state: ServerState,
    req: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    constraint: Constraint | None,
) -> SamplingParams:
    if len(prompt_ids) >= state.max_model_len:
        raise state.encoder.too_long(
            len(prompt_ids), "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        )
    return sampling_params(
        req,
        prompt_len=len(prompt_ids),
        max_model_len=state.max_model_len,
        vocab_size=state.vocab_size,
        structured=constraint.params if constraint is not None else None,
    )


async def _submit(
    state: ServerState,
    request_id: str,
    prompts: list[list[int]],
    params: list[SamplingParams],
    arrival: float,
    constraint: Constraint | None,
) -> RequestStream:
    # One engine request per prompt; a single-prompt request keeps the response id as its engine id.
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    try:
        stream = await state.engine_loop.submit(list(zip(ids, prompts, params, strict=True)), arrival)
    except OpenAIError as exc:
        # A grammar that does not compile is found by the engine, in its own field names.
        raise (constraint.rename(exc) if constraint is not None else exc) from None
    if constraint is not None:
        stream.translate_error = constraint.runtime_error
    return stream


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
