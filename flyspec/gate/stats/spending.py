"""Error spent once: the alpha ledger of one comparison (docs/gate.md, "Error spent once").

A **comparison** is one baseline against one candidate (``comparison_key``). Every run that can declare
PASS on it is a **look**: a fixed run, a sequential run (one look for all its continuations, extensions
and resumes: its confidence sequence holds at every stop), or a ``gate tune`` (one look: the fixed
sequence keeps its family-wise error at its alpha). The comparison has one **budget**, registered by its
first look (by default that look's alpha). A new look on questions that overlap earlier looks of the same
comparison may use only the budget those looks left (``alpha_left``), so the chance that any look on those
questions wrongly PASSes is at most the budget: Bonferroni over looks, whatever their dependence (each
look's own error is at most its alpha, and the probability of a union is at most the sum).

A sequential continuation of a fixed run carries the fixed run's answers into its sequence (they count
once, in the same order, at the head of the registered order) and runs at the alpha left. With the
default budget a fixed run at alpha leaves nothing: to keep the option of continuing, register the fixed
run with a budget larger than its alpha (for example alpha 0.0125 of a budget of 0.025).
tests/test_gate_stats_spending.py simulates the route fixed -> sequential continuation -> rerun under this
ledger and under the old practice (every look at the full alpha).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from flyspec.checks import is_number

LOOK_KINDS = ("fixed", "sequential", "tune")
_SPENT = 1e-12  # below this the budget is gone (floating-point remainders of a full split)
_SHOWN = 3

QuestionKey = tuple[str, str]


def comparison_key(baseline: Mapping[str, object], candidate: Mapping[str, object]) -> str:
    """A stable key for the comparison of these two arm identities (sha256 of their canonical JSON).

    Which fields make an identity is the caller's choice: the arms' decoding settings, not incidental
    request fields that do not change what is compared.
    """
    text = json.dumps({"baseline": baseline, "candidate": candidate}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Look:
    """One look at a comparison, as its registration recorded it.

    ``alpha``: the error this look may spend (a sequential run's, however many times it continues);
    ``budget``: the comparison's budget, set by the first look (None: its alpha); ``questions``: the
    questions it answered; ``carries``: for a sequential continuation, the fixed run whose answers lead
    its sequence.
    """

    run_id: str
    kind: str
    alpha: float
    questions: frozenset[QuestionKey]
    budget: float | None = None
    carries: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in LOOK_KINDS:
            raise ValueError(f"kind={self.kind!r}: one of {', '.join(LOOK_KINDS)}")
        if not is_number(self.alpha, above=0, below=0.5):
            raise ValueError(f"alpha={self.alpha!r}: must lie in (0, 0.5)")
        if self.budget is not None and not is_number(self.budget, at_least=self.alpha, below=0.5):
            raise ValueError(f"budget={self.budget!r}: must lie in [alpha, 0.5)")


def overlapping(looks: Iterable[Look], questions: Iterable[QuestionKey]) -> list[Look]:
    """The looks linked to ``questions`` through shared questions, in the order given: those sharing a
    question with them, those sharing one with those, and so on. They form one family: a wrong PASS by
    any of them is a wrong PASS about the same comparison on overlapping evidence."""
    pending = list(looks)
    keys = set(questions)
    linked: set[int] = set()
    grew = True
    while grew:
        grew = False
        for i, look in enumerate(pending):
            if i not in linked and look.questions & keys:
                linked.add(i)
                keys |= look.questions
                grew = True
    return [look for i, look in enumerate(pending) if i in linked]


def budget_of(earlier_looks: Sequence[Look]) -> float | None:
    """The budget the first of these looks registered (its alpha by default); None without looks."""
    if not earlier_looks:
        return None
    first = earlier_looks[0]
    return first.budget if first.budget is not None else first.alpha


def alpha_left(budget: float, earlier_looks: Iterable[Look]) -> float:
    """What ``budget`` leaves after the earlier looks (each distinct run counted once), never below 0."""
    spent: dict[str, float] = {}
    for look in earlier_looks:
        spent[look.run_id] = look.alpha
    left = budget - sum(spent.values())
    return 0.0 if left < _SPENT else left


@dataclass(frozen=True)
class NextLook:
    """What a new look on these questions may do.

    ``allowed``: some budget is left; ``alpha``: the most it may use (the alpha asked for, or what is
    left if less); ``budget``/``spent``: the comparison's; ``earlier``: the overlapping looks' run ids;
    ``carry``: the fixed run a sequential continuation must carry (its answers first, in its order);
    ``message``: a sentence for the command line, naming the valid way forward when refused or reduced.
    """

    allowed: bool
    alpha: float
    budget: float
    spent: float
    earlier: tuple[str, ...]
    carry: str | None
    message: str


def next_look(kind: str, questions: Iterable[QuestionKey], looks: Sequence[Look], alpha: float) -> NextLook:
    """Apply the ledger to a new look of ``kind`` asking for ``alpha`` on ``questions``, given the
    comparison's earlier ``looks`` (oldest first). Earlier looks on other questions do not count."""
    if kind not in LOOK_KINDS:
        raise ValueError(f"kind={kind!r}: one of {', '.join(LOOK_KINDS)}")
    keys = frozenset(questions)
    earlier = overlapping(looks, keys)
    if not earlier:
        return NextLook(True, alpha, alpha, 0.0, (), None, "")
    budget = budget_of(earlier)
    assert budget is not None
    left = alpha_left(budget, earlier)
    spent = budget - left
    ids = tuple(dict.fromkeys(look.run_id for look in earlier))
    fixed = [look for look in earlier if look.kind == "fixed"]
    carry = fixed[-1].run_id if kind == "sequential" and len(fixed) == 1 and len(ids) == 1 else None
    named = ", ".join(repr(i) for i in ids[:_SHOWN]) + (
        f" and {len(ids) - _SHOWN} more" if len(ids) > _SHOWN else ""
    )
    spent_words = (
        f"earlier look(s) {named} on these questions spent {spent:g} of the comparison's error budget "
        f"{budget:g}"
    )
    excludes = " ".join(f"--exclude-run {i}" for i in ids)
    if left == 0.0:
        message = (
            f"{spent_words}, so no error is left for another look: a new look could only add to the chance "
            f"of a wrong PASS. Valid ways forward: test on questions they have not used (`{excludes}`), or, "
            "next time, register the first look with a budget larger than its alpha so that a continuation "
            "has error left."
        )
        return NextLook(False, 0.0, budget, spent, ids, carry, message)
    message = ""
    if carry is not None:
        message = (
            f"{spent_words}; a sequential continuation carries fixed run {carry!r}'s answers first, in its "
            f"order, and runs at the alpha left ({left:g})."
        )
    elif left < alpha:
        message = f"{spent_words}; this look runs at the alpha left ({left:g}), not {alpha:g}."
    return NextLook(True, min(alpha, left), budget, spent, ids, carry, message)
