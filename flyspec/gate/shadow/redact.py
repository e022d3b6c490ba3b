"""``--redact REGEX``: masks matches in every string of a request and in both answers, before anything is
stored or sent to the candidate or a judge."""

from __future__ import annotations

import re

MASK = "[REDACTED]"


class Redactor:
    """The compiled ``--redact`` patterns (none: values pass unchanged)."""

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
