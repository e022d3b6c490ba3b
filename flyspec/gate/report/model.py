"""A gate report's numbers and their JSON (docs/gate.md, "The report"), the number formats and the rule."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from flyspec.gate.data.results import ArmSpeed, SharedThroughput
from flyspec.gate.data.spec import Registration
from flyspec.gate.data.store import RunRecord
from flyspec.gate.stats.decide import SUPERPOPULATION, Outcome, claim
from flyspec.gate.stats.monitor import SequentialPlan
from flyspec.gate.stats.sequence import BET

POWER_PCT = "80%"
"""The power every sample size in a report is planned for."""


def pct(value: float | None) -> str:
    """A fraction as a percentage with one decimal; ``-`` for None."""
    return "-" if value is None else f"{100 * value:.1f}%"


def num(value: float | None, digits: int) -> str:
    """A number with ``digits`` decimals; ``-`` for None."""
    return "-" if value is None else f"{value:.{digits}f}"


def points(value: float | None, *references: float) -> str:
    """``value`` (a fraction) in signed accuracy points, with enough decimals that it never reads as
    equal to one of ``references`` (zero, the margin) when it is not; ``-`` for None."""
    if value is None:
        return "-"
    digits = 1
    while digits < 4 and any(
        round(100 * value, digits) == round(100 * ref, digits) and value != ref for ref in references
    ):
        digits += 1
    return f"{100 * value:+.{digits}f}"


@dataclass
class LedgerSummary:
    """One comparison's error budget as the ledger saw it at registration (docs/gate.md, "Error spent
    once"); ``path`` is None for a run registered before the per-user ledger (``legacy``)."""

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


@dataclass
class Comparison:
    """Baseline vs candidate on one dataset, or pooled (only the pooled row of a sequential run decides)."""

    scope: str
    n: int
    registered: int
    baseline_accuracy: float | None
    candidate_accuracy: float | None
    lost: int
    gained: int
    net: int
    net_difference: float | None
    flip_rate: float | None
    exact_p: float
    mid_p: float
    ci_low: float | None
    ci_high: float | None
    noninferiority_p: float | None
    significant_loss: bool
    decision: str | None
    loss_detected: bool = False
    questions_needed: int | None = None
    questions_needed_at_observed: int | None = None
    flip_rate_upper: float | None = None
    more_questions: int | None = None
    interim_decision: str | None = None


@dataclass
class PilotSummary:
    """A pilot's flips between its two lanes and the sample size planned from their upper bound."""

    mode: str
    n: int
    flips: int
    lost: int
    gained: int
    flip_rate: float
    flip_rate_low: float
    flip_rate_high: float
    flip_rate_upper: float
    accuracy_first: float
    accuracy_second: float
    exact_p: float
    questions_needed: int | None
    questions_needed_upper: int


@dataclass
class NoiseReference:
    """The baseline's own run-to-run flips, measured by a noise pilot on the same data."""

    run_id: str
    n: int
    flips: int
    flip_rate: float
    low: float
    high: float


@dataclass
class JudgeSummary:
    """The judge's rulings on the judged questions with both answers stored: the counts of the outcomes
    add up to ``questions`` (``disagree`` and ``unreadable_pairs`` are ``undecided``); ``chose_a`` and
    ``chose_b`` count decisive verdicts by position (``position_p``: its bias test)."""

    model: str
    template: str
    questions: int
    baseline_better: int
    candidate_better: int
    disagree: int
    ties: int
    verdicts: int
    unreadable: int
    chose_a: int
    chose_b: int
    position_p: float
    identical: int = 0
    unreadable_pairs: int = 0
    undecided: int = 0
    disagreement_rate: float | None = None


@dataclass
class GoldRow:
    """A judged run's pairs on one dataset (or pooled): the judge's verdicts and the gold labels."""

    scope: str
    pairs: int = 0
    identical: int = 0
    judge_baseline: int = 0
    judge_candidate: int = 0
    judge_other: int = 0
    selected: int = 0
    labelled: int = 0
    gold_baseline: int = 0
    gold_equal: int = 0
    gold_candidate: int = 0


@dataclass
class GoldSummary:
    """A judged run's gold labels beside its decision (docs/statistics.md): the registered rule, the
    labels drawn, given and awaiting, the judge's agreement with gold, the label advice, the counts by
    dataset and the estimate; ``narrow``: the interval is under half a normal-theory one from the same
    values (their mean changed along the order)."""

    rate: float
    source: str
    pairs: int
    identical: int
    lost: int
    gained: int
    undecided: int
    selected: int
    labelled: int
    awaiting: int
    agreement: float | None
    agreement_low: float | None
    agreement_high: float | None
    advice: str | None = None
    labels_needed: int | None = None
    advised_rate: float | None = None
    draw: int = 2
    bet: int = BET
    rows: list[GoldRow] = field(default_factory=list)
    gold_exact_p: float | None = None
    estimate: float | None = None
    normal_width: float | None = None
    narrow: bool = False


