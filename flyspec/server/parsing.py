"""Request bodies to validated requests: one function that runs on a worker thread, or for large bodies
in the worker process (flyspec/server/workers.py), and returns everything the handler needs.

Besides parsing (flyspec/server/protocol.py) it names the fields without effect and runs each request's
own checks, so the answer that comes back is small: the request, or the 400 it earned, and the names for
the ignored-fields header. From the worker process the request comes back without the values of fields
that have no effect (unknown fields, `metadata`), which a client could make arbitrarily many.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel

from flyspec.server.errors import OpenAIError
from flyspec.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    ignored_fields,
    parse_body,
)
from flyspec.server.workers import lower_priority

Kind = Literal["completion", "chat", "tokenize", "detokenize"]

_MODELS: dict[str, type[BaseModel]] = {
    "completion": CompletionRequest,
    "chat": ChatCompletionRequest,
    "detokenize": DetokenizeRequest,
}


@dataclass
class Parsed:
    """A parsed body: the request, or the error it earned (400), and the fields it sent without effect
    (`unknown`: not recognised; `unused`: recognised, changing nothing in this request)."""

    request: BaseModel | None = None
    error: OpenAIError | None = None
    unknown: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)


def parse_request(kind: Kind, body: bytes, max_messages: int, compact: bool = False) -> Parsed:
    """Parse and check a body of the given route kind. `compact`: drop the values of fields without
    effect (for the trip back from the worker process)."""
    try:
        model = _model_of(kind, body)
        request = parse_body(model, body)
    except OpenAIError as exc:
        return Parsed(error=exc)
    parsed = Parsed(request, unknown=ignored_fields(request))
    if isinstance(request, CompletionRequest | ChatCompletionRequest):
        parsed.unused = [name for name in request.unused_fields() if name not in parsed.unknown]
    try:
        _check(request, max_messages)
    except OpenAIError as exc:
        parsed.error = exc
        parsed.request = None
    if compact and parsed.request is not None:
        _drop_unused_values(parsed.request)
    return parsed


def parse_in_worker(kind: Kind, body: bytes, max_messages: int) -> Parsed:
    """parse_request for the worker process (flyspec/server/workers.py): compact, at the lowest CPU
    priority."""
    lower_priority()
    return parse_request(kind, body, max_messages, compact=True)


def _model_of(kind: Kind, body: bytes) -> type[BaseModel]:
    if kind != "tokenize":
        return _MODELS[kind]
    try:
        is_chat = isinstance(data := json.loads(body), dict) and "messages" in data
    except (ValueError, RecursionError):
        is_chat = False  # parse_body reports the syntax error
    return TokenizeChatRequest if is_chat else TokenizeCompletionRequest


def _check(request: BaseModel, max_messages: int) -> None:
    if isinstance(request, CompletionRequest):
        request.check()
    elif isinstance(request, ChatCompletionRequest):
        request.check(max_messages=max_messages)
    elif isinstance(request, TokenizeChatRequest) and not request.add_generation_prompt:
        raise OpenAIError("add_generation_prompt=false is not supported", param="add_generation_prompt")


def _drop_unused_values(model: BaseModel) -> None:
    object.__setattr__(model, "__pydantic_extra__", {})
    if isinstance(model, CompletionRequest | ChatCompletionRequest) and model.metadata is not None:
        model.metadata = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                _drop_unused_values(item)
