"""The gate's records: a run's registration, typed, as frozen dataclasses that flyspec/gate/data/codec.py
turns into the JSON the store keeps and back. ``Registration`` adds one thing by hand: which keys each
kind of run writes.

Older layouts are upgraded in one function, ``upgrade``, before decoding: a gate run before its design
was recorded (sequential when it has a sequential plan, else fixed), a pilot before its mode (noise), a
family before its alpha (the run's), datasets before their entries, a question order before its rule
(none), a tune setting before its label (its id). A sequential plan before its claim was a choice reads as
finite (``SequentialPlan.from_registration``). Two rules this flyspec no longer applies are refused
(``refuse_retired``): a judged run registered before gold labels, and one registered with gold-label draw
1 (a gold rule without a draw); flyspec at git commit 82c2716 reads them.
``Registration.to_dict`` writes the current layout; it is what a resume is compared with, key for key, so
a run registered by this version writes exactly what it wrote.

A comparison pairs the baseline's lane with one candidate's lane and tests it against a margin at an
alpha, with a fixed or a sequential design. A plain gate run makes one (``candidate``); a run with
controls (``flyspec demo``) makes one more per control, each with its own share of the run's alpha
(Bonferroni: the shares add up to the run's alpha, so the chance of any wrong decision in the family
stays at most alpha whatever the dependence between the comparisons, which share the baseline's answers);
a tune makes one per setting, each at the full alpha, tested in a fixed sequence (docs/statistics.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from flyspec.gate.data.codec import from_json, stored, to_json
from flyspec.gate.grading.graders import model_graded
from flyspec.gate.stats.judged import GOLD_DRAW, gold_selected
from flyspec.gate.stats.monitor import SequentialPlan
from flyspec.gate.stats.sequence import BET, check_bet

Lane = tuple[str, int]
BASELINE: Lane = ("baseline", 0)
ROLES = ("candidate", "control", "setting")
DEFAULT_GOLD_RATE = 0.2
LAST_READER = "82c2716"
"""The last flyspec (0.1.0, by its git commit) that reads runs registered under the retired rules."""
RETIRED_RULES = {
    "judged run registered before gold labels": "the judge's undecided pairs counted against the claim",
    "gold-label draw 1": "the pairs drawn for a gold label were the start of the question order",
}
"""The judged rules this flyspec no longer decides, with what each did (``refuse_retired``)."""


def _sequential() -> Any:
    """A sequential plan, in the layout flyspec/gate/stats/monitor.py owns (None: a fixed design)."""
    return stored(
        default=None, absent=None, encode=SequentialPlan.to_dict, decode=SequentialPlan.from_registration
    )


@dataclass(frozen=True)
class ComparisonPlan:
    """One registered comparison: the lanes it pairs, its margin and alpha, its sequential plan (None for
    a fixed design) and its role: ``candidate`` (the comparison the run is for), ``control`` (a setting
    known to be harmful, which the gate must FAIL) or ``setting`` (one of a tune's settings)."""

    name: str
    baseline: Lane = stored(absent=BASELINE, written=False)
    # Stored as the candidate's arm name: the lane compared is that arm's first pass.
    candidate: Lane = stored(encode=lambda lane: lane[0], decode=lambda arm: (str(arm), 0))
    margin: float = stored()
    alpha: float = stored()
    role: str = "candidate"
    sequential: SequentialPlan | None = _sequential()

    @property
    def lanes(self) -> tuple[Lane, Lane]:
        """The baseline's lane and the candidate's, in that order."""
        return (self.baseline, self.candidate)


@dataclass(frozen=True)
class SamplingRecord:
    """The sampling every arm of the run used."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None


@dataclass(frozen=True)
class DatasetEntry:
    """One dataset as registered: its sha256, how many of its questions the run registered (not for a
    tune, which registers calibration and test questions) and how many it holds."""

    sha256: str | None = None
    questions: int | None = stored(default=None, absent=None)
    available: int | None = stored(default=None, absent=None)


@dataclass(frozen=True)
class QuestionOrder:
    """How the questions were ordered (``rule`` with ``seed``) and how many they were drawn from."""

    seed: int
    rule: str
    pool: int


@dataclass(frozen=True)
class Excluded:
    """The runs whose questions were left out, and how many questions that was."""

    runs: tuple[str, ...] = ()
    questions: int = 0


@dataclass(frozen=True)
class JudgeRecord:
    """The judge a judged run registered: its model (and the model its server reported serving), its
    sampling, the prompt template (name, sha256, text), the positions asked and the rule in words."""

    model: str | None = None
    max_tokens: int | None = stored("sampling/max_tokens", default=None)
    seed: int | None = stored("sampling/seed", default=None)
    template: str | None = None
    template_sha256: str | None = None
    template_text: str | None = None
    positions: tuple[str, ...] = ()
    rule: str | None = None
    served_model: Mapping[str, object] | None = stored(default=None, absent=None)
    temperature: float = stored("sampling/temperature", default=0.0)
    kind: str = "openai"

    @property
    def sampling(self) -> dict[str, object]:
        return {"temperature": self.temperature, "max_tokens": self.max_tokens, "seed": self.seed}


@dataclass(frozen=True)
class Gold:
    """A judged run's registered gold-label rule: ``rate`` (the share of differing pairs drawn), ``seed``
    (of the draw), ``source`` (``exact``: the question's own grader labels it at once; ``human``: a person
    labels it with ``flyspec gate label``), ``every_question`` (the judge grades every question, not only
    those with grader ``judge``), ``draw``, the version of the draw (``gold_draw``, independent of the
    question order), and ``bet``, the version of the interval's bets (flyspec/gate/stats/sequence.py,
    ``BET_VERSIONS``; a run registered before the versions reads as 1). flyspec/gate/stats/judged.py has
    the statistics."""

    rate: float
    seed: int
    source: str
    every_question: bool = stored("all", default=False)
    draw: int = GOLD_DRAW
    bet: int = stored(default=BET, absent=1)

    def __post_init__(self) -> None:
        check_bet(self.bet)
        if self.draw != GOLD_DRAW:
            raise ValueError(f"gold-label draw {self.draw} is unknown to this flyspec (it draws {GOLD_DRAW})")

    def selected(self, dataset: str, question_id: str) -> bool:
        """Whether this rule draws the question's pair for a gold label."""
        return gold_selected(self.seed, dataset, question_id, self.rate)

    def judged(self, grader: str) -> bool:
        """Whether a question with this grader is graded by the judge."""
        return self.every_question or model_graded(grader)


