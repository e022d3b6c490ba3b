"""What a verification policy is: the questions the rest of the package asks it, the parameters it
declares, and what `verify()` hands it when it decides which native rejections to forgive
(docs/architecture.md, "Adding a verification policy").

The engine, the server, the gate and the benchmarks never compare method names: they ask the policy
whether it is lossy, which `SpeculativeConfig` fields it owns and how to resolve them, what its warning
says, what its forgiven count means and how to label one of its settings. `verify()` asks it one thing:
which of the candidate positions to forgive.

A policy's parameters are the fields of its frozen dataclass, each declared once with `config_field`:
the `SpeculativeConfig` key that sets it, its default (or a default that depends on K), its rule and its
short name in labels. Those declarations answer everything the package asks about the settings; the
same rule checks a config value and a value given to the policy's constructor directly.

Policy modules import no torch at run time: `flyspec.config` (which the command line imports to validate
configs cheaply) reads their fields and rules, and `forgiven` needs only the methods of the tensors it is
given.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from flyspec.checks import is_int

if TYPE_CHECKING:
    import torch

__all__ = [
    "ConfigField",
    "Drafts",
    "Rule",
    "StandardVerification",
    "VerificationPolicy",
    "config_field",
    "integer_rule",
    "invalid",
    "number_rule",
]

_FIELD_KEY = "flyspec.verification_policy"
"""Where `config_field` puts a parameter's declaration in the dataclass field's metadata."""


def invalid(field: str, value: Any, rule: str) -> ValueError:
    """The one error format of a configuration rule: it names the field, the value and the rule."""
    return ValueError(f"{field}={value!r} is invalid: {rule}")


@dataclass(frozen=True)
class Rule:
    """What one parameter's value must be: an integer (never a bool) or, without `integer`, a finite real
    number (an int is taken as a float), for which `ok(value)` holds. `text` states it for the error."""

    text: str
    ok: Callable[[Any], bool]
    integer: bool = False

    def check(self, name: str, value: Any) -> Any:
        """`value` (a float for a number rule) if it follows the rule, else ValueError naming `name`."""
        if self.integer:
            if not is_int(value) or not self.ok(value):
                raise invalid(name, value, self.text)
            return value
        number = float(value) if is_int(value) else value
        if not isinstance(number, float) or not math.isfinite(number) or not self.ok(number):
            raise invalid(name, value, self.text)
        return number


def integer_rule(minimum: int) -> Rule:
    """An integer >= minimum."""
    return Rule(f"it must be an integer >= {minimum}", lambda v: v >= minimum, integer=True)


def number_rule(text: str, ok: Callable[[float], bool]) -> Rule:
    """A finite real number for which `ok` holds; `text` says which (e.g. "it must be a finite number >=
    0")."""
    return Rule(text, ok)


@dataclass(frozen=True)
class ConfigField:
    """One parameter of a policy as a `SpeculativeConfig` field (made by `config_field`, read by
    `VerificationPolicy.config_fields()`)."""

    name: str
    """The `SpeculativeConfig` key, e.g. "fly_window_size"."""
    rule: Rule
    short: str
    """Its name in a settings label, e.g. "W"."""
    in_label: bool = True
    """False: a label shows it only when it differs from its default."""
    default_for_k: Callable[[int], Any] | None = None
    """The default as a function of K (num_speculative_tokens), for a parameter without a fixed one."""
    param: str = ""
    """The policy's own field (its constructor argument), e.g. "window_size"."""
    default: Any = None
    """The fixed default (None when `default_for_k` gives it)."""

    def default_at(self, num_speculative_tokens: int) -> Any:
        """The value when the config leaves the field unset."""
        if self.default_for_k is not None:
            return self.default_for_k(num_speculative_tokens)
        return self.default


def config_field(
    name: str,
    *,
    rule: Rule,
    short: str,
    default: Any = dataclasses.MISSING,
    default_for_k: Callable[[int], Any] | None = None,
    in_label: bool = True,
) -> Any:
    """Declare a policy parameter (a dataclass field of the policy) and the `SpeculativeConfig` field
    `name` that sets it: its rule, its short name in labels, and its default, fixed (`default`, also the
    constructor's) or depending on K (`default_for_k`; the constructor then requires the parameter)."""
    if (default is dataclasses.MISSING) == (default_for_k is None):
        raise ValueError(f"config_field {name!r}: give exactly one of default and default_for_k")
    declared = ConfigField(name, rule, short, in_label, default_for_k)
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata={_FIELD_KEY: declared})
    return dataclasses.field(default=default, metadata={_FIELD_KEY: declared})


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
    """[B, K] float64: P_i(d_i), the target's probability of the drafted token."""
    q_draft: torch.Tensor
    """[B, K] float64: Q_i(d_i), the drafter's probability of the drafted token (1 for a drafter without
    probabilities: n-gram lookup and greedy drafts)."""
    target_probs: torch.Tensor
    """[B, K, V]: P_0 .. P_{K-1} (the bonus row left out)."""


