"""The gate's question and dataset records, shared by every dataset reader
(``flyspec.gate.data.datasets``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Question:
    """One gate question: exactly one of ``prompt`` (plain text) or ``messages`` (chat) is set.

    ``answer`` is the reference as the grader reads it: a number or string, a ``code`` question's JSON
    tests (``flyspec.gate.grading.code_grader.CodeTask``), or empty for ``equivalent_to_baseline``.
    """

    id: str
    answer: str
    grader: str
    dataset: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_hash(self) -> str:
        """sha256 of what the model sees (prompt or messages), to prove every arm got the same input."""
        payload = json.dumps({"prompt": self.prompt, "messages": self.messages}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()


@dataclass(frozen=True)
class DatasetInfo:
    """Where a dataset comes from: its name in reports, the reader, the file, and the file's sha256."""

    name: str
    reader: str
    path: Path
    sha256: str
