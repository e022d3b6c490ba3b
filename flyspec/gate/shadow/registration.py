"""What a shadow run registers before the first mirrored request: a sequential gate run, judged
(with gold labels) or graded against the baseline's answer, whose questions are the mirrored requests in
arrival order, with the claim, the sampling rule and the rule for candidate errors beside a run's keys
(``ShadowRecord``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flyspec.checks import is_int, is_number
from flyspec.gate.arms.judge import Judge
from flyspec.gate.data.spec import (
    DEFAULT_GOLD_RATE,
    DatasetEntry,
    Gold,
    QuestionOrder,
    Registration,
    ShadowRecord,
)
from flyspec.gate.grading.graders import check_grader, grader_named
from flyspec.gate.stats.monitor import JUDGED_METHOD, SequentialPlan

DATASET = "shadow"
"""The dataset name of a shadow run's questions in the store and its reports."""
DEFAULT_MAX_PAIRS = 100_000
"""The registered maximum of a run started without --max-pairs (the sequence is valid at every size)."""
ORDER_RULE = "arrival order: each mirrored request is the next question once both arms have answered it"
CLAIM = (
    "the candidate against production on this traffic: each mirrored request is a random draw from the "
    "requests clients sent while the run lasted (by the registered sampling rule), so a decision speaks for "
    "that traffic in that period. Traffic drifts: a later mix of requests may differ."
)
ERRORS = (
    "a candidate answer that is an HTTP error, a timeout or not a completion is a wrong answer on that "
    "request (the baseline's is right there): the pair counts as a known loss, never as a skip"
)


@dataclass(frozen=True)
class ShadowPlan:
    """The decision settings of a shadow run: run name, margin, alpha, how pairs are graded (``judge``: a
    judged run, its gold labels drawn at ``gold_rate`` with ``seed``; or ``grader``, a pairwise exact
    grader such as ``equivalent_to_baseline:whitespace``, no judge and no labels), and the registered
    maximum of pairs."""

    run_id: str
    margin: float
    alpha: float
    judge: Judge | None
    gold_rate: float = DEFAULT_GOLD_RATE
    seed: int = 0
    max_pairs: int = DEFAULT_MAX_PAIRS
    grader: str | None = None

    def __post_init__(self) -> None:
        if (self.judge is None) == (self.grader is None):
            raise ValueError(
                "gate shadow grades each pair one way: give --judge JUDGE or --grader "
                "equivalent_to_baseline[:normaliser], not both and not neither"
            )
        if self.grader is not None:
            found, _ = grader_named(self.grader)
            if found.grade_pair is None or found.model_graded:
                raise ValueError(
                    f"--grader={self.grader!r}: live traffic has no reference answers, so the grader must "
                    "compare the candidate's answer with production's (equivalent_to_baseline[:normaliser])"
                )
            object.__setattr__(self, "grader", check_grader(self.grader))
        if not is_number(self.margin, above=0, below=1):
            raise ValueError(f"--margin={self.margin!r}: the tolerated loss must be in (0, 1)")
        if not is_number(self.alpha, above=0, below=0.5):
            raise ValueError(f"--alpha={self.alpha!r}: must be in (0, 0.5)")
        if not is_number(self.gold_rate, above=0, at_most=1):
            raise ValueError(f"--gold-rate={self.gold_rate!r}: the share of pairs labelled must be in (0, 1]")
        if not is_int(self.max_pairs, 1):
            raise ValueError(f"--max-pairs={self.max_pairs!r}: must be a positive integer")
        if not self.run_id:
            raise ValueError("--run: a shadow run needs a name")

    @property
    def gold(self) -> Gold | None:
        """The registered gold-label draw of a judged run (the current draw, labels given by people)."""
        return Gold(self.gold_rate, self.seed, "human") if self.judge is not None else None


def shadow_registration(
    plan: ShadowPlan, baseline: Any, candidate: Any, sampling: dict[str, Any]
) -> Registration:
    """The registration of a shadow run: a sequential gate run (i.i.d. claim) of ``candidate`` against
    ``baseline`` (endpoint arms), judged (the prediction-powered sequence on gold labels) or graded
    exactly against the baseline's answer, with ``sampling`` the sampling rule's description."""
    gold = plan.gold
    judged = (
        {"method": JUDGED_METHOD, "label_rate": gold.rate, "label_bet": gold.bet} if gold is not None else {}
    )
    sequential = SequentialPlan(plan.margin, plan.alpha, plan.max_pairs, plan.max_pairs, plan.seed, **judged)
    return Registration(
        kind="gate",
        margin=plan.margin,
        alpha=plan.alpha,
        seed=plan.seed,
        arms={"baseline": baseline.identity(None), "candidate": candidate.identity(None)},
        datasets={DATASET: DatasetEntry()},
        repeats=(0,),
        max_questions=plan.max_pairs,
        order=QuestionOrder(plan.seed, ORDER_RULE, plan.max_pairs),
        design="sequential",
        sequential=sequential,
        judge=plan.judge.identity(None) if plan.judge is not None else None,
        gold=gold,
        shadow=ShadowRecord(CLAIM, sampling, ERRORS),
    )