@dataclass(frozen=True)
class ShadowRecord:
    """What a live-traffic run (``flyspec gate shadow``) registers besides a judged run's keys: the claim in
    words, the sampling rule that drew the mirrored requests (``SamplingRule.describe()``), and the rule
    for a candidate that errors or times out (a wrong answer there, not a skip)."""

    claim: str
    sampling: Mapping[str, object]
    errors: str


@dataclass(frozen=True)
class Family:
    """How a run with several comparisons split its alpha (``alpha``: the run's, ``procedure``: in words)."""

    alpha: float
    procedure: str = ""


@dataclass(frozen=True)
class Extension:
    """A sequential run continued past its registered maximum: from how many questions to how many, when."""

    start: int = stored("from")
    to: int = stored()
    at: float = stored()


@dataclass(frozen=True)
class SettingRecord:
    """One of a tune's settings as registered: its arm name in the store (``s1``, ...), its label and the
    speculative config to paste."""

    id: str
    label: str
    speculative_config: Mapping[str, object]

    @property
    def title(self) -> str:
        """The label with its policy's name, e.g. ``FLy W=2, theta=0.3``."""
        return titled(self.speculative_config, self.label)


def titled(spec: Mapping[str, object], label: str) -> str:
    """``label`` preceded by the name of the policy ``spec`` verifies with."""
    from flyspec.config import verification_policy

    return f"{verification_policy(str(spec.get('rejection_sample_method', 'standard'))).title} {label}"


@dataclass(frozen=True)
class TestOrder:
    """A tune's registered test order: ``given`` (the candidates' order) or ``speed`` (by ``by`` on the
    calibration run, slowest first: ``values`` per setting, ``fallback`` when the measure changed)."""

    method: str
    settings: tuple[str, ...] = ()
    by: str | None = stored(default=None, absent=None)
    direction: str | None = stored(default=None, absent=None)
    calibration_run: str | None = stored(default=None, absent=None)
    values: Mapping[str, float] | None = stored(default=None, absent=None)
    fallback: str | None = stored(default=None, absent=None)


