"""The records a run registers, typed, and their one codec (``to_json``/``from_json``, from a record's fields
and type hints; ``stored(...)`` where a field's layout differs). ``Registration.read`` reads every layout
flyspec has written (``upgrade``), ``Registration.to_dict`` writes the current one (docs/architecture.md)."""

from __future__ import annotations

import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass, replace
from functools import cache
from typing import Any, TypeVar

from flyspec.gate.grading.graders import model_graded
from flyspec.gate.stats.judged import GOLD_DRAW, gold_selected
from flyspec.gate.stats.monitor import DEFAULT_METHOD, SequentialPlan
from flyspec.gate.stats.sequence import BET, check_bet

Record = TypeVar("Record")
Lane = tuple[str, int]
BASELINE: Lane = ("baseline", 0)
DEFAULT_GOLD_RATE = 0.2
_NOTHING = object()

# ----------------------------------------------------------------------------------------- the codec


def stored(
    key: str | None = None,
    *,
    default: object = MISSING,
    absent: object = _NOTHING,
    encode: Callable[..., object] | None = None,
    decode: Callable[..., object] | None = None,
) -> Any:  # a field specifier, typed as the field it declares (as dataclasses.field is)
    """A record field whose stored layout differs from its name and type: ``key`` (``a/b``: key ``b`` of
    the object at ``a``), ``absent`` (the value written as no key, and read when the key is missing),
    ``encode``/``decode`` (a type whose layout another module owns)."""
    meta = {"key": key, "absent": absent, "encode": encode, "decode": decode}
    return field(default=default, metadata=meta)


def to_json(record: object) -> dict[str, object]:
    """The stored JSON of a record (a dataclass), by its fields and their ``stored`` metadata."""
    out: dict[str, object] = {}
    for f in fields(record):  # type: ignore[arg-type]
        value, meta = getattr(record, f.name), f.metadata
        if value == meta.get("absent", _NOTHING):
            continue
        encode = meta.get("encode")
        _put(
            out, meta.get("key") or f.name, encode(value) if encode and value is not None else _encode(value)
        )
    return out


def from_json(cls: type[Record], data: Mapping[str, object]) -> Record:
    """The record of type ``cls`` stored as ``data`` (ValueError naming a required key that is missing)."""
    values: dict[str, object] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        key, decode = f.metadata.get("key") or f.name, f.metadata.get("decode")
        value = _get(data, key)
        if value is _NOTHING:
            value = f.metadata.get("absent", _NOTHING)
        if value is _NOTHING:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ValueError(f"a stored {cls.__name__} needs the key {key!r}")
            continue
        values[f.name] = (
            decode(value) if decode and value is not None else _decode(_hints(cls)[f.name], value)
        )
    return cls(**values)


def _put(out: dict[str, object], key: str, value: object) -> None:
    *parents, last = key.split("/")
    for parent in parents:
        out = out.setdefault(parent, {})
    out[last] = value


def _get(data: Mapping[str, object], key: str) -> object:
    value: object = data
    for part in key.split("/"):
        if not isinstance(value, Mapping) or part not in value:
            return _NOTHING
        value = value[part]
    return value


def _encode(value: object) -> object:
    if is_dataclass(value) and not isinstance(value, type):
        return to_json(value)
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _encode(v) for k, v in value.items()}
    return value


_hints = cache(typing.get_type_hints)


