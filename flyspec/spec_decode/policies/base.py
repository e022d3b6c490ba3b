"""What a verification policy is: the questions the rest of the package asks it, and what `verify()`
hands it when it decides which native rejections to forgive (docs/verification.md, "Adding a policy").

The engine, the server, the gate and the benchmarks never compare method names: they ask the policy
whether it is lossy, which `SpeculativeConfig` fields it owns and how to resolve them, what its warning
says, what its forgiven count means and how to label one of its settings. `verify()` asks it one thing:
which of the candidate positions to forgive.

Policy modules import no torch at run time: `flyspec.config` (which the command line imports to validate
configs cheaply) reads their fields and rules, and `forgiven` needs only the methods of the tensors it is
given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from flyspec.checks import is_int

if TYPE_CHECKING:
    import torch

__all__ = [
    "Drafts",
    "StandardVerification",
    "VerificationPolicy",
    "invalid",
    "require_int",
    "require_number",
]


def invalid(field: str, value: Any, rule: str) -> ValueError:
    """The one error format of a configuration rule: it names the field, the value and the rule."""
    return ValueError(f"{field}={value!r} is invalid: {rule}")


def require_int(field: str, value: Any, minimum: int) -> int:
    """`value` if it is an integer >= minimum, else the ValueError of `invalid`."""
    if not is_int(value, minimum):
        raise invalid(field, value, f"it must be an integer >= {minimum}")
    return value


def require_number(field: str, value: Any, rule: str, ok: Any) -> float:
    """`value` as a float if it is a finite real number and `ok(value)` holds, else ValueError(rule)."""
    if is_int(value):
        value = float(value)
    if not isinstance(value, float) or not math.isfinite(value) or not ok(value):
        raise invalid(field, value, rule)
    return value


@dataclass(frozen=True)
class Drafts:
    """What `verify()` knows about a batch of B rows and K draft positions when it asks a policy which
    native rejections to forgive. Every tensor is on the target's device."""

    ok: torch.Tensor
    """[B, K] bool: native decisions (False at padding)."""
    valid: torch.Tensor
    """[B, K] bool: positions i < K_b."""
    candidates: torch.Tensor
    """[B, K] bool: what any policy may forgive: a native rejection (valid, not ok), at or past the row's
    lossless prefix, of a token the target allows (P_i(d_i) > 0) and, on a random row, the drafter drew
    with positive probability (Q_i(d_i) > 0). `verify()` keeps the answer within these."""
    lengths: torch.Tensor
    """[B] int64: K_b."""
    positions: torch.Tensor
    """[K] int64: 0 .. K-1."""
    p_draft: torch.Tensor
    """[B, K] float64: P_i(d_i)."""
    target_probs: torch.Tensor
    """[B, K, V]: P_0 .. P_{K-1} (the bonus row left out)."""


class VerificationPolicy:
    """The base of every verification policy; a lossy one is a frozen dataclass of its parameters.

    Class attributes answer the package's questions: `name` (the `rejection_sample_method` value),
    `title` (for people), `lossy`, `config_fields` (its `SpeculativeConfig` fields, in the order of its
    constructor's arguments), `recovered_by_argmax` (the token at the first rejection that stays rejected
    is the target's argmax on every row, instead of the standard residual draw) and `forgives` (what its
    forgiven count means, for reports).
    """

    name: ClassVar[str]
    title: ClassVar[str]
    lossy: ClassVar[bool] = True
    config_fields: ClassVar[tuple[str, ...]] = ()
    recovered_by_argmax: ClassVar[bool] = False
    forgives: ClassVar[str] = ""

    @classmethod
    def resolve_config(cls, values: dict[str, Any], num_speculative_tokens: int) -> dict[str, Any]:
        """The policy's config fields (`values`, None = unset) with defaults resolved and every rule
        checked; ValueError names the field, the value and the rule."""
        return {}

    @classmethod
    def from_config(cls, values: dict[str, Any], vocab_size: int) -> VerificationPolicy:
        """The verifier's policy object for resolved config fields and the target's vocabulary size."""
        return cls(*(values[f] for f in cls.config_fields))

    @classmethod
    def label(cls, values: dict[str, Any]) -> str:
        """A short label of one setting of this policy (resolved config fields), e.g. `W=2, theta=0.3`."""
        return cls.title

    @classmethod
    def lossy_warning(cls) -> str:
        """The sentence the engine logs once, at warning level, when it starts with this policy."""
        return (
            f"{cls.title} verification is lossy: outputs do not follow the target model's distribution "
            "and may be of lower quality."
        )

    def forgiven(self, drafts: Drafts) -> torch.Tensor:
        """[B, K] bool: the candidate positions this policy forgives (each evaluated on native decisions
        only; `verify()` then runs the standard procedure with ok_i := ok_i or forgiven_i)."""
        return drafts.candidates.new_zeros(drafts.candidates.shape)


class StandardVerification(VerificationPolicy):
    """Standard (lossless) verification: nothing is forgiven (`verify(policy=None)` means the same)."""

    name = "standard"
    title = "Standard"
    lossy = False
