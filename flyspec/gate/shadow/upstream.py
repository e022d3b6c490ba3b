"""One upstream (an endpoint arm): its connection pool, its base URLs taken in turn, and the headers a
forwarded request keeps."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from flyspec.gate.arms.endpoint import OpenAIArm

# Hop-by-hop headers (RFC 9110 7.6.1) and those the HTTP layer sets itself are never copied across.
_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}
# Answers travel uncompressed from the upstream so the proxy can read the text it passes through.
_REQUEST_DROP = _HOP | {"accept-encoding"}
_RESPONSE_DROP = _HOP | {"date", "server"}


def request_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """A client's request headers as forwarded upstream (authorization and content-type kept)."""
    out = {k: v for k, v in headers.items() if k.lower() not in _REQUEST_DROP}
    out["accept-encoding"] = "identity"
    return out


def response_headers(headers: httpx.Headers) -> dict[str, str]:
    """An upstream's response headers as passed back to the client (content-type kept)."""
    return {k: v for k, v in headers.items() if k.lower() not in _RESPONSE_DROP}


class Upstream:
    """An endpoint arm's connection pool (one ``httpx.AsyncClient``; ``connections`` None: unbounded) and
    its base URLs, used in turn."""

    def __init__(self, arm: OpenAIArm, connections: int | None) -> None:
        self.arm = arm
        self._next = itertools.cycle(arm.base_urls)
        keepalive = connections if connections is not None else 1024
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(arm.timeout, connect=min(arm.timeout, 10.0)),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=keepalive),
            headers={"Authorization": f"Bearer {arm.api_key}"} if arm.api_key else None,
        )

    def url(self, route: str) -> str:
        """The next base URL joined with ``route`` (``/chat/completions``, ``/models``)."""
        return next(self._next) + route

    def body(self, request: Mapping[str, object]) -> dict[str, object]:
        """A request as this arm is asked it when the shadow process asks it itself: the arm's model and
        extra fields, answered whole (not streamed)."""
        out = {k: v for k, v in request.items() if k not in ("stream", "stream_options")}
        return {**out, "model": self.arm.model, **self.arm.extra_body}

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self.client.aclose()
