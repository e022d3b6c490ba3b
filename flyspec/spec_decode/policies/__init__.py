"""The verification policies, by `rejection_sample_method` name (docs/verification.md, "Adding a policy").

Registering a policy is one entry in POLICIES; its module defines the class (flyspec/spec_decode/policies/
base.py says what a policy answers). This package imports no torch at run time.
"""

from __future__ import annotations

from flyspec.spec_decode.policies.base import StandardVerification, VerificationPolicy
from flyspec.spec_decode.policies.fly import FlyParams
from flyspec.spec_decode.policies.typical import TypicalParams

__all__ = ["LOSSY_POLICIES", "POLICIES", "StandardVerification", "VerificationPolicy", "policy_named"]

POLICIES: dict[str, type[VerificationPolicy]] = {
    policy.name: policy for policy in (StandardVerification, FlyParams, TypicalParams)
}
"""Every policy by name, the lossless standard first."""
LOSSY_POLICIES: tuple[type[VerificationPolicy], ...] = tuple(p for p in POLICIES.values() if p.lossy)


def policy_named(name: str) -> type[VerificationPolicy]:
    """The policy class of a `rejection_sample_method` name; ValueError listing the names for another."""
    try:
        return POLICIES[name]
    except (KeyError, TypeError):
        choices = ", ".join(repr(n) for n in POLICIES)
        raise ValueError(
            f"rejection_sample_method={name!r} is invalid: it must be one of {choices}"
        ) from None
