"""Read an arm's answer text, token counts and acceptance counters from an OpenAI response body, whole
(JSON) or streamed (server-sent events, assembled chunk by chunk as the client received them)."""

from __future__ import annotations

import json

from flyspec.checks import is_int
from flyspec.gate.arms.endpoint import read_acceptance
from flyspec.gate.shadow.pairs import ArmAnswer, failed

CHAT = "/chat/completions"
COMPLETIONS = "/completions"


def _choice_text(route: str, choice: dict[str, object], streamed: bool) -> str:
    if route == COMPLETIONS:
        return choice.get("text") or ""
    part = choice.get("delta" if streamed else "message") or {}
    return part.get("content") or ""


def _tokens(usage: object, key: str) -> int | None:
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if is_int(value, 0) else None


def from_json(route: str, status: int, body: bytes, latency_s: float) -> ArmAnswer:
    """The answer in a whole (non-streamed) response; an error answer for a non-200 status or a body that
    is not an OpenAI completion."""
    if status != 200:
        return failed(f"HTTP {status}: {body[:300].decode('utf-8', 'replace')}", latency_s, status)
    try:
        data = json.loads(body)
        choice = data["choices"][0]
        text = _choice_text(route, choice, streamed=False)
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        return failed(f"not an OpenAI completion ({type(exc).__name__})", latency_s, status)
    usage = data.get("usage")
    return ArmAnswer(
        text=text,
        status=status,
        latency_s=latency_s,
        finish_reason=choice.get("finish_reason"),
        prompt_tokens=_tokens(usage, "prompt_tokens"),
        completion_tokens=_tokens(usage, "completion_tokens"),
        acceptance=read_acceptance(data)[0],
    )


def _events(body: bytes) -> list[dict[str, object]]:
    """The JSON objects of the `data:` lines of an event stream (`[DONE]` and comments left out)."""
    events = []
    for line in body.decode("utf-8", "replace").splitlines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload and payload != "[DONE]":
            event = json.loads(payload)
            if isinstance(event, dict):
                events.append(event)
    return events


def from_stream(
    route: str, status: int, body: bytes, latency_s: float, first_token_s: float | None
) -> ArmAnswer:
    """The answer assembled from a streamed response's events: the first choice's text pieces in order,
    the finish reason, and usage and acceptance counters from whichever event carries them."""
    if status != 200:
        return failed(f"HTTP {status}: {body[:300].decode('utf-8', 'replace')}", latency_s, status)
    try:
        events = _events(body)
    except ValueError as exc:
        return failed(f"an event is not JSON ({exc})", latency_s, status)
    pieces: list[str] = []
    finish = usage = acceptance = None
    for event in events:
        choices = event.get("choices") or []
        for choice in choices:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                pieces.append(_choice_text(route, choice, streamed=True))
                finish = choice.get("finish_reason") or finish
        usage = event.get("usage") or usage
        acceptance = read_acceptance(event)[0] or acceptance
    if "error" in (events[-1] if events else {}):
        detail = json.dumps(events[-1]["error"])[:300]
        return failed(f"stream ended with an error: {detail}", latency_s, status)
    return ArmAnswer(
        text="".join(pieces),
        status=status,
        latency_s=latency_s,
        finish_reason=finish,
        first_token_s=first_token_s,
        prompt_tokens=_tokens(usage, "prompt_tokens"),
        completion_tokens=_tokens(usage, "completion_tokens"),
        acceptance=acceptance,
        streamed=True,
    )
