"""OpenAI-compatible request models, their validation, and the response bodies.

Request bodies are parsed strictly (no string-to-number coercion, unknown fields rejected) so that a typo
such as `"top-k"` or a number sent as a string fails loudly instead of silently decoding differently.
Responses are plain dicts in the OpenAI wire format plus one extension, `spec_decode`, carrying the
request's acceptance counters.
"""

from __future__ import annotations

import time
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flyspec.outputs import RequestMetrics, RequestOutput


class OpenAIError(Exception):
    """An error answered as OpenAI-style JSON: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_request(exc: ValueError) -> OpenAIError:
    """A 400 for a ValueError from SamplingParams or the engine; flyspec messages start with the field
    ("top_p=0.0: must be in (0, 1]"), which becomes `param`."""
    message = str(exc)
    head = message.split("=", 1)[0]
    return OpenAIError(message, param=head if "=" in message and head.isidentifier() else None)


class StreamOptions(BaseModel):
    """`stream_options`: only `include_usage` (a final chunk with token usage) is defined."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions, including the flyspec/vLLM extensions."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None  # None = the served model, so `curl` users can omit it
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension; 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension (as in vLLM)
    ignore_eos: bool = False  # extension (as in vLLM), for benchmarks that need fixed lengths
    verification: Literal["standard", "fly"] | None = None  # extension: "standard" forces lossless
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an opaque end-user id; accepted and not used

    def _reject_unsupported(self) -> None:
        """Fields the OpenAI API defines but this engine does not implement: refuse non-default values."""
        if self.n != 1:
            raise OpenAIError(f"n={self.n} is not supported: only n=1", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0.0):
                raise OpenAIError(f"{name}={value} is not supported: only 0", param=name)
        if self.logit_bias:
            raise OpenAIError("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options is only allowed when stream=true", param="stream_options")


class CompletionRequest(_SamplingFields):
    """Body of POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        """Raise OpenAIError for values this server does not support."""
        self._reject_unsupported()
        if self.echo:
            raise OpenAIError("echo=true is not supported", param="echo")
        if self.logprobs is not None:
            raise OpenAIError("logprobs are not supported", param="logprobs")
        if self.best_of not in (None, 1):
            raise OpenAIError(f"best_of={self.best_of} is not supported: only 1", param="best_of")
        if self.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids), one choice each."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError("prompt must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    """One `{"type": "text", "text": ...}` element of a message's content list."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; content is text or a list of text parts (images are not supported)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The message content as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None

    def check(self) -> None:
        """Raise OpenAIError for values this server does not support."""
        self._reject_unsupported()
        if self.logprobs:
            raise OpenAIError("logprobs are not supported", param="logprobs")
        if self.top_logprobs is not None:
            raise OpenAIError("top_logprobs is not supported", param="top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise OpenAIError(
                "set max_tokens or max_completion_tokens, not both", param="max_completion_tokens"
            )

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (the current OpenAI name) or max_tokens (the older one)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


_Body = TypeVar("_Body", bound=BaseModel)

# What a union-typed field accepts, said once instead of one pydantic error per union member.
_UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "content": 'a string or a list of {"type": "text", "text": ...} parts',
}


def parse_body(model: type[_Body], body: bytes) -> _Body:
    """Parse and validate a JSON request body; every problem becomes a 400 OpenAIError naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: ValidationError) -> OpenAIError:
    err = exc.errors()[0]
    kind = err["type"]
    if kind == "json_invalid":
        return OpenAIError(f"request body is not valid JSON: {err['msg']}", code="invalid_json")
    if kind == "model_type" and not err["loc"]:
        return OpenAIError("request body must be a JSON object", code="invalid_json")
    # A union member's loc carries its type name (e.g. 'list[int]'); keep field names and indexes only.
    path: list[str] = []
    for part in err["loc"]:
        if isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool")):
            continue
        path.append(str(part))
    param = ".".join(path) or None
    field = next((p for p in reversed(path) if not p.isdigit()), "")
    if kind == "extra_forbidden":
        return OpenAIError(f"unknown or unsupported field '{param}'", param=param)
    if kind == "missing":
        return OpenAIError(f"field '{param}' is required", param=param)
    if field in _UNION_FIELDS and len(exc.errors()) > 1:
        return OpenAIError(f"{param}: must be {_UNION_FIELDS[field]}", param=param)
    return OpenAIError(f"{param}: {err['msg']}", param=param)


def spec_decode_json(metrics: RequestMetrics | list[RequestMetrics]) -> dict[str, int]:
    """The `spec_decode` response extension: acceptance counters summed over the request's choices."""
    items = metrics if isinstance(metrics, list) else [metrics]
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_forgiven_tokens")
    return {k: sum(int(getattr(m, k)) for m in items) for k in keys}


def usage_json(outputs: list[RequestOutput]) -> dict[str, int]:
    """The OpenAI `usage` object, summed over the choices' final outputs."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_json(
    request_id: str,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, int],
    spec_decode: dict[str, int],
    created: int | None = None,
) -> dict[str, Any]:
    """A non-streaming /v1/completions response; choices are `{"text", "finish_reason"}` dicts."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [
            {"index": i, "text": c["text"], "logprobs": None, "finish_reason": c["finish_reason"]}
            for i, c in enumerate(choices)
        ],
        "usage": usage,
        "spec_decode": spec_decode,
    }


def chat_json(
    request_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage: dict[str, int],
    spec_decode: dict[str, int],
    created: int | None = None,
) -> dict[str, Any]:
    """A non-streaming /v1/chat/completions response."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created if created is not None else int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage,
        "spec_decode": spec_decode,
    }