@dataclass
class Exploratory:
    """A decision at a margin other than the registered one: for exploration only."""

    margin: float
    decision: str
    low: float | None
    high: float | None
    n: int
    loss_detected: bool


@dataclass
class ReportData:
    """Everything ``gate report`` shows; ``to_dict`` is its JSON (``Report`` in build.py adds markdown and
    HTML). ``registered`` is what the report decides by: the run's registration, or one comparison's view."""

    store: str
    run: RunRecord
    registered: Registration
    margin: float
    margin_overridden: bool
    alpha: float
    level: float
    comparisons: list[Comparison] = field(default_factory=list)
    speeds: list[ArmSpeed] = field(default_factory=list)
    shared: list[SharedThroughput] = field(default_factory=list)
    pilot: PilotSummary | None = None
    sequential: Outcome | None = None
    exploratory: Exploratory | None = None
    noise: NoiseReference | None = None
    judge: JudgeSummary | None = None
    gold: GoldSummary | None = None
    explanation: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    family: list[ReportData] = field(default_factory=list)
    family_alpha: float | None = None
    decided_after_minutes: float | None = None
    ledger: LedgerSummary | None = None

    @property
    def sequential_plan(self) -> SequentialPlan | None:
        """The registered sequential plan of a report decided along it (None otherwise)."""
        return self.registered.sequential if self.sequential is not None else None

    @property
    def comparison(self) -> str:
        """The candidate arm this report pairs with the baseline (``candidate`` unless it is a control's)."""
        primary = self.registered.primary
        return primary.candidate[0] if primary is not None else "candidate"

    @property
    def claim(self) -> str:
        """What a PASS (or FAIL) of this run claims, in plain words."""
        plan = self.sequential_plan
        return plan.claim if plan is not None else claim(SUPERPOPULATION)

    @property
    def role(self) -> str:
        """``candidate`` or ``control`` (a comparison the gate must FAIL)."""
        primary = self.registered.primary
        return primary.role if primary is not None else "candidate"

    @property
    def registered_margin(self) -> float:
        """The margin registered for this report's comparison (the decision's margin)."""
        return self.registered.margin

    @property
    def margin_points(self) -> str:
        """The registered margin in accuracy points, as the report writes it."""
        return f"{100 * self.registered.margin:g}"

    @property
    def pooled(self) -> Comparison | None:
        """The pooled comparison (None for a pilot)."""
        return next((c for c in self.comparisons if c.scope == "pooled"), None)

    @property
    def decision(self) -> str | None:
        """The registered pooled decision of a gate run (None for a pilot)."""
        pooled = self.pooled
        return pooled.decision if pooled is not None else None

    @property
    def design(self) -> str:
        return "sequential" if self.sequential_plan is not None else "fixed"

    @property
    def method(self) -> str:
        """How the decision's interval is computed: the registered sequential method, the
        prediction-powered interval of a fixed judged run, or Tango's."""
        if self.sequential_plan is not None:
            return self.sequential_plan.description
        if self.gold is not None:
            return (
                "prediction-powered betting interval on gold labels (Angelopoulos et al.; Waudby-Smith and "
                "Ramdas: the plug-in bet tuned to the registered size), at level 1 - 2 alpha"
            )
        return "tango"

    def rule(self) -> str:
        """The decision rule in plain words (a judged run's interval is the prediction-powered one)."""
        m, lvl = self.margin_points, f"{100 * self.level:g}%"
        along = (
            "updated after every question in the registered random order (it holds at every number of "
            "questions at once, so the run may stop at the first crossing)"
        )
        sequential, judged = self.sequential_plan is not None, self.gold is not None
        if judged:
            by = (
                f"a confidence sequence, {along}"
                if sequential
                else "an interval whose bet is tuned to the registered number of questions"
            )
            interval = (
                f"a {lvl} prediction-powered betting interval: per question, the judge's verdict corrected "
                "by the gold label where the pair was drawn for one (drawn at random, independently of the "
                f"order), averaged by {by}"
            )
        elif sequential:
            interval = f"a {lvl} betting confidence sequence, {along}"
        else:
            interval = f"Tango's {lvl} score interval"
        test = "McNemar's exact test on the gold labels" if judged else "The exact McNemar test"
        return (
            "We estimate the candidate's accuracy minus the baseline's on the same questions with "
            f"{interval}. PASS if its lower end lies above -{m} points (the candidate loses less than the "
            f"margin: non-inferior). FAIL if its upper end lies below -{m} points (it loses more than the "
            "margin). Otherwise INCONCLUSIVE; 'loss detected' when the upper end lies below zero (worse than "
            f"the baseline, by how much not yet known). {test} is reported beside the decision: it asks "
            "whether the arms differ at all, not whether a loss exceeds the margin."
        )

    def decision_object(self) -> dict[str, object]:
        """The decision object (the last key of ``to_dict``): registered margin, pooled pairs."""
        pooled = self.pooled
        assert pooled is not None
        exact = None if self.gold is not None else {"lost": pooled.lost, "gained": pooled.gained}
        return {
            "decision": pooled.decision,
            "registered_decision": pooled.decision,
            "pre_registered": self.run.kind != "compare",
            "design": self.design,
            "method": self.method,
            "claim": self.claim,
            "scope": "pooled",
            "margin": self.registered.margin,
            "alpha": self.alpha,
            "level": self.level,
            "n": pooled.n,
            "lost": pooled.lost,
            "gained": pooled.gained,
            # The object's shape stays: no pair is undecided any more (a judged run is anchored on gold
            # labels), so both one-sided tests count an exact run's pairs as they are.
            "undecided": 0,
            "counts_for_pass": exact,
            "counts_for_fail": exact,
            "disagreement_rate": self.judge.disagreement_rate if self.judge is not None else None,
            "gold_labels": self.gold.labelled if self.gold is not None else None,
            "judge_agreement": self.gold.agreement if self.gold is not None else None,
            "alpha_budget": self.ledger.budget if self.ledger is not None else None,
            "earlier_looks": self.ledger.earlier if self.ledger is not None else None,
            "net_difference": pooled.net_difference,
            "low": pooled.ci_low,
            "high": pooled.ci_high,
            "ci": [pooled.ci_low, pooled.ci_high],
            "loss_detected": pooled.loss_detected,
            "exact_p": pooled.exact_p,
            "mid_p": pooled.mid_p,
            "significant_loss": pooled.significant_loss,
            "noninferiority_p": pooled.noninferiority_p,
            "questions_needed": pooled.questions_needed,
            "questions_needed_at_observed": pooled.questions_needed_at_observed,
            "flip_rate_upper": pooled.flip_rate_upper,
            "more_questions": pooled.more_questions,
            "interim_decision": pooled.interim_decision,
            "explanation": self.explanation,
            "advice": self.advice,
            "rule": self.rule(),
        }

    def to_dict(self) -> dict[str, object]:
        """JSON-ready report; for a gate run the last key is ``decision``."""
        out: dict[str, object] = {
            "store": self.store,
            "run_id": self.run.run_id,
            "kind": self.run.kind,
            "design": self.design,
            "registered_margin": self.registered.margin,
            "margin": self.margin,
            "margin_overridden": self.margin_overridden,
            "alpha": self.alpha,
            "level": self.level,
            "warnings": self.warnings,
            "registration": self.run.registration,
            "run_notes": self.run.notes,
            "comparisons": [asdict(c) for c in self.comparisons],
            "speeds": [asdict(s) for s in self.speeds],
            "shared_engine_speeds": [asdict(s) for s in self.shared],
            "noise": asdict(self.noise) if self.noise is not None else None,
            "judge": asdict(self.judge) if self.judge is not None else None,
            "gold": asdict(self.gold) if self.gold is not None else None,
            "notes": self.notes,
        }
        if self.run.kind == "pilot":
            out["pilot"] = asdict(self.pilot) if self.pilot is not None else None
            return out
        out["ledger"] = asdict(self.ledger) if self.ledger is not None else None
        out["registered_decision"] = self.decision
        out["exploratory"] = asdict(self.exploratory) if self.exploratory is not None else None
        if self.sequential is not None and self.sequential_plan is not None:
            out["sequential"] = {
                **asdict(self.sequential),
                "max_questions": self.sequential_plan.max_questions,
                "population_size": self.sequential_plan.population_size,
                "order_seed": self.sequential_plan.order_seed,
                "method": self.sequential_plan.description,
                "population": self.sequential_plan.population,
            }
        if self.family:
            out["family_alpha"] = self.family_alpha
            out["family"] = [
                {k: v for k, v in f.to_dict().items() if k not in ("registration", "run_notes")}
                for f in self.family
            ]
        out["comparison"] = self.comparison
        out["role"] = self.role
        out["decided_after_minutes"] = self.decided_after_minutes
        out["decision"] = self.decision_object()
        return out
