"""Typical acceptance (Medusa's rule; vLLM 0.x's TypicalAcceptanceSampler): forgive a native rejection of
a token the target finds plausible enough, P_i(d_i) > min(eps, delta * exp(-H_i)), with H_i the entropy
of the full target row (docs/verification.md, "Typical acceptance")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flyspec.spec_decode.policies.base import Drafts, VerificationPolicy, config_field, number_rule

if TYPE_CHECKING:
    import torch

__all__ = ["TypicalParams", "entropy"]


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """H = -sum over the whole row of p * ln p, in float64 with 0 * ln 0 = 0: [..., V] -> [...]."""
    p = probs.double()
    return -p.xlogy(p).sum(dim=-1)


@dataclass(frozen=True)
class TypicalParams(VerificationPolicy):
    """Typical acceptance: posterior threshold eps and posterior alpha delta (vLLM's names)."""

    name = "typical"
    title = "Typical acceptance"
    recovered_by_argmax = True
    forgives = "accepted draft tokens that only the typical-acceptance rule kept"

    posterior_threshold: float = config_field(
        "typical_acceptance_sampler_posterior_threshold",
        rule=number_rule("it must be a finite number > 0", lambda x: x > 0),
        short="eps",
        default=0.09,
    )
    posterior_alpha: float = config_field(
        "typical_acceptance_sampler_posterior_alpha",
        rule=number_rule("it must be a finite number in (0, 1]", lambda x: 0 < x <= 1),
        short="delta",
        default=0.3,
    )

    def forgiven(self, drafts: Drafts) -> torch.Tensor:
        """P_i(d_i) > min(eps, delta * exp(-H_i)) at the candidates; H_i only where P_i(d_i) <= eps."""
        out = drafts.candidates.clone()
        rows, cols = (out & (drafts.p_draft <= self.posterior_threshold)).nonzero(as_tuple=True)
        h = entropy(drafts.target_probs[rows, cols])
        out[rows, cols] = drafts.p_draft[rows, cols] > (-h).exp() * self.posterior_alpha
        return out
