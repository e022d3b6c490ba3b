"""Reading a request body with a size bound: a body over the limit is refused with 413 before it is read
(from its Content-Length) or as soon as the bytes received pass the limit (chunked uploads)."""

from __future__ import annotations

from fastapi import Request

from flyspec.server.errors import OpenAIError


def _too_large(size: int | None, limit: int) -> OpenAIError:
    what = f"{size} bytes" if size is not None else "larger than that"
    return OpenAIError(
        f"the request body is too large: this server accepts at most {limit} bytes (--max-request-bytes) "
        f"and this one is {what}",
        status=413,
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body of `request`, at most `limit` bytes; OpenAIError 413 beyond that."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise OpenAIError(f"the Content-Length header {declared!r} is not a number of bytes")
        if int(declared) > limit:
            raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise _too_large(None, limit)
        chunks.append(chunk)
    return b"".join(chunks)
