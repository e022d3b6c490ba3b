"""Typical acceptance (Medusa's rule; vLLM 0.x's TypicalAcceptanceSampler): forgive a native rejection of
a token the target finds plausible enough, P_i(d_i) > min(eps, delta * exp(-H_i)), with H_i the entropy
of the full target row (docs/verification.md, "Typical acceptance")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flyspec.spec_decode.policies.base import Drafts, VerificationPolicy, require_number

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_POSTERIOR_ALPHA", "DEFAULT_POSTERIOR_THRESHOLD", "TypicalParams", "entropy"]

DEFAULT_POSTERIOR_THRESHOLD = 0.09
DEFAULT_POSTERIOR_ALPHA = 0.3
_THRESHOLD_RULE = "it must be a finite number > 0"
_ALPHA_RULE = "it must be a finite number in (0, 1]"


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """H = -sum over the whole row of p * ln p, in float64 with 0 * ln 0 = 0: [..., V] -> [...]."""
    p = probs.double()
    return -p.xlogy(p).sum(dim=-1)


@dataclass(frozen=True)
class TypicalParams(VerificationPolicy):
    """Typical acceptance: posterior threshold eps and posterior alpha delta (vLLM's names)."""

    name = "typical"
    title = "Typical acceptance"
    config_fields = (
        "typical_acceptance_sampler_posterior_threshold",
        "typical_acceptance_sampler_posterior_alpha",
    )
    recovered_by_argmax = True
    forgives = "accepted draft tokens that only the typical-acceptance rule kept"

    posterior_threshold: float = DEFAULT_POSTERIOR_THRESHOLD
    posterior_alpha: float = DEFAULT_POSTERIOR_ALPHA

    def __post_init__(self) -> None:
        require_number("posterior_threshold", self.posterior_threshold, _THRESHOLD_RULE, lambda x: x > 0)
        require_number("posterior_alpha", self.posterior_alpha, _ALPHA_RULE, lambda x: 0 < x <= 1)

    @classmethod
    def resolve_config(cls, values: dict[str, Any], num_speculative_tokens: int) -> dict[str, Any]:
        eps_field, delta_field = cls.config_fields
        eps, delta = values.get(eps_field), values.get(delta_field)
        return {
            eps_field: require_number(
                eps_field,
                DEFAULT_POSTERIOR_THRESHOLD if eps is None else eps,
                _THRESHOLD_RULE,
                lambda x: x > 0,
            ),
            delta_field: require_number(
                delta_field,
                DEFAULT_POSTERIOR_ALPHA if delta is None else delta,
                _ALPHA_RULE,
                lambda x: 0 < x <= 1,
            ),
        }

    @classmethod
    def label(cls, values: dict[str, Any]) -> str:
        eps_field, delta_field = cls.config_fields
        return f"eps={values.get(eps_field):g}, delta={values.get(delta_field):g}"

    def forgiven(self, drafts: Drafts) -> torch.Tensor:
        """P_i(d_i) > min(eps, delta * exp(-H_i)) at the candidates; H_i only where P_i(d_i) <= eps."""
        out = drafts.candidates.clone()
        rows, cols = (out & (drafts.p_draft <= self.posterior_threshold)).nonzero(as_tuple=True)
        h = entropy(drafts.target_probs[rows, cols])
        out[rows, cols] = drafts.p_draft[rows, cols] > (-h).exp() * self.posterior_alpha
        return out
