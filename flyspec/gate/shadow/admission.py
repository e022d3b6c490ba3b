"""Which requests are mirrored: eligibility, the registered sampling rule, and the stop after N pairs.

Every request that is not mirrored gets one reason (``REASONS``), counted in
``flyspec_shadow_skipped_total{reason}``: nothing is dropped silently.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from flyspec.checks import is_int, is_number

MALFORMED = "malformed_body"
BASELINE_ERROR = "baseline_error"
SEVERAL_CHOICES = "n_gt_1"
TOOLS = "tools"
SEVERAL_PROMPTS = "several_prompts"
TOO_LONG = "too_long"
NOT_SAMPLED = "not_sampled"
STOPPED = "stopped"
QUEUE_FULL = "queue_full"
OVER_REQUEST_CAP = "over_request_cap"
OVER_TOKEN_CAP = "over_token_cap"
CLIENT_GONE = "client_disconnected"
STORE_ERROR = "store_error"
REASONS = (
    MALFORMED,
    BASELINE_ERROR,
    SEVERAL_CHOICES,
    TOOLS,
    SEVERAL_PROMPTS,
    TOO_LONG,
    NOT_SAMPLED,
    STOPPED,
    QUEUE_FULL,
    OVER_REQUEST_CAP,
    OVER_TOKEN_CAP,
    CLIENT_GONE,
    STORE_ERROR,
)
"""Every reason a request is not mirrored (or a pair not stored), in the order /metrics lists them."""

_TOOL_FIELDS = ("tools", "tool_choice", "functions", "function_call")


@dataclass(frozen=True)
class SamplingRule:
    """The registered draw of mirrored requests: a request is drawn when the SHA-256 of the seed and its
    body, read as a number in [0, 1), is below ``share``. Deterministic (the same body is always drawn or
    never), independent of any answer, and fixed before the first request."""

    share: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not is_number(self.share, above=0, at_most=1):
            raise ValueError(f"--sample={self.share!r}: the mirrored share must be in (0, 1]")
        if not is_int(self.seed, 0):
            raise ValueError(f"sampling seed={self.seed!r}: must be an integer >= 0")

    def draws(self, body: bytes) -> bool:
        """True when the request with this raw body is mirrored."""
        if self.share >= 1:
            return True
        digest = hashlib.sha256(self.seed.to_bytes(8, "big") + body).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.share

    def describe(self) -> dict[str, object]:
        """The rule as the run's registration records it."""
        return {
            "rule": "sha256(seed as 8 big-endian bytes + raw request body)[:8] / 2**64 < share",
            "share": self.share,
            "seed": self.seed,
        }


def parse_body(body: bytes) -> dict[str, object] | None:
    """The request body as a JSON object, or None when it is not one."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def ineligible(route: str, body: dict[str, object]) -> str | None:
    """Why a well-formed request cannot be paired (a reason of ``REASONS``), or None when it can: one
    choice (``n`` and ``best_of`` at most 1), no tools, and one prompt on /completions."""
    for key in ("n", "best_of"):
        value = body.get(key, 1)
        if value is not None and value != 1:
            return SEVERAL_CHOICES
    if any(body.get(key) for key in _TOOL_FIELDS):
        return TOOLS
    prompt = body.get("prompt")
    # A list of token ids is one prompt; a list of strings or of token-id lists is one prompt per item.
    several = isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int)
    if route == "/completions" and several:
        return SEVERAL_PROMPTS
    return None


class PairBudget:
    """The stop after ``max_pairs`` pairs (None: no stop): each admitted request takes one pair, so no
    more than ``max_pairs`` are ever asked of the candidate."""

    def __init__(self, max_pairs: int | None) -> None:
        if max_pairs is not None and not is_int(max_pairs, 1):
            raise ValueError(f"--max-pairs={max_pairs!r}: must be a positive integer")
        self.max_pairs = max_pairs
        self.admitted = 0
        self.closed = False

    @property
    def exhausted(self) -> bool:
        """True once every pair of the budget is admitted, or the run decided: mirroring stops, the proxy
        keeps serving."""
        return self.closed or (self.max_pairs is not None and self.admitted >= self.max_pairs)

    def close(self) -> None:
        """Admit nothing more (the run decided)."""
        self.closed = True

    def take(self) -> None:
        """Admit one pair."""
        self.admitted += 1