@dataclass(frozen=True)
class TuneRecord:
    """What a tune registers besides the shared keys: the procedure in words, the test order, its
    calibration (the run and its questions, in order) and the number of test questions."""

    procedure: str | None
    order: TestOrder
    calibration_run: str | None = stored("calibration/run", default=None)
    calibration_questions: tuple[tuple[str, str], ...] = stored("calibration/questions", default=())
    test_questions: int | None = None


@dataclass(frozen=True)
class CalibrationRecord:
    """A tune's calibration run: its question count, that its answers are not graded, and its tune."""

    questions: int
    tune: str
    graded: bool = False


# The keys each kind of run writes (a tune's question order is ``question_order``, its own record's keys sit
# beside the shared ones).
_SHARED = ("margin", "alpha", "seed", "sampling", "arms", "shuffle_seed", "datasets", "alpha_budget")
_SHARED_TAIL = ("excluded", "sequential", "extensions")
_RUN = ("repeats", "limit", "max_questions", "order", "carries", "comparisons", "family", "pilot", "judge")
# A gate run fed by live traffic (flyspec gate shadow) also writes ``shadow``; other runs write no key.
_TUNE = ("procedure", "order", "calibration", "test_questions")
_KEYS = {
    "gate": (*_SHARED, *_SHARED_TAIL, *_RUN, "gold", "design", "shadow"),
    "pilot": (*_SHARED, *_SHARED_TAIL, *_RUN, "gold", "design"),
    "tune": (*_SHARED, *_SHARED_TAIL, "settings", "max_questions", "design", "question_order", *_TUNE),
    "calibration": (*_SHARED, *_SHARED_TAIL, "settings", "calibration"),
    # ``flyspec gate compare``: logs read after the fact, never stored; its report reads the shared keys.
    "compare": (*_SHARED, *_SHARED_TAIL),
}


