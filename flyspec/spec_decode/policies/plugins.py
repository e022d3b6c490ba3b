"""Verification policies of other distributions: the `flyspec.verification_policies` entry points.

An installed distribution offers a policy by naming its class in this group (docs/architecture.md,
"Adding a verification policy"); in its pyproject.toml:

    [project.entry-points."flyspec.verification_policies"]
    ratio = "my_package.policies:RatioPolicy"

The entry point's name is the policy's `rejection_sample_method`. The registry loads the group the first
time it is asked anything, so every process sees the installed policies, a `flyspec serve` started later
included. A plugin that fails to load (its module raises, its object is no policy, its names clash) stops
neither the other plugins nor any command: its failure is kept, and it is the error when its name is used.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

from flyspec.spec_decode.policies.base import VerificationPolicy

__all__ = ["GROUP", "PluginFailure", "load_plugins"]

GROUP = "flyspec.verification_policies"


@dataclass(frozen=True)
class PluginFailure:
    """A policy entry point that did not load: the name it promised and what went wrong."""

    name: str
    """The entry point's name: the `rejection_sample_method` it would have provided."""
    detail: str
    """One line naming the entry point, its distribution and the error."""


def _describe(entry: importlib.metadata.EntryPoint) -> str:
    dist = entry.dist
    origin = f", distribution {dist.name} {dist.version}" if dist is not None else ""
    return f"entry point {entry.name} = {entry.value} (group {GROUP}{origin})"


def _policy_of(entry: importlib.metadata.EntryPoint) -> type[VerificationPolicy]:
    """The class the entry point names; ValueError when it is not a policy of the entry point's name."""
    policy = entry.load()
    if not (isinstance(policy, type) and issubclass(policy, VerificationPolicy)):
        raise ValueError(f"it names {policy!r}, not a VerificationPolicy subclass")
    if getattr(policy, "name", None) != entry.name:
        raise ValueError(
            f"it names {policy.__name__}, whose name is {getattr(policy, 'name', None)!r}: an entry "
            "point's name is its policy's rejection_sample_method"
        )
    return policy


def load_plugins(register: Callable[[type[VerificationPolicy]], object]) -> tuple[PluginFailure, ...]:
    """Load every entry point of the group and `register` its policy; the failures, one per entry point
    that did not load or register."""
    failures = []
    seen = set()
    for entry in importlib.metadata.entry_points(group=GROUP):
        if (entry.name, entry.value) in seen:  # one distribution found twice on sys.path
            continue
        seen.add((entry.name, entry.value))
        try:
            register(_policy_of(entry))
        except Exception as exc:  # a plugin's bug, whatever it is, is reported for its name only
            why = f"{type(exc).__name__}: {exc}"
            failures.append(PluginFailure(entry.name, f"{_describe(entry)} failed to load: {why}"))
    return tuple(failures)
