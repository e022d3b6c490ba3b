"""The token-budget arithmetic: how many requests can run at once, and which limit decides it.

Each decode step of a running request charges `1 + K` tokens of `max_num_batched_tokens` in the target
pass (its newest token plus K draft tokens); a drafter that runs its own passes is not charged there. So
`max_running = min(max_num_seqs, max_num_batched_tokens // (1 + K))`, and a drafter that needs L query
tokens per request inside the same budget also caps it at `max_num_batched_tokens // L`.

No torch here, so `flyspec capacity` answers at once; the engine's scheduler enforces the cap.
"""

from __future__ import annotations

from dataclasses import dataclass

from flyspec.checks import is_int


@dataclass(frozen=True)
class Capacity:
    """How many requests can run at once, and which limit decides it."""

    max_running: int
    tokens_per_decode_request: int
    binding: str  # "budget" | "max_num_seqs" | "lookahead"
    max_num_batched_tokens: int
    max_num_seqs: int
    num_lookahead_tokens: int | None = None

    def describe(self) -> str:
        """One line for logs: the charge, the budget, the effective cap and what binds it."""
        why = {
            "budget": "the token budget binds",
            "max_num_seqs": "max_num_seqs binds",
            "lookahead": f"the drafter's {self.num_lookahead_tokens} lookahead tokens per request bind",
        }[self.binding]
        tokens = "token" if self.tokens_per_decode_request == 1 else "tokens"
        return (
            f"each decode request charges {self.tokens_per_decode_request} {tokens} of "
            f"max_num_batched_tokens={self.max_num_batched_tokens}: at most {self.max_running} of "
            f"max_num_seqs={self.max_num_seqs} requests can run ({why})"
        )


def _positive(name: str, value: object) -> int:
    if not is_int(value, 1):
        raise ValueError(f"{name}={value!r}: must be a positive integer")
    return value


def capacity(
    max_num_batched_tokens: int,
    max_num_seqs: int,
    tokens_per_decode_request: int,
    num_lookahead_tokens: int | None = None,
) -> Capacity:
    """The admission cap with the limit that binds it.

    max_running = min(max_num_seqs, B // tokens_per_decode_request[, B // num_lookahead_tokens]).
    On a tie max_num_seqs is reported as binding (raising the budget alone would not help); lookahead
    is reported only when it is strictly the smallest. Raises ValueError when a value is not positive
    or when the budget cannot hold one decode request.
    """
    budget = _positive("max_num_batched_tokens", max_num_batched_tokens)
    seqs = _positive("max_num_seqs", max_num_seqs)
    charge = _positive("tokens_per_decode_request", tokens_per_decode_request)
    if num_lookahead_tokens is not None:
        _positive("num_lookahead_tokens", num_lookahead_tokens)
    if budget < charge:
        raise ValueError(
            f"max_num_batched_tokens={budget}: must be at least the {charge} tokens one decode request "
            f"charges; raise max_num_batched_tokens to at least {charge}"
        )
    by_budget = budget // charge
    cap, binding = (seqs, "max_num_seqs") if seqs <= by_budget else (by_budget, "budget")
    if num_lookahead_tokens is not None and budget // num_lookahead_tokens < cap:
        cap, binding = budget // num_lookahead_tokens, "lookahead"
    return Capacity(cap, charge, binding, budget, seqs, num_lookahead_tokens)


def max_running(
    max_num_batched_tokens: int,
    max_num_seqs: int,
    tokens_per_decode_request: int,
    num_lookahead_tokens: int | None = None,
) -> int:
    """min(max_num_seqs, B // tokens_per_decode_request), also <= B // num_lookahead_tokens if given."""
    return capacity(
        max_num_batched_tokens, max_num_seqs, tokens_per_decode_request, num_lookahead_tokens
    ).max_running
