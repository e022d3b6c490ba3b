"""FLy (Training-Free Loosely Speculative Decoding, arXiv 2511.22972): forgive a native rejection where
the target was unsure and the W drafts that follow were all accepted natively (docs/verification.md,
"FLy verification")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flyspec.spec_decode.policies.base import (
    Drafts,
    VerificationPolicy,
    invalid,
    require_int,
    require_number,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_ENTROPY_THRESHOLD",
    "DEFAULT_ENTROPY_TOP_K",
    "DEFAULT_WINDOW",
    "FlyParams",
    "top_k_entropy",
]

DEFAULT_WINDOW = 6
"""FLy window W when unset: min(DEFAULT_WINDOW, K - 1)."""
DEFAULT_ENTROPY_THRESHOLD = 0.3
DEFAULT_ENTROPY_TOP_K = 3


def top_k_entropy(probs: torch.Tensor, k: int) -> torch.Tensor:
    """H = -sum over the min(k, V) largest entries p of each row of p * ln p (no renormalisation).

    Computed in float64 with 0 * ln 0 = 0. `probs` is [..., V]; the result is [...] float64.
    """
    top = probs.topk(min(k, probs.shape[-1]), dim=-1).values.double()  # descending
    return -top.xlogy(top).sum(dim=-1)


@dataclass(frozen=True)
class FlyParams(VerificationPolicy):
    """FLy parameters: window W, entropy threshold theta (nats), and k of the top-k entropy."""

    name = "fly"
    title = "FLy"
    config_fields = ("fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k")
    forgives = "accepted draft tokens that only FLy's rule kept"

    window_size: int
    entropy_threshold: float
    entropy_top_k: int

    def __post_init__(self) -> None:
        w, theta, k = self.window_size, self.entropy_threshold, self.entropy_top_k
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"window_size={w!r} is invalid: it must be an integer >= 1")
        require_number("entropy_threshold", theta, "it must be a finite number >= 0", lambda t: t >= 0)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"entropy_top_k={k!r} is invalid: it must be an integer >= 1")

    @classmethod
    def resolve_config(cls, values: dict[str, Any], num_speculative_tokens: int) -> dict[str, Any]:
        k = num_speculative_tokens
        if k < 2:
            raise invalid(
                "num_speculative_tokens",
                k,
                f"rejection_sample_method={cls.name!r} needs num_speculative_tokens >= 2 (a window of at "
                "least one draft token must follow a forgiven position)",
            )
        w = values.get("fly_window_size")
        w = min(DEFAULT_WINDOW, k - 1) if w is None else w
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w < k:
            raise invalid(
                "fly_window_size", w, f"it must satisfy 1 <= fly_window_size < num_speculative_tokens ({k})"
            )
        theta = values.get("fly_entropy_threshold")
        theta = require_number(
            "fly_entropy_threshold",
            DEFAULT_ENTROPY_THRESHOLD if theta is None else theta,
            "it must be a finite number >= 0",
            lambda t: t >= 0,
        )
        top_k = values.get("fly_entropy_top_k")
        top_k = require_int("fly_entropy_top_k", DEFAULT_ENTROPY_TOP_K if top_k is None else top_k, 1)
        return {"fly_window_size": w, "fly_entropy_threshold": theta, "fly_entropy_top_k": top_k}

    @classmethod
    def from_config(cls, values: dict[str, Any], vocab_size: int) -> FlyParams:
        """top-k is capped at the target's vocabulary size."""
        return cls(
            window_size=values["fly_window_size"],
            entropy_threshold=values["fly_entropy_threshold"],
            entropy_top_k=min(values["fly_entropy_top_k"], vocab_size),
        )

    @classmethod
    def label(cls, values: dict[str, Any]) -> str:
        parts = [f"W={values.get('fly_window_size')}", f"theta={values.get('fly_entropy_threshold'):g}"]
        if values.get("fly_entropy_top_k") not in (None, DEFAULT_ENTROPY_TOP_K):
            parts.append(f"top-k={values['fly_entropy_top_k']}")
        return ", ".join(parts)

    def forgiven(self, drafts: Drafts) -> torch.Tensor:
        """Conditions 2, 3 and 5 on the candidates (which hold 1 and 4), all on native decisions."""
        ok, valid, positions = drafts.ok, drafts.valid, drafts.positions
        b, k = ok.shape
        w = self.window_size
        # Condition 5 by prefix sums: native rejections in (i, i + W] = R[i + W + 1] - R[i + 1].
        rejections = drafts.lengths.new_zeros((b, k + 1))
        rejections[:, 1:] = (valid & ~ok).cumsum(dim=1)
        window_end = (positions + w + 1).clamp(max=k)
        window_clean = (rejections[:, window_end] - rejections[:, positions + 1]) == 0
        out = (
            drafts.candidates
            & ((positions + w).unsqueeze(0) < drafts.lengths.unsqueeze(1))  # condition 2
            & window_clean
        )
        # Condition 3 only where the others hold (few positions): no top-k pass over [B, K, V].
        rows, cols = out.nonzero(as_tuple=True)
        entropy = top_k_entropy(drafts.target_probs[rows, cols], self.entropy_top_k)
        out[rows, cols] = entropy >= self.entropy_threshold
        return out
