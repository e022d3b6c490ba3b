"""OpenAI-style errors: the exception handlers raise, and the JSON shape every error response has."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


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
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle as their args alone; keep every field (errors come back from parse workers).
        fields = {"status": self.status, "type": self.type, "param": self.param, "code": self.code}
        return (_rebuild, (self.message, fields, self.headers))

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _rebuild(message: str, fields: dict[str, Any], headers: dict[str, str] | None) -> OpenAIError:
    return OpenAIError(message, headers=headers, **fields)


def invalid_request(exc: ValueError) -> OpenAIError:
    """A 400 for a ValueError from SamplingParams or the engine; flyspec messages start with the field
    ("top_p=0.0: must be in (0, 1]"), which becomes `param`."""
    message = str(exc)
    head = message.split("=", 1)[0]
    return OpenAIError(message, param=head if "=" in message and head.isidentifier() else None)


class ErrorDetail(BaseModel):
    """What went wrong: `param` names the offending request field when there is one."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error response (documented in the OpenAPI schema)."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for the given error statuses, all with the ErrorResponse body."""
    descriptions = {
        400: "Bad input: the message names the field, its value and the rule (`param` holds the field).",
        401: "Missing or wrong API key (send `Authorization: Bearer KEY`).",
        404: "No such model is served here (`code`: model_not_found).",
        408: "The request body did not arrive within the server's --request-read-timeout.",
        413: "The request body is larger than the server's --max-request-bytes.",
        500: "The engine failed while serving the request.",
        503: "The engine loop is not running (shutting down).",
    }
    return {status: {"model": ErrorResponse, "description": descriptions[status]} for status in statuses}
