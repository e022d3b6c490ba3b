"""The alpha ledger of one comparison (docs/statistics.md, "Error spent once: the alpha ledger"): one
budget, registered by the first look; a new look may use only what the earlier looks it is counted with
left (Bonferroni over looks).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from flyspec.checks import is_number
from flyspec.gate.stats.decide import FINITE, SUPERPOPULATION
from flyspec.gate.stats.decide import POPULATIONS as CLAIMS

LOOK_KINDS = ("fixed", "sequential", "tune")
MAX_BUDGET = 0.05
"""The largest budget a comparison may register unless its first look's own alpha is larger: twice the
default one-sided alpha, the error of a two-sided 95% interval. A budget of 0.45 would have allowed 18
looks at 0.025, each reported as a 2.5% test."""
_SPENT = 1e-12  # below this the budget is gone (floating-point remainders of a full split)
_SHOWN = 3


def comparison_key(baseline: Mapping[str, object], candidate: Mapping[str, object]) -> str:
    """A stable key for the comparison of these two arm identities (sha256 of their canonical JSON)."""
    text = json.dumps({"baseline": baseline, "candidate": candidate}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def check_budget(alpha: float, budget: float) -> None:
    """ValueError unless ``alpha <= budget <= max(alpha, MAX_BUDGET)``."""
    if not is_number(budget, above=0, below=0.5) or budget < alpha or budget > max(alpha, MAX_BUDGET):
        raise ValueError(
            f"alpha_budget={budget!r}: the family-wise error of every look at this comparison together (the "
            f"chance that any of them wrongly PASSes), at least this look's alpha={alpha:g} and at most "
            f"{MAX_BUDGET:g} (or the alpha itself when larger): a larger budget would let many looks each be "
            "reported as a test at alpha"
        )


@dataclass(frozen=True)
class Look:
    """One look at a comparison, as its registration recorded it: ``budget``, the comparison's budget as
    this look registered it (None: its alpha); ``carries``, the fixed run whose answers lead a sequential
    continuation; ``look_id``, unique across stores (default ``run_id``); ``where``, its store."""

    run_id: str
    kind: str
    alpha: float
    questions: frozenset[Hashable]
    budget: float | None = None
    carries: str | None = None
    claim: str = SUPERPOPULATION
    look_id: str = ""
    where: str = ""

    def __post_init__(self) -> None:
        if self.kind not in LOOK_KINDS:
            raise ValueError(f"kind={self.kind!r}: one of {', '.join(LOOK_KINDS)}")
        if self.claim not in CLAIMS:
            raise ValueError(f"claim={self.claim!r}: one of {', '.join(CLAIMS)}")
        if not is_number(self.alpha, above=0, below=0.5):
            raise ValueError(f"alpha={self.alpha!r}: must lie in (0, 0.5)")
        if self.budget is not None and not is_number(self.budget, at_least=self.alpha, below=0.5):
            raise ValueError(f"budget={self.budget!r}: must lie in [alpha, 0.5)")

    @property
    def id(self) -> str:
        return self.look_id or self.run_id

    def describe(self) -> str:
        """The look in a few words, for messages and reports."""
        where = f" of {self.where}" if self.where else ""
        claim = ", about its questions only" if self.claim == FINITE else ""
        return f"{self.kind} run {self.run_id!r}{where} (alpha {self.alpha:g}{claim})"


def overlapping(looks: Iterable[Look], questions: Iterable[Hashable]) -> list[Look]:
    """The looks linked to ``questions`` through shared questions, directly or through other looks."""
    pending = list(looks)
    keys = set(questions)
    linked: set[int] = set()
    while new := {i for i, look in enumerate(pending) if i not in linked and look.questions & keys}:
        linked |= new
        keys = keys.union(*(pending[i].questions for i in new))
    return [look for i, look in enumerate(pending) if i in linked]


def counted(looks: Sequence[Look], questions: Iterable[Hashable], claim: str = SUPERPOPULATION) -> list[Look]:
    """The earlier looks a new look is counted with: all of them for a claim about the method, those
    linked by questions for a finite one."""
    if claim not in CLAIMS:
        raise ValueError(f"claim={claim!r}: one of {', '.join(CLAIMS)}")
    return list(looks) if claim == SUPERPOPULATION else overlapping(looks, questions)


def budget_of(earlier_looks: Sequence[Look]) -> float | None:
    """The budget the first of these looks registered (its alpha by default; one registered above the cap
    reads as the cap); None without looks."""
    if not earlier_looks:
        return None
    first = earlier_looks[0]
    budget = first.budget if first.budget is not None else first.alpha
    return min(budget, max(first.alpha, MAX_BUDGET))


def alpha_left(budget: float, earlier_looks: Iterable[Look]) -> float:
    """What ``budget`` leaves after the earlier looks (each distinct look counted once), never below 0."""
    spent: dict[str, float] = {}
    for look in earlier_looks:
        spent[look.id] = look.alpha
    left = budget - sum(spent.values())
    return 0.0 if left < _SPENT else left


@dataclass(frozen=True)
class NextLook:
    """What a new look may do: ``alpha``, the most it may use; ``earlier``, the counted looks; ``carry``,
    the fixed run a sequential continuation may carry; ``message``, for the command line."""

    allowed: bool
    alpha: float
    budget: float
    spent: float
    earlier: tuple[Look, ...]
    carry: str | None
    message: str

    @property
    def earlier_ids(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(look.run_id for look in self.earlier))


def _named(looks: Sequence[Look]) -> str:
    unique = list({look.id: look for look in looks}.values())
    shown = ", ".join(look.describe() for look in unique[:_SHOWN])
    return shown + (f" and {len(unique) - _SHOWN} more" if len(unique) > _SHOWN else "")


def _ways_forward(earlier: Sequence[Look], claim: str) -> str:
    """The valid ways forward once a comparison's budget is spent."""
    ways = []
    sequential = [look for look in earlier if look.kind == "sequential"]
    if sequential:
        run = sequential[-1]
        where = f" of {run.where}" if run.where else ""
        ways.append(
            f"continue sequential run {run.run_id!r}{where} (rerun its command, with a larger "
            "--max-questions to extend it: its confidence sequence holds at every stop, so continuing it "
            "spends nothing more)"
        )
    ways.append("act on the earlier decision as it stands")
    ways.append(
        "next time, register the first look with a budget for every look you plan (for example --alpha "
        f"0.0125 --alpha-budget 0.025; at most {MAX_BUDGET:g})"
    )
    text = "Valid ways forward: " + "; ".join(ways) + "."
    if claim == SUPERPOPULATION:
        text += (
            " Questions these looks did not use do not reset the budget: the claim is about the method, the "
            "same hypothesis whatever questions test it. Only a narrower claim, about one set of questions "
            "and nothing beyond it (`--sequential --population finite` on questions no look at this "
            "comparison used), is another hypothesis with its own budget."
        )
    return text


