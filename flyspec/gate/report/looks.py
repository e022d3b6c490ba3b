"""The alpha ledger beside a decision: the comparison's error budget, what this look spends, and the earlier
looks it was counted with (docs/gate.md, "Error spent once").

A run registered under the per-user ledger keeps in its notes what the ledger said when it was registered
(flyspec/gate/runs/register.py). A run registered before that was checked only against its own store's
looks; its report recomputes those and says that looks in other stores are not visible to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from flyspec.gate.data.ledger import run_entries, store_entries
from flyspec.gate.data.store import GateStore, RunRecord
from flyspec.gate.stats.spending import alpha_left, budget_of, counted


@dataclass
class LedgerSummary:
    """One comparison's error budget as the ledger saw it when the run was registered.

    ``path``: the ledger file (None for a run registered before the per-user ledger, ``legacy``); ``claim``:
    what a PASS claims (which earlier looks count); ``alpha``: this look's; ``budget``: the family-wise
    error of all looks at the comparison together; ``spent_before``: what the counted earlier looks spent;
    ``earlier``: those looks, described."""

    comparison: str
    path: str | None
    claim: str | None
    alpha: float
    budget: float
    spent_before: float
    earlier: list[str]
    legacy: bool = False

    def describe(self) -> str:
        """The budget in words, for the report."""
        earlier = (
            f"Earlier looks counted with it: {'; '.join(self.earlier)} (they spent {self.spent_before:g})."
            if self.earlier
            else "No earlier look at this comparison was counted."
        )
        where = (
            f"checked against the alpha ledger {self.path}"
            if self.path is not None
            else "registered before the per-user ledger, so checked only against the looks in its own "
            "store; looks at this comparison in other stores are not visible to this report"
        )
        return (
            f"**Error budget.** Every look at this comparison together may wrongly PASS with probability at "
            f"most {self.budget:g} (the budget its first look registered); this run spends {self.alpha:g} of "
            f"it. {earlier} This run was {where}."
        )


def ledger_summary(store: GateStore, run: RunRecord, comparison: str) -> LedgerSummary | None:
    """The ledger's view of one comparison of ``run`` (None when the run is no look)."""
    snapshot = run.notes.get("ledger")
    if isinstance(snapshot, dict):
        data = snapshot.get("comparisons", {}).get(comparison)
        if isinstance(data, dict):
            return LedgerSummary(
                comparison,
                str(snapshot.get("path")),
                data.get("claim"),
                float(data["alpha"]),
                float(data["budget"]),
                float(data["spent_before"]),
                [str(e) for e in data.get("earlier", [])],
            )
    mine = next((e for e in run_entries(store, run) if e.comparison == comparison), None)
    if mine is None:
        return None
    before = [e.look for e in store_entries(store) if e.key == mine.key and e.created_at < run.created_at]
    earlier = counted(before, mine.look.questions, mine.look.claim)
    budget = budget_of(earlier) or mine.look.budget or mine.look.alpha
    spent = budget - alpha_left(budget, earlier)
    described = list({look.id: look.describe() for look in earlier}.values())
    return LedgerSummary(comparison, None, mine.look.claim, mine.look.alpha, budget, spent, described, True)
