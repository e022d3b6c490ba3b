"""Per-request sampling parameters (vLLM's names and defaults), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

VERIFICATION_CHOICES = ("standard", "fly")


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `max_tokens=True` is a mistake, not a number.
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How one request is decoded.

    temperature: 0 means greedy; otherwise logits are divided by it before top-k / top-p.
    top_p: nucleus mass in (0, 1]; 1.0 = off. top_k: keep the k most likely tokens; 0 (or -1) = off.
    max_tokens: the most tokens to generate. seed: the request's own random stream (None = engine seed
    plus the request's index). stop: strings that end generation (excluded from the text).
    stop_token_ids: token ids that end generation (kept in token_ids). ignore_eos: keep going past
    end-of-sequence. verification: None = the engine's verifier; "standard" forces lossless verification
    for this request; "fly" asks for FLy and needs an engine started with FLy.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    verification: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature={self.temperature!r}: must be a number >= 0")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r}: must be finite and >= 0 (0 = greedy)")
        self.temperature = float(self.temperature)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise ValueError(f"top_p={self.top_p!r}: must be a number in (0, 1]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1] (1.0 = off)")
        self.top_p = float(self.top_p)
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r}: must be an integer >= 0 (0 or -1 = off)")
        if self.top_k == -1:  # vLLM spells "off" as -1; accept it and keep one spelling inside
            self.top_k = 0
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be an integer >= 1")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r}: must be an integer or None")
        self.stop = self._check_stop(self.stop)
        self.stop_token_ids = self._check_stop_token_ids(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r}: must be true or false")
        if self.verification is not None and self.verification not in VERIFICATION_CHOICES:
            raise ValueError(
                f"verification={self.verification!r}: must be one of {VERIFICATION_CHOICES} or None"
            )

    @staticmethod
    def _check_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list | tuple) or not all(isinstance(s, str) and s for s in items):
            raise ValueError(f"stop={stop!r}: must be a non-empty string or a list of non-empty strings")
        return list(items)

    @staticmethod
    def _check_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, list | tuple) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids={ids!r}: must be a list of token ids (integers >= 0)")
        return list(ids)

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (temperature 0)."""
        return self.temperature == 0.0
