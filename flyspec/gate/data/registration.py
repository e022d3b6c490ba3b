"""The comparisons a registered run makes, read back from its registration (runs, reports and the alpha
ledger read them the same way).

A comparison pairs the baseline's lane with one candidate's lane and tests it against a margin at an
alpha, with a fixed or a sequential design. A plain gate run makes one (``candidate``); a run with
controls (``flyspec demo``) makes one more per control, each with its own share of the run's alpha
(Bonferroni: the shares add up to the run's alpha, so the chance of any wrong decision in the family
stays at most alpha whatever the dependence between the comparisons, which share the baseline's answers);
a tune makes one per setting, each at the full alpha, tested in a fixed sequence (docs/gate.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flyspec.gate.stats.monitor import SequentialPlan

Lane = tuple[str, int]
BASELINE: Lane = ("baseline", 0)
ROLES = ("candidate", "control", "setting")


@dataclass(frozen=True)
class ComparisonPlan:
    """One registered comparison: the lanes it pairs, its margin and alpha, its sequential plan (None for
    a fixed design) and its role: ``candidate`` (the comparison the run is for), ``control`` (a setting
    known to be harmful, which the gate must FAIL) or ``setting`` (one of a tune's settings)."""

    name: str
    baseline: Lane
    candidate: Lane
    margin: float
    alpha: float
    role: str = "candidate"
    sequential: SequentialPlan | None = None

    @property
    def lanes(self) -> tuple[Lane, Lane]:
        return (self.baseline, self.candidate)

    def to_dict(self) -> dict[str, Any]:
        """The registration's entry for this comparison."""
        out: dict[str, Any] = {
            "name": self.name,
            "candidate": self.candidate[0],
            "margin": self.margin,
            "alpha": self.alpha,
            "role": self.role,
        }
        if self.sequential is not None:
            out["sequential"] = self.sequential.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ComparisonPlan:
        sequential = data.get("sequential")
        return cls(
            name=str(data["name"]),
            baseline=BASELINE,
            candidate=(str(data["candidate"]), 0),
            margin=float(data["margin"]),
            alpha=float(data["alpha"]),
            role=str(data.get("role", "candidate")),
            sequential=SequentialPlan.from_registration(sequential) if sequential is not None else None,
        )


def comparison_plans(kind: str, registration: Mapping[str, Any]) -> list[ComparisonPlan]:
    """Every comparison a run registered, the primary one (``candidate``) first.

    A gate run registered before comparisons had their own entries (or with a single candidate) makes
    one, from the run's margin, alpha and sequential plan; a pilot makes none; a tune one per setting in
    its registered test order, each at the full alpha.
    """
    margin, alpha = float(registration["margin"]), float(registration["alpha"])
    sequential = registration.get("sequential")
    plan = SequentialPlan.from_registration(sequential) if sequential is not None else None
    if kind == "gate":
        listed = registration.get("comparisons")
        if listed:
            plans = [ComparisonPlan.from_dict(c) for c in listed]
            return sorted(plans, key=lambda c: c.role != "candidate")
        return [ComparisonPlan("candidate", BASELINE, ("candidate", 0), margin, alpha, "candidate", plan)]
    if kind == "tune":
        order = registration.get("order", {}).get("settings", [])
        return [ComparisonPlan(s, BASELINE, (s, 0), margin, alpha, "setting", plan) for s in order]
    return []


def primary(kind: str, registration: Mapping[str, Any]) -> ComparisonPlan | None:
    """The comparison a run is for (None for a pilot or calibration run)."""
    plans = comparison_plans(kind, registration)
    return plans[0] if plans else None