class VerificationPolicy:
    """The base of every verification policy; a policy is a frozen dataclass of its parameters, each
    declared with `config_field`, registered with `flyspec.spec_decode.policies.register_policy`.

    Class attributes answer the package's questions: `name` (the `rejection_sample_method` value),
    `title` (for people, e.g. in "FLy W=2, theta=0.3" and in its lossy warning), `lossy`,
    `recovered_by_argmax` (the token at the first rejection that stays rejected is the target's argmax on
    every row, instead of the standard residual draw) and `forgives` (what its forgiven count means, for
    reports). Creating a policy checks every parameter against its declared rule.
    """

    name: ClassVar[str]
    title: ClassVar[str]
    lossy: ClassVar[bool] = True
    recovered_by_argmax: ClassVar[bool] = False
    forgives: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in self.config_fields():
            object.__setattr__(self, f.param, f.rule.check(f.param, getattr(self, f.param)))

    @classmethod
    def config_fields(cls) -> tuple[ConfigField, ...]:
        """The policy's `SpeculativeConfig` fields, in the order of its parameters."""
        if not dataclasses.is_dataclass(cls):
            return ()
        return tuple(
            dataclasses.replace(
                f.metadata[_FIELD_KEY],
                param=f.name,
                default=None if f.default is dataclasses.MISSING else f.default,
            )
            for f in dataclasses.fields(cls)
            if _FIELD_KEY in f.metadata
        )

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The names of its `SpeculativeConfig` fields."""
        return tuple(f.name for f in cls.config_fields())

    @classmethod
    def resolve_config(cls, values: dict[str, Any], num_speculative_tokens: int) -> dict[str, Any]:
        """The policy's config fields (`values`, None or absent = unset) with defaults resolved for K
        draft tokens and every rule checked; ValueError names the field, the value and the rule. A policy
        with a rule across fields or on K extends this."""
        out = {}
        for f in cls.config_fields():
            value = values.get(f.name)
            if value is None:
                value = f.default_at(num_speculative_tokens)
            out[f.name] = f.rule.check(f.name, value)
        return out

    @classmethod
    def from_config(cls, values: dict[str, Any], vocab_size: int) -> VerificationPolicy:
        """The verifier's policy object for resolved config fields and the target's vocabulary size."""
        return cls(**{f.param: values[f.name] for f in cls.config_fields()})

    @classmethod
    def label_parts(cls, values: dict[str, Any], defaults: dict[str, Any] | None = None) -> list[str]:
        """One setting (resolved config fields) as short `name=value` parts, e.g. ["W=2", "theta=0.3"]:
        every field, except those declared `in_label=False` while at their default; with `defaults` (the
        resolved defaults), only the fields that differ from them."""
        parts = []
        for f in cls.config_fields():
            value = values.get(f.name)
            if defaults is not None:
                shown = value != defaults.get(f.name)
            else:
                shown = f.in_label or f.default_for_k is not None or value != f.default
            if shown:
                parts.append(f"{f.short}={value:g}" if isinstance(value, float) else f"{f.short}={value}")
        return parts

    @classmethod
    def label(cls, values: dict[str, Any]) -> str:
        """A short label of one setting, e.g. `W=2, theta=0.3` (`label_parts`); "defaults" for a policy
        whose label shows no field."""
        return ", ".join(cls.label_parts(values)) or "defaults"

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


@dataclass(frozen=True)
class StandardVerification(VerificationPolicy):
    """Standard (lossless) verification: nothing is forgiven (`verify(policy=None)` means the same)."""

    name = "standard"
    title = "Standard"
    lossy = False