@dataclass(frozen=True)
class Registration:
    """Everything a run registered, by kind (``gate``, ``pilot``, ``tune``, ``calibration``).

    Every kind: ``margin``, ``alpha``, ``seed``, ``sampling``, ``arms`` (each arm's identity, as its kind
    wrote it), ``shuffle_seed``, ``alpha_budget`` (None: none registered), ``datasets``, ``excluded``.
    A gate run or pilot: ``repeats``, ``limit``, ``max_questions``, ``order``, ``design``, ``sequential``,
    ``listed`` (the comparisons of a run with several; ``comparisons`` gives every kind's), ``family``,
    ``carries`` (the fixed run a sequential continuation carries), ``pilot_mode``, ``judge``, ``gold``,
    ``extensions``, ``shadow`` (a run fed by live traffic: its claim, sampling and error rule). A tune:
    ``settings``, ``order`` (the question order), ``max_questions``, ``design``, ``sequential`` and
    ``tune``. A calibration run: ``settings`` and ``calibration``.
    """

    kind: str
    margin: float = stored()
    alpha: float = stored()
    seed: int = 0
    sampling: SamplingRecord | None = None
    arms: Mapping[str, Mapping[str, object]] = field(default_factory=dict)
    shuffle_seed: int | None = None
    alpha_budget: float | None = stored(default=None, absent=None)
    datasets: Mapping[str, DatasetEntry] = field(default_factory=dict)
    excluded: Excluded | None = stored(default=None, absent=None)
    repeats: tuple[int, ...] = ()
    limit: int | None = None
    max_questions: int | None = None
    order: QuestionOrder | None = None
    design: str | None = stored(default=None, absent=None)
    sequential: SequentialPlan | None = _sequential()
    listed: tuple[ComparisonPlan, ...] = stored("comparisons", default=(), absent=())
    family: Family | None = stored(default=None, absent=None)
    carries: str | None = stored(default=None, absent=None)
    pilot_mode: str | None = stored("pilot/mode", default=None, absent=None)
    judge: JudgeRecord | None = stored(default=None, absent=None)
    gold: Gold | None = stored(default=None, absent=None)
    extensions: tuple[Extension, ...] = stored(default=(), absent=())
    settings: tuple[SettingRecord, ...] = ()
    tune: TuneRecord | None = stored(default=None, absent=None)
    calibration: CalibrationRecord | None = stored(default=None, absent=None)
    shadow: ShadowRecord | None = stored(default=None, absent=None)

    # ------------------------------------------------------------------------------------- reading

    @property
    def comparisons(self) -> tuple[ComparisonPlan, ...]:
        """Every comparison the run makes, the primary one (``candidate``) first: a gate run's listed ones,
        or its one from the run's margin, alpha and sequential plan; a tune one per setting in its test
        order, each at the full alpha; none for a pilot or a calibration run."""
        if self.kind == "gate":
            if self.listed:
                return self.listed
            candidate = ("candidate", 0)
            return (
                ComparisonPlan(
                    "candidate", BASELINE, candidate, self.margin, self.alpha, sequential=self.sequential
                ),
            )
        if self.kind == "tune" and self.tune is not None:
            return tuple(
                ComparisonPlan(s, BASELINE, (s, 0), self.margin, self.alpha, "setting", self.sequential)
                for s in self.tune.order.settings
            )
        return ()

    @property
    def primary(self) -> ComparisonPlan | None:
        """The comparison a run is for (None for a pilot or a calibration run)."""
        return next(iter(self.comparisons), None)

    @property
    def design_name(self) -> str:
        """``sequential`` or ``fixed`` (a calibration run, which tests nothing, reads as fixed)."""
        return self.design or "fixed"

    @property
    def lanes(self) -> tuple[Lane, Lane]:
        """The two lanes a report pairs: two passes of the baseline in a noise pilot, else the baseline and
        the primary comparison's candidate."""
        if self.kind == "pilot" and self.pilot_mode in (None, "noise"):
            return (BASELINE, ("baseline", 1))
        primary = self.primary
        return (BASELINE, primary.candidate if primary is not None else ("candidate", 0))

    @property
    def tune_name(self) -> str | None:
        """The tune a calibration run belongs to."""
        return self.calibration.tune if self.calibration is not None else None

    def setting(self, setting_id: str) -> SettingRecord:
        """The registered setting with id ``setting_id`` (a tune's or its calibration run's)."""
        return next(s for s in self.settings if s.id == setting_id)

    def for_comparison(self, plan: ComparisonPlan) -> Registration:
        """The registration as the report of one of its comparisons reads it: that comparison first, its
        margin, alpha and sequential plan in place of the run's."""
        others = tuple(p for p in self.comparisons if p != plan)
        return replace(
            self, margin=plan.margin, alpha=plan.alpha, sequential=plan.sequential, listed=(plan, *others)
        )

    @classmethod
    def read(cls, kind: str, stored: Mapping[str, object]) -> Registration:
        """The registration of a run of ``kind`` from its stored JSON, in any layout flyspec has written."""
        if kind not in _KEYS:
            raise ValueError(f"run kind {kind!r}: one of {', '.join(_KEYS)}")
        data = {key: value for key, value in upgrade(kind, stored).items() if key in _KEYS[kind]}
        if kind == "tune":
            own = {key: data.pop(key) for key in _TUNE if key in data}
            data["tune"] = own if "order" in own else None
            data["order"] = data.pop("question_order", None)
        registration = from_json(cls, {**data, "kind": kind})
        # The run's own comparison is its primary one.
        listed = sorted(registration.listed, key=lambda c: c.role != "candidate")
        return replace(registration, listed=tuple(listed))

    # ------------------------------------------------------------------------------------- writing

    def to_dict(self) -> dict[str, Any]:
        """The stored layout of this registration (what ``GateStore.register`` writes)."""
        out = to_json(self)
        if self.kind == "tune":
            out["question_order"] = out.pop("order")
            out.update(out.pop("tune", {}))
        return {key: value for key, value in out.items() if key in _KEYS[self.kind]}


