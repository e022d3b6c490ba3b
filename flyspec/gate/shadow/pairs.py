"""The record of one mirrored request (``MirroredPair``: both arms' answers, read from their OpenAI response
bodies), the ``--redact`` masks, and the ``shadow_pairs`` table that keeps each pair as it arrives."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import stat
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from flyspec.checks import is_int
from flyspec.gate.arms.endpoint import read_acceptance
from flyspec.gate.data import spec as codec
from flyspec.gate.data.questions import Question
from flyspec.outputs import AcceptanceCounts

PROXY = "proxy"
"""A pair whose baseline answer is the one the proxy passed to the client."""
MIRROR = "mirror"
"""A pair from a mirror-sink copy: the shadow process asked both arms itself."""
DATASET = "shadow"
"""The dataset name of a shadow run's questions in the store and its reports."""
CHAT = "/chat/completions"
COMPLETIONS = "/completions"
MASK = "[REDACTED]"


@dataclass(frozen=True)
class ArmAnswer:
    """One arm's answer; an error or timeout is an answer too (``error`` set, ``text`` None), scored wrong."""

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

    @property
    def tokens(self) -> int | None:
        """Prompt and completion tokens as reported (None when the prompt's are not)."""
        return None if self.prompt_tokens is None else self.prompt_tokens + (self.completion_tokens or 0)


def failed(error: str, latency_s: float, status: int | None = None) -> ArmAnswer:
    """The answer of an arm that errored or timed out."""
    return ArmAnswer(text=None, status=status, latency_s=latency_s, error=error)


@dataclass(frozen=True)
class MirroredPair:
    """One request answered by both arms, received at a Unix time from ``PROXY`` or ``MIRROR``, redacted."""

    received_at: float
    source: str
    route: str
    request: dict[str, object]
    baseline: ArmAnswer
    candidate: ArmAnswer


def _choice_text(route: str, choice: dict[str, object], streamed: bool) -> str:
    if route == COMPLETIONS:
        return choice.get("text") or ""
    part = choice.get("delta" if streamed else "message") or {}
    return part.get("content") or ""


def from_json(route: str, status: int, body: bytes, latency_s: float) -> ArmAnswer:
    """The answer in a whole response (an error answer for a non-200 status or a non-completion)."""
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


def from_stream(
    route: str, status: int, body: bytes, latency_s: float, first_token_s: float | None
) -> ArmAnswer:
    """The answer assembled from a streamed response's `data:` events: the first choice's text pieces in
    order, and usage and acceptance from whichever event carries them."""
    if status != 200:
        return failed(f"HTTP {status}: {body[:300].decode('utf-8', 'replace')}", latency_s, status)
    events: list[dict[str, object]] = []
    try:
        for line in body.decode("utf-8", "replace").splitlines():
            payload = line[5:].strip() if line.startswith("data:") else ""
            event = json.loads(payload) if payload and payload != "[DONE]" else None
            if isinstance(event, dict):
                events.append(event)
    except ValueError as exc:
        return failed(f"an event is not JSON ({exc})", latency_s, status)
    pieces: list[str] = []
    finish = usage = acceptance = None
    for event in events:
        for choice in event.get("choices") or []:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                pieces.append(_choice_text(route, choice, streamed=True))
                finish = choice.get("finish_reason") or finish
        usage = event.get("usage") or usage
        acceptance = read_acceptance(event)[0] or acceptance
    if events and "error" in events[-1]:
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


def _tokens(usage: object, key: str) -> int | None:
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if is_int(value, 0) else None


