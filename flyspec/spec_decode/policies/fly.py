"""FLy (Training-Free Loosely Speculative Decoding, arXiv 2511.22972): forgive a native rejection where
the target was unsure and the W drafts that follow were all accepted natively (docs/verification.md,
"FLy verification")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flyspec.checks import is_int
from flyspec.spec_decode.policies.base import (
    Drafts,
    VerificationPolicy,
    config_field,
    integer_rule,
    invalid,
    number_rule,
)

if TYPE_CHECKING:
    import torch

__all__ = ["FlyParams", "top_k_entropy"]

_MAX_DEFAULT_WINDOW = 6


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
    forgives = "accepted draft tokens that only FLy's rule kept"

    window_size: int = config_field(
        "fly_window_size",
        rule=integer_rule(1),
        short="W",
        default_for_k=lambda k: min(_MAX_DEFAULT_WINDOW, k - 1),
    )
    entropy_threshold: float = config_field(
        "fly_entropy_threshold",
        rule=number_rule("it must be a finite number >= 0", lambda t: t >= 0),
        short="theta",
        default=0.3,
    )
    entropy_top_k: int = config_field(
        "fly_entropy_top_k", rule=integer_rule(1), short="top-k", default=3, in_label=False
    )

    @classmethod
    def resolve_config(cls, values: dict[str, Any], num_speculative_tokens: int) -> dict[str, Any]:
        """The window must leave room: 2 <= K, and 1 <= W < K (W defaults to min(6, K - 1))."""
        k = num_speculative_tokens
        if k < 2:
            raise invalid(
                "num_speculative_tokens",
                k,
                f"rejection_sample_method={cls.name!r} needs num_speculative_tokens >= 2 (a window of at "
                "least one draft token must follow a forgiven position)",
            )
        window_rule = f"it must satisfy 1 <= fly_window_size < num_speculative_tokens ({k})"
        w = values.get("fly_window_size")
        if w is not None and not (is_int(w) and 1 <= w < k):
            raise invalid("fly_window_size", w, window_rule)
        return super().resolve_config(values, k)

    @classmethod
    def from_config(cls, values: dict[str, Any], vocab_size: int) -> FlyParams:
        """top-k is capped at the target's vocabulary size."""
        return cls(
            window_size=values["fly_window_size"],
            entropy_threshold=values["fly_entropy_threshold"],
            entropy_top_k=min(values["fly_entropy_top_k"], vocab_size),
        )

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