def keeping_bets(registration: Registration, stored: Registration | None) -> Registration:
    """``registration`` with the version of the interval's bets that ``stored`` (the run it resumes, if
    any) registered: a judged run keeps the bets its first pairs were registered with, so the same
    command resumes a run registered before the current version."""
    if stored is None or stored.gold is None or registration.gold is None:
        return registration
    bet = stored.gold.bet

    def plan(sequential: SequentialPlan | None) -> SequentialPlan | None:
        if sequential is None or sequential.label_bet is None:
            return sequential
        return replace(sequential, label_bet=bet)

    return replace(
        registration,
        gold=replace(registration.gold, bet=bet),
        sequential=plan(registration.sequential),
        listed=tuple(replace(c, sequential=plan(c.sequential)) for c in registration.listed),
    )


def refuse_retired(kind: str, stored: Mapping[str, object], where: str) -> None:
    """ValueError, naming the rule and the flyspec that reads it, for a run (``where``) registered under a
    retired judged rule (``RETIRED_RULES``): its decision would not be a valid test, so this flyspec does
    not compute one."""
    judge, gold = stored.get("judge"), stored.get("gold")
    if kind not in ("gate", "pilot"):
        return
    if isinstance(gold, Mapping) and "draw" not in gold:
        rule = "gold-label draw 1"
    elif isinstance(judge, Mapping) and not isinstance(gold, Mapping):
        rule = "judged run registered before gold labels"
    else:
        return
    raise ValueError(
        f"{where} was registered under a retired rule, the {rule} ({RETIRED_RULES[rule]}), so its decision "
        f"would not be a valid test and this flyspec does not read it: use flyspec at git commit "
        f"{LAST_READER} or earlier to read it (flyspec 0.1.0 as of that commit), and start a new judged run"
    )


def upgrade(kind: str, stored: Mapping[str, object]) -> dict[str, Any]:
    """A registration stored by any version of flyspec, in the current layout (what ``read`` decodes)."""
    refuse_retired(kind, stored, "this run")
    data = dict(stored)
    if kind in ("gate", "pilot") and "design" not in data:
        data["design"] = "sequential" if isinstance(data.get("sequential"), Mapping) else "fixed"
    if kind == "pilot":
        pilot = data.get("pilot")
        data["pilot"] = {"mode": "noise", **(pilot if isinstance(pilot, Mapping) else {})}
    order_key = "question_order" if kind == "tune" else "order"
    if not (isinstance(data.get(order_key), Mapping) and "rule" in data[order_key]):
        data[order_key] = None
    if isinstance(data.get("family"), Mapping):
        data["family"] = {"alpha": data["alpha"], **data["family"]}
    data["datasets"] = {
        name: info if isinstance(info, Mapping) else {"sha256": None}
        for name, info in (data.get("datasets") or {}).items()
    }
    data["settings"] = [{"label": s["id"], **s} for s in data.get("settings") or ()]
    if not data.get("excluded"):
        data.pop("excluded", None)
    for key in ("sampling", "judge", "gold", "family", "sequential", "calibration", "shadow"):
        if not isinstance(data.get(key), Mapping):
            data.pop(key, None)
    return data


def only_the_maximum_grew(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether two stored registrations of a sequential run are the same but for its maximum (the
    sequential plan's and each comparison's ``max_questions``, the datasets' question counts and the run's
    ``max_questions``) and its extensions: what continuing it past its maximum may change."""

    def without_maximum(reg: Mapping[str, Any]) -> dict[str, Any]:
        sequential = {k: v for k, v in reg["sequential"].items() if k != "max_questions"}
        comparisons = [
            {**c, "sequential": {k: v for k, v in c["sequential"].items() if k != "max_questions"}}
            if isinstance(c, dict) and isinstance(c.get("sequential"), dict)
            else c
            for c in reg.get("comparisons", [])
        ]
        datasets = {
            name: {k: v for k, v in info.items() if k != "questions"} if isinstance(info, dict) else info
            for name, info in reg.get("datasets", {}).items()
        }
        dropped = ("max_questions", "extensions", "sequential", "datasets", "comparisons")
        others = {k: v for k, v in reg.items() if k not in dropped}
        return {**others, "sequential": sequential, "datasets": datasets, "comparisons": comparisons}

    if "sequential" not in old or "sequential" not in new:
        return False
    return without_maximum(old) == without_maximum(new)