def _decode(hint: object, value: object) -> object:
    """``value`` as the type ``hint`` names: records, optionals, tuples, mappings and plain scalars."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(inner, value)
    if isinstance(hint, type) and is_dataclass(hint):
        return from_json(hint, value if isinstance(value, Mapping) else {})
    if origin is tuple and isinstance(value, list | tuple):
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v) for v in value)
        return tuple(_decode(a, v) for a, v in zip(args, value, strict=True))
    if origin in (Mapping, dict) and isinstance(value, Mapping):
        return {str(k): _decode(args[1], v) for k, v in value.items()}
    if hint in (int, float, str, bool):
        return typing.cast(type, hint)(value)
    return value


# --------------------------------------------------------------------------------------- the records


_PLAN_KEYS = ("margin", "alpha", "max_questions", "population_size", "order_seed")
_PLAN_ABSENT = {"population": "finite", "method_key": DEFAULT_METHOD, "label_rate": None, "label_bet": 1}
"""The plan's keys left out at these values: what registrations meant before the keys were recorded (the
finite claim, the mixture, bets version 1), so those registrations and their resumes stay as they were."""


def plan_json(plan: SequentialPlan) -> dict[str, object]:
    """A sequential plan as a registration stores it: its method in words and its level beside its fields."""
    out: dict[str, object] = {"method": plan.description, "margin": plan.margin, "alpha": plan.alpha}
    out |= {"level": 1 - 2 * plan.alpha} | {key: getattr(plan, key) for key in _PLAN_KEYS[2:]}
    for key, absent in _PLAN_ABSENT.items():
        value = getattr(plan, "method" if key == "method_key" else key)
        if value not in (None, absent):
            out[key] = value
    return out


def plan_from_json(data: Mapping[str, object]) -> SequentialPlan:
    """The sequential plan a registration stored (``plan_json``), of any layout."""
    get = {key: data.get(key, absent) for key, absent in _PLAN_ABSENT.items()}
    judged = get["label_rate"] is not None
    values = {key: data[key] for key in _PLAN_KEYS if key in data} | {"population": get["population"]}
    values |= {"method": get["method_key"], "label_rate": get["label_rate"] if judged else None}
    return from_json(SequentialPlan, values | {"label_bet": get["label_bet"] if judged else None})


@dataclass(frozen=True)
class ComparisonPlan:
    """One registered comparison: the lanes it pairs, its margin, alpha and sequential plan (None: fixed),
    its role: ``candidate`` (what the run is for), ``control`` (known harmful: the gate must FAIL it) or
    ``setting`` (one of a tune's)."""

    name: str
    baseline: Lane = stored(absent=BASELINE)
    # Stored as the candidate's arm name: the lane compared is that arm's first pass.
    candidate: Lane = stored(encode=lambda lane: lane[0], decode=lambda arm: (str(arm), 0))
    margin: float
    alpha: float
    role: str = "candidate"
    sequential: SequentialPlan | None = stored(
        default=None, absent=None, encode=plan_json, decode=plan_from_json
    )

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
    """One dataset as registered: its sha256, how many of its questions the run registered and has."""

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
    """The judge a judged run registered: its model (and the one its server serves), sampling, template,
    the positions asked and the rule in words."""

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
    """A judged run's gold-label rule: the share of differing pairs drawn (``rate``) and the draw's ``seed``
    and version; ``source`` ``exact`` (each question's grader labels) or ``human``; ``every_question``: the
    judge grades every question; ``bet``: the version of the interval's bets (stats/sequence.py)."""

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
    words, the sampling rule that drew the mirrored requests, and the rule for a candidate that errors."""

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
    to: int
    at: float


@dataclass(frozen=True)
class SettingRecord:
    """One of a tune's settings: its arm name in the store (``s1``, ...), label and speculative config."""

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
    """What a tune registers besides the shared keys (its keys sit beside them when stored)."""

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


# The keys each kind of run writes (a tune's question order is ``question_order``).
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
    # gate compare: logs read after the fact, never stored.
    "compare": (*_SHARED, *_SHARED_TAIL),
}


@dataclass(frozen=True)
class Registration:
    """Everything a run registered, by kind (``gate``, ``pilot``, ``tune``, ``calibration``; the keys each
    kind writes are ``_KEYS``). ``listed``: the comparisons of a run with several (``comparisons`` gives
    every kind's); ``carries``: the fixed run a sequential continuation carries; ``order``: the question
    order (a tune's test order is ``tune.order``)."""

    kind: str
    margin: float
    alpha: float
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
    sequential: SequentialPlan | None = stored(
        default=None, absent=None, encode=plan_json, decode=plan_from_json
    )
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

    @property
    def comparisons(self) -> tuple[ComparisonPlan, ...]:
        """Every comparison the run makes, the primary one (``candidate``) first: a gate run's listed ones,
        or its one from the run's margin, alpha and sequential plan; a tune one per setting in its test
        order, each at the full alpha; none for a pilot or a calibration run."""
        if self.kind == "tune" and self.tune is not None:
            return tuple(
                ComparisonPlan(s, BASELINE, (s, 0), self.margin, self.alpha, "setting", self.sequential)
                for s in self.tune.order.settings
            )
        own = ComparisonPlan(
            "candidate", BASELINE, ("candidate", 0), self.margin, self.alpha, sequential=self.sequential
        )
        return (self.listed or (own,)) if self.kind == "gate" else ()

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

    def to_dict(self) -> dict[str, object]:
        """The stored layout of this registration (what ``GateStore.register`` writes)."""
        out = to_json(self)
        if self.kind == "tune":
            out["question_order"] = out.pop("order")
            out.update(to_json(self.tune) if self.tune is not None else {})
        return {key: value for key, value in out.items() if key in _KEYS[self.kind]}


def upgrade(kind: str, stored: Mapping[str, object]) -> dict[str, object]:
    """A registration stored by any version of flyspec, in the current layout (what ``read`` decodes)."""
    data = dict(stored)
    if kind in ("gate", "pilot") and "design" not in data:
        data["design"] = "sequential" if isinstance(data.get("sequential"), Mapping) else "fixed"
    if kind == "pilot":
        pilot = data.get("pilot")
        data["pilot"] = {"mode": "noise", **(pilot if isinstance(pilot, Mapping) else {})}
    order_key, family = ("question_order" if kind == "tune" else "order"), data.get("family")
    if not (isinstance(order := data.get(order_key), Mapping) and "rule" in order):
        data[order_key] = None
    if isinstance(family, Mapping):
        data["family"] = {"alpha": data["alpha"], **family}
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
