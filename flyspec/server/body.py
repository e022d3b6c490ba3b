"""Reading a request body with a size bound and a deadline.

A body over the limit is refused with 413 before it is read (from its Content-Length) or as soon as the
bytes received pass the limit (chunked uploads). The whole body must arrive within the read timeout, or
the request gets 408: uvicorn bounds the wait for the next request on a connection (keep-alive) but not
the wait for a body, so a body shorter than its Content-Length, or one trickled a byte at a time, would
hold its handler forever. A client that leaves while sending its body ends the request quietly (its
answer cannot be delivered anyway).
"""

from __future__ import annotations

import anyio
from fastapi import Request
from starlette.requests import ClientDisconnect

from flyspec.server.errors import OpenAIError

# A token id, a Content-Length: no number the server reads needs more digits (2**63 has 19).
MAX_DIGITS = 19


def _too_large(size: int | None, limit: int) -> OpenAIError:
    what = f"{size} bytes" if size is not None else "larger than that"
    return OpenAIError(
        f"the request body is too large: this server accepts at most {limit} bytes (--max-request-bytes) "
        f"and this one is {what}",
        status=413,
        code="request_too_large",
    )


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body of `request`, at most `limit` bytes, received within `timeout_s` seconds;
    OpenAIError 413 beyond the limit, 408 past the deadline, 499 when the client left."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise OpenAIError(f"the Content-Length header {declared[:40]!r} is not a number of bytes")
        digits = declared.lstrip("0") or "0"
        if len(digits) > MAX_DIGITS or int(digits) > limit:
            raise _too_large(int(digits) if len(digits) <= MAX_DIGITS else None, limit)
    chunks: list[bytes] = []
    received = 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                received += len(chunk)
                if received > limit:
                    raise _too_large(None, limit)
                chunks.append(chunk)
    except TimeoutError:
        expected = f" of the {declared} its Content-Length announced" if declared is not None else ""
        raise OpenAIError(
            f"the request body did not arrive within {timeout_s:g} s (--request-read-timeout): "
            f"{received} bytes arrived{expected}",
            status=408,
            code="request_timeout",
            # The rest of the body may still come: the connection cannot carry another request.
            headers={"Connection": "close"},
        ) from None
    except ClientDisconnect:
        raise OpenAIError("the client disconnected while sending its request", status=499) from None
    return b"".join(chunks)
