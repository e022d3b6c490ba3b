"""Caps on what the candidate is asked per minute: requests and tokens, over a sliding 60-second window.
(Its concurrency is capped by the number of mirror workers: flyspec/gate/shadow/mirror.py.)"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from flyspec.checks import is_int
from flyspec.gate.shadow.admission import OVER_REQUEST_CAP, OVER_TOKEN_CAP

WINDOW_S = 60.0


@dataclass
class Booking:
    """One admitted candidate request: when, and its tokens (estimated, then as reported)."""

    at: float
    tokens: float


class SpendCaps:
    """Admits a candidate request when the last minute's requests and tokens stay within the caps (None:
    no cap). Tokens are booked as estimated when admitted and corrected to the candidate's reported usage
    once it answers."""

    def __init__(
        self,
        requests_per_minute: int | None,
        tokens_per_minute: int | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for option, value in (
            ("--max-candidate-requests-per-minute", requests_per_minute),
            ("--max-candidate-tokens-per-minute", tokens_per_minute),
        ):
            if value is not None and not is_int(value, 1):
                raise ValueError(f"{option}={value!r}: must be a positive integer")
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self._clock = clock
        self._booked: deque[Booking] = deque()  # oldest first

    def _recent(self) -> tuple[int, float]:
        cutoff = self._clock() - WINDOW_S
        while self._booked and self._booked[0].at <= cutoff:
            self._booked.popleft()
        return len(self._booked), sum(b.tokens for b in self._booked)

    def admit(self, estimated_tokens: int) -> Booking | str:
        """A booking when the request fits (``settle`` it once the candidate answers); otherwise the
        reason it does not (``OVER_REQUEST_CAP`` or ``OVER_TOKEN_CAP``)."""
        count, tokens = self._recent()
        if self.requests_per_minute is not None and count + 1 > self.requests_per_minute:
            return OVER_REQUEST_CAP
        if self.tokens_per_minute is not None and tokens + estimated_tokens > self.tokens_per_minute:
            return OVER_TOKEN_CAP
        booking = Booking(self._clock(), float(estimated_tokens))
        self._booked.append(booking)
        return booking

    @staticmethod
    def settle(booking: Booking, used_tokens: int | None) -> None:
        """Replace a booking's estimate with the tokens the candidate reported (kept when unreported)."""
        if used_tokens is not None:
            booking.tokens = float(used_tokens)