class Redactor:
    """The compiled ``--redact`` patterns, masked before anything is stored or sent on."""

    def __init__(self, patterns: list[str] | tuple[str, ...] = ()) -> None:
        self.patterns: list[re.Pattern[str]] = []
        for pattern in patterns:
            try:
                compiled = re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"--redact {pattern!r}: not a valid regular expression ({exc})") from None
            if compiled.search(""):
                raise ValueError(f"--redact {pattern!r}: matches the empty string, so it would mask nothing")
            self.patterns.append(compiled)

    def text(self, value: str) -> str:
        """``value`` with every match of every pattern replaced by ``MASK``."""
        for pattern in self.patterns:
            value = pattern.sub(MASK, value)
        return value

    def value(self, value: object) -> object:
        """A JSON value with ``text`` applied to every string in it, keys excepted."""
        if not self.patterns:
            return value
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {key: self.value(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.value(item) for item in value]
        return value

    def answer(self, answer: ArmAnswer) -> ArmAnswer:
        """The answer with its text and error (which may quote a response body) masked."""
        if not self.patterns:
            return answer
        text = None if answer.text is None else self.text(answer.text)
        error = None if answer.error is None else self.text(answer.error)
        return replace(answer, text=text, error=error)


@dataclass(frozen=True)
class StoredPair:
    """One stored row: its id (the order pairs were stored in), the request, and both answers as stored."""

    id: int
    source: str
    route: str
    request: dict[str, object]
    baseline: dict[str, object]
    candidate: dict[str, object]

    def answers(self) -> tuple[ArmAnswer, ArmAnswer]:
        """The baseline's and the candidate's answers."""
        return codec.from_json(ArmAnswer, self.baseline), codec.from_json(ArmAnswer, self.candidate)

    def question(self, grader: str) -> Question:
        """The request as a gate question (what the judge is shown): its prompt or its messages."""
        if self.route == COMPLETIONS:
            prompt = self.request.get("prompt")
            text = prompt if isinstance(prompt, str) else json.dumps(prompt)
            return Question(str(self.id), "", grader, DATASET, prompt=text)
        messages = [
            {
                "role": str(m.get("role", "")),
                "content": c if isinstance(c := m.get("content"), str) else json.dumps(c),
            }
            for m in self.request.get("messages") or []
            if isinstance(m, dict)
        ]
        return Question(str(self.id), "", grader, DATASET, messages=messages)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS shadow_pairs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    received_at REAL NOT NULL,
    source TEXT NOT NULL,
    route TEXT NOT NULL,
    request TEXT NOT NULL,
    baseline TEXT NOT NULL,
    candidate TEXT NOT NULL,
    candidate_ok INTEGER NOT NULL,
    run_id TEXT NOT NULL DEFAULT ''
)
"""


class SqlitePairStore:
    """A sink for the mirror keeping the pairs of run ``run_id``, each committed as it arrives (a shadow
    run's table is in its gate store, the row id the pair's question id); thread-safe."""

    def __init__(self, path: str | Path, run_id: str = "") -> None:
        self.path = Path(path)
        self.run_id = run_id
        try:  # readable and writable by its owner only; an existing file others may read is refused
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            mode = stat.S_IMODE(self.path.stat().st_mode)
            if mode & 0o077:
                raise ValueError(
                    f"--store {path}: mode {mode:o} lets others read stored traffic; run `chmod 600 {path}`"
                ) from None
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=30.0)
        self._db.execute(_SCHEMA)
        self._db.commit()

    def __call__(self, pair: MirroredPair) -> StoredPair:
        """Store one pair and commit it before returning."""
        baseline, candidate = codec.to_json(pair.baseline), codec.to_json(pair.candidate)
        with self._lock:
            cursor = self._db.execute(
                "INSERT INTO shadow_pairs (received_at, source, route, request, baseline, candidate, "
                "candidate_ok, run_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    pair.received_at,
                    pair.source,
                    pair.route,
                    json.dumps(pair.request),
                    json.dumps(baseline),
                    json.dumps(candidate),
                    int(pair.candidate.ok),
                    self.run_id,
                ),
            )
            self._db.commit()
        assert cursor.lastrowid is not None
        return StoredPair(cursor.lastrowid, pair.source, pair.route, pair.request, baseline, candidate)

    def count(self) -> int:
        """Pairs of this run stored so far."""
        with self._lock:
            sql = "SELECT COUNT(*) FROM shadow_pairs WHERE run_id = ?"
            return self._db.execute(sql, (self.run_id,)).fetchone()[0]

    def pairs(self) -> list[StoredPair]:
        """This run's stored pairs, in the order they were stored."""
        with self._lock:
            rows = self._db.execute(
                "SELECT id, source, route, request, baseline, candidate FROM shadow_pairs "
                "WHERE run_id = ? ORDER BY id",
                (self.run_id,),
            ).fetchall()
        return [StoredPair(i, s, r, json.loads(q), json.loads(b), json.loads(c)) for i, s, r, q, b, c in rows]

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()
