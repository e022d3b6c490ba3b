"""The record of one mirrored request: what both arms answered, how fast, at what cost."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from flyspec.outputs import AcceptanceCounts

PROXY = "proxy"
"""A pair whose baseline answer is the one the proxy passed to the client."""
MIRROR = "mirror"
"""A pair from a mirror-sink copy: the shadow process asked both arms itself."""


@dataclass(frozen=True)
class ArmAnswer:
    """One arm's answer to a mirrored request. An error or timeout is an answer too (``error`` set,
    ``text`` None): the gate scores it as wrong, so it is recorded, never dropped."""

    text: str | None
    status: int | None
    latency_s: float
    error: str | None = None
    finish_reason: str | None = None
    first_token_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    acceptance: AcceptanceCounts | None = None
    streamed: bool = False

    @property
    def ok(self) -> bool:
        """True when the arm answered with text (HTTP 200 and a completion)."""
        return self.error is None and self.text is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields; the acceptance counters as their dict, or None where not reported."""
        out = asdict(self)
        out["acceptance"] = self.acceptance.to_dict() if self.acceptance is not None else None
        return out


def failed(error: str, latency_s: float, status: int | None = None) -> ArmAnswer:
    """The answer of an arm that errored or timed out."""
    return ArmAnswer(text=None, status=status, latency_s=latency_s, error=error)


@dataclass(frozen=True)
class MirroredPair:
    """One request answered by both arms: the request body as stored (redacted), where it came from
    (``PROXY`` or ``MIRROR``), its route (``/chat/completions`` or ``/completions``), when it was
    received (Unix time), and the two answers (texts redacted)."""

    received_at: float
    source: str
    route: str
    request: dict[str, Any]
    baseline: ArmAnswer
    candidate: ArmAnswer

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return {
            "received_at": self.received_at,
            "source": self.source,
            "route": self.route,
            "request": self.request,
            "baseline": self.baseline.to_dict(),
            "candidate": self.candidate.to_dict(),
        }
