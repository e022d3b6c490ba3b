"""The verification policies, by `rejection_sample_method` name (docs/architecture.md, "Adding a
verification policy").

A policy is one class (flyspec/spec_decode/policies/base.py says what it declares) and one call,
`register_policy(MyPolicy)`, here for the built-in ones or in the module that defines it for any other, or
one entry point of an installed distribution (flyspec/spec_decode/policies/plugins.py), which every process
loads: from then on `SpeculativeConfig`, the engine, the server's `verification` field, `gate tune` and
`flyspec bench` take it by name. Everything below reads the registry when asked, so a policy registered
after import is seen everywhere. This package imports no torch at run time.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from typing import TypeVar

from flyspec.spec_decode.policies.base import StandardVerification, VerificationPolicy
from flyspec.spec_decode.policies.fly import FlyParams
from flyspec.spec_decode.policies.plugins import PluginFailure, load_plugins
from flyspec.spec_decode.policies.typical import TypicalParams

__all__ = [
    "StandardVerification",
    "VerificationPolicy",
    "lossy_policy_names",
    "plugin_failures",
    "policy_named",
    "policy_names",
    "policy_owning",
    "register_policy",
    "registered_policies",
    "unregister_policy",
]

_NAME = re.compile(r"[a-z][a-z0-9_]*")
_REGISTRY: dict[str, type[VerificationPolicy]] = {}
P = TypeVar("P", bound=type[VerificationPolicy])

_plugins_lock = threading.RLock()
_plugins_started = False
_plugins_done = False
_FAILURES: dict[str, PluginFailure] = {}
"""The plugins that did not load, by the name each promised."""


def _load_plugins_once() -> None:
    """Load the entry-point plugins the first time the registry is asked anything. Other threads wait
    for the load; the loading thread itself comes back here when a plugin's module registers its own
    policy on import, and goes on."""
    global _plugins_started, _plugins_done
    if _plugins_done:
        return
    with _plugins_lock:
        if _plugins_started:
            return
        _plugins_started = True
        _FAILURES.update((f.name, f) for f in load_plugins(_register))
        _plugins_done = True


def register_policy(policy: P) -> P:
    """Make `policy` available under its `name` (also usable as a class decorator); registering the same
    class again changes nothing. ValueError when the class is not a usable policy: not a frozen
    dataclass subclassing VerificationPolicy, without a lowercase `name` or a `title`, a name another
    class holds, or a config field another policy owns."""
    _load_plugins_once()
    return _register(policy)


def _register(policy: P) -> P:
    if not (isinstance(policy, type) and issubclass(policy, VerificationPolicy)):
        raise ValueError(f"register_policy: {policy!r} is not a VerificationPolicy subclass")
    if not dataclasses.is_dataclass(policy) or not policy.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise ValueError(f"register_policy: {policy.__name__} must be a frozen dataclass of its parameters")
    name = getattr(policy, "name", None)
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(
            f"register_policy: {policy.__name__}.name={name!r} must be a lowercase name (letters, digits, _)"
        )
    if not isinstance(getattr(policy, "title", None), str) or not policy.title:
        raise ValueError(f"register_policy: {policy.__name__} needs a title (its name for people)")
    held = _REGISTRY.get(name)
    if held is policy:
        return policy
    if held is not None:
        raise ValueError(f"register_policy: rejection_sample_method {name!r} is already {held.__name__}")
    for field in policy.field_names():
        owner = _owning(field)
        if owner is not None:
            raise ValueError(
                f"register_policy: {policy.__name__}'s config field {field!r} already belongs to "
                f"{owner.name!r}"
            )
    _REGISTRY[name] = policy
    return policy


def unregister_policy(name: str) -> None:
    """Remove the policy registered as `name` (a test's or a reloaded plugin's); the built-in policies
    stay. ValueError for a built-in or an unknown name."""
    if name in _BUILTIN:
        raise ValueError(f"unregister_policy: {name!r} is built in")
    policy_named(name)
    del _REGISTRY[name]


def registered_policies() -> tuple[type[VerificationPolicy], ...]:
    """Every registered policy, in registration order (standard first, then the entry-point plugins)."""
    _load_plugins_once()
    return tuple(_REGISTRY.values())


def policy_names() -> tuple[str, ...]:
    """Every `rejection_sample_method` name, "standard" first."""
    _load_plugins_once()
    return tuple(_REGISTRY)


def lossy_policy_names() -> tuple[str, ...]:
    """The lossy policies' names: what a request's `verification` may name besides "standard"."""
    _load_plugins_once()
    return tuple(name for name, policy in _REGISTRY.items() if policy.lossy)


def policy_owning(field: str) -> type[VerificationPolicy] | None:
    """The policy whose `SpeculativeConfig` field `field` is, or None."""
    _load_plugins_once()
    return _owning(field)


def _owning(field: str) -> type[VerificationPolicy] | None:
    return next((p for p in _REGISTRY.values() if field in p.field_names()), None)


def policy_named(name: str) -> type[VerificationPolicy]:
    """The policy class of a `rejection_sample_method` name; ValueError listing the names for another,
    or naming the entry point, and its error, of a plugin that promised the name and failed to load."""
    _load_plugins_once()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        failure = _FAILURES.get(name) if isinstance(name, str) else None
        if failure is not None:
            raise ValueError(
                f"rejection_sample_method={name!r} is invalid: its plugin did not load: {failure.detail}"
            ) from None
        choices = ", ".join(repr(n) for n in _REGISTRY)
        raise ValueError(
            f"rejection_sample_method={name!r} is invalid: it must be one of {choices}"
        ) from None


def plugin_failures() -> tuple[str, ...]:
    """One line per policy entry point that did not load (flyspec/spec_decode/policies/plugins.py)."""
    _load_plugins_once()
    return tuple(f.detail for f in _FAILURES.values())


_BUILTIN = tuple(_register(p).name for p in (StandardVerification, FlyParams, TypicalParams))