def next_look(
    kind: str,
    questions: Iterable[Hashable],
    looks: Sequence[Look],
    alpha: float,
    claim: str = SUPERPOPULATION,
    budget: float | None = None,
) -> NextLook:
    """Apply the ledger to a new look asking for ``alpha`` given the comparison's earlier ``looks`` (oldest
    first); ``budget``: its --alpha-budget, which only the first look registers."""
    if kind not in LOOK_KINDS:
        raise ValueError(f"kind={kind!r}: one of {', '.join(LOOK_KINDS)}")
    keys = frozenset(questions)
    earlier = tuple(counted(looks, keys, claim))
    if not earlier:
        own = alpha if budget is None else budget
        check_budget(alpha, own)
        return NextLook(True, alpha, own, 0.0, (), None, "")
    registered = budget_of(earlier)
    assert registered is not None
    left = alpha_left(registered, earlier)
    spent = registered - left
    scope = "on these questions " if claim == FINITE else ""
    spent_words = (
        f"earlier look(s) {scope}at this comparison, {_named(earlier)}, spent {spent:g} of its error budget "
        f"{registered:g}"
    )
    if budget is not None and abs(budget - registered) > _SPENT:
        message = (
            f"--alpha-budget {budget:g}: the comparison's budget was registered by its first look as "
            f"{registered:g} ({spent_words}); a later look cannot change it."
        )
        return NextLook(False, 0.0, registered, spent, earlier, None, message)
    fixed = [look for look in earlier if look.kind == "fixed"]
    single = len({look.id for look in earlier}) == 1
    carry = fixed[-1].run_id if kind == "sequential" and len(fixed) == 1 and single else None
    if left == 0.0:
        message = (
            f"{spent_words}, so no error is left for another look: a new look could only add to the chance "
            f"of a wrong PASS. {_ways_forward(earlier, claim)}"
        )
        return NextLook(False, 0.0, registered, spent, earlier, carry, message)
    message = ""
    if carry is not None:
        message = (
            f"{spent_words}; a sequential continuation carries fixed run {carry!r}'s answers first, in its "
            f"order, and runs at the alpha left ({left:g})."
        )
    elif left < alpha:
        message = f"{spent_words}; this look runs at the alpha left ({left:g}), not {alpha:g}."
    return NextLook(True, min(alpha, left), registered, spent, earlier, carry, message)
