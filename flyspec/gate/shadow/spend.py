"""Caps on what the candidate is asked per minute: requests and tokens, over a sliding 60-second window.
(Its concurrency is capped by the number of mirror workers: flyspec/gate/shadow/mirror.py.)"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from flyspec.checks import is_int
from flyspec.gate.shadow.admission import OVER_REQUEST_CAP, OVER_TOKEN_CAP

WINDOW_S = 60.0


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
        self._booked: deque[list[float]] = deque()  # [time, tokens], oldest first

    def _recent(self) -> tuple[int, float]:
        cutoff = self._clock() - WINDOW_S
        while self._booked and self._booked[0][0] <= cutoff:
            self._booked.popleft()
        return len(self._booked), sum(tokens for _, tokens in self._booked)

    def admit(self, estimated_tokens: int) -> tuple[str | None, list[float] | None]:
        """(None, booking) when the request fits, with the booking to ``settle`` later; otherwise the
        reason it does not (``OVER_REQUEST_CAP`` or ``OVER_TOKEN_CAP``) and None."""
        count, tokens = self._recent()
        if self.requests_per_minute is not None and count + 1 > self.requests_per_minute:
            return OVER_REQUEST_CAP, None
        if self.tokens_per_minute is not None and tokens + estimated_tokens > self.tokens_per_minute:
            return OVER_TOKEN_CAP, None
        booking = [self._clock(), float(estimated_tokens)]
        self._booked.append(booking)
        return None, booking

    @staticmethod
    def settle(booking: list[float], used_tokens: int | None) -> None:
        """Replace a booking's estimate with the tokens the candidate reported (kept when unreported)."""
        if used_tokens is not None:
            booking[1] = float(used_tokens)
