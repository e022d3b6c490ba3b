"""A run's registration, typed: what every kind of run registers before its first answer, and the one place
that knows the stored layout.

``Registration.read(kind, stored)`` reads every layout flyspec has stored, so runs registered by older
versions still load, recompute their decisions and resume: a gate run before its comparisons had entries
of their own (one comparison, from the run's margin, alpha and sequential plan), before its design was
recorded (sequential when it has a sequential plan, else fixed), a sequential plan before its claim was a
choice (finite; ``SequentialPlan``), a judged run before gold labels (no rule) or with the gold-label draw
1 (``Gold``), a run before the alpha budget. ``to_dict`` writes the current layout; it is what a resume is
compared with, key for key, so a run registered by this version writes exactly what it wrote.

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

from flyspec.gate.data.gold import Gold
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
        return cls(
            name=str(data["name"]),
            baseline=BASELINE,
            candidate=(str(data["candidate"]), 0),
            margin=float(data["margin"]),
            alpha=float(data["alpha"]),
            role=str(data.get("role", "candidate")),
            sequential=_sequential(data.get("sequential")),
        )


def _sequential(data: Any) -> SequentialPlan | None:
    return SequentialPlan.from_registration(data) if isinstance(data, Mapping) else None


@dataclass(frozen=True)
class SamplingRecord:
    """The sampling every arm of the run used."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingRecord:
        return cls(data.get("temperature"), data.get("top_p"), data.get("max_tokens"))


@dataclass(frozen=True)
class DatasetEntry:
    """One dataset as registered: its sha256, how many of its questions the run registered (not for a
    tune, which registers calibration and test questions) and how many it holds."""

    sha256: str | None
    questions: int | None = None
    available: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sha256": self.sha256}
        if self.questions is not None:
            out["questions"] = self.questions
        if self.available is not None:
            out["available"] = self.available
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DatasetEntry:
        return cls(data.get("sha256"), data.get("questions"), data.get("available"))


@dataclass(frozen=True)
class QuestionOrder:
    """How the questions were ordered (``rule`` with ``seed``) and how many they were drawn from."""

    seed: int
    rule: str
    pool: int

    def to_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "rule": self.rule, "pool": self.pool}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuestionOrder:
        return cls(int(data["seed"]), str(data["rule"]), int(data["pool"]))


@dataclass(frozen=True)
class Excluded:
    """The runs whose questions were left out, and how many questions that was."""

    runs: tuple[str, ...]
    questions: int

    def to_dict(self) -> dict[str, Any]:
        return {"runs": list(self.runs), "questions": self.questions}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Excluded:
        return cls(tuple(str(r) for r in data.get("runs") or ()), int(data.get("questions", 0)))


@dataclass(frozen=True)
class JudgeRecord:
    """The judge a judged run registered: its model (and the model its server reported serving), its
    sampling, the prompt template (name, sha256, text), the positions asked and the rule in words."""

    model: str | None
    max_tokens: int | None
    seed: int | None
    template: str | None
    template_sha256: str | None
    template_text: str | None = None
    positions: tuple[str, ...] = ()
    rule: str | None = None
    served_model: Mapping[str, Any] | None = None
    temperature: float = 0.0

    @property
    def sampling(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "max_tokens": self.max_tokens, "seed": self.seed}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": "openai",
            "model": self.model,
            "sampling": self.sampling,
            "template": self.template,
            "template_sha256": self.template_sha256,
            "template_text": self.template_text,
            "positions": list(self.positions),
            "rule": self.rule,
        }
        if self.served_model is not None:
            out["served_model"] = self.served_model
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JudgeRecord:
        sampling = data.get("sampling") or {}
        return cls(
            model=data.get("model"),
            max_tokens=sampling.get("max_tokens"),
            seed=sampling.get("seed"),
            template=data.get("template"),
            template_sha256=data.get("template_sha256"),
            template_text=data.get("template_text"),
            positions=tuple(data.get("positions") or ()),
            rule=data.get("rule"),
            served_model=data.get("served_model"),
            temperature=float(sampling.get("temperature", 0.0)),
        )


@dataclass(frozen=True)
class Family:
    """How a run with several comparisons split its alpha (``alpha``: the run's, ``procedure``: in words)."""

    alpha: float
    procedure: str

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], alpha: float) -> Family:
        return cls(float(data.get("alpha", alpha)), str(data.get("procedure", "")))


@dataclass(frozen=True)
class Extension:
    """A sequential run continued past its registered maximum: from how many questions to how many, when."""

    start: int
    to: int
    at: float

    def to_dict(self) -> dict[str, Any]:
        return {"from": self.start, "to": self.to, "at": self.at}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Extension:
        return cls(int(data["from"]), int(data["to"]), float(data["at"]))


@dataclass(frozen=True)
class SettingRecord:
    """One of a tune's settings as registered: its arm name in the store (``s1``, ...), its label and the
    speculative config to paste."""

    id: str
    label: str
    speculative_config: Mapping[str, Any]

    @property
    def title(self) -> str:
        """The label with its policy's name, e.g. ``FLy W=2, theta=0.3``."""
        return titled(self.speculative_config, self.label)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "label": self.label, "speculative_config": dict(self.speculative_config)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SettingRecord:
        return cls(str(data["id"]), str(data.get("label", data["id"])), data.get("speculative_config") or {})


def titled(spec: Mapping[str, Any], label: str) -> str:
    """``label`` preceded by the name of the policy ``spec`` verifies with."""
    from flyspec.config import verification_policy

    return f"{verification_policy(spec.get('rejection_sample_method', 'standard')).title} {label}"


@dataclass(frozen=True)
class TestOrder:
    """A tune's registered test order: ``given`` (the candidates' order) or ``speed`` (by ``by`` on the
    calibration run, slowest first: ``values`` per setting, ``fallback`` when the measure changed)."""

    method: str
    settings: tuple[str, ...]
    by: str | None = None
    direction: str | None = None
    calibration_run: str | None = None
    values: Mapping[str, float] | None = None
    fallback: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.method, "settings": list(self.settings)}
        speed = {
            "by": self.by,
            "direction": self.direction,
            "calibration_run": self.calibration_run,
            "values": self.values,
        }
        if self.method == "speed":
            out.update(speed)
        if self.fallback is not None:
            out["fallback"] = self.fallback
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TestOrder:
        return cls(
            str(data["method"]),
            tuple(str(s) for s in data.get("settings") or ()),
            data.get("by"),
            data.get("direction"),
            data.get("calibration_run"),
            data.get("values"),
            data.get("fallback"),
        )


@dataclass(frozen=True)
class TuneRecord:
    """What a tune registers besides the shared keys: the procedure in words, the test order, its
    calibration (the run and its questions, in order) and the number of test questions."""

    procedure: str | None
    order: TestOrder
    calibration_run: str | None
    calibration_questions: tuple[tuple[str, str], ...]
    test_questions: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "procedure": self.procedure,
            "order": self.order.to_dict(),
            "calibration": {
                "run": self.calibration_run,
                "questions": [list(key) for key in self.calibration_questions],
            },
            "test_questions": self.test_questions,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TuneRecord:
        calibration = data.get("calibration") or {}
        return cls(
            data.get("procedure"),
            TestOrder.from_dict(data["order"]),
            calibration.get("run"),
            tuple((str(d), str(q)) for d, q in calibration.get("questions") or ()),
            data.get("test_questions"),
        )


@dataclass(frozen=True)
class CalibrationRecord:
    """A tune's calibration run: its question count, that its answers are not graded, and its tune."""

    questions: int
    tune: str
    graded: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"questions": self.questions, "graded": self.graded, "tune": self.tune}


@dataclass(frozen=True)
class Registration:
    """Everything a run registered, by kind (``gate``, ``pilot``, ``tune``, ``calibration``).

    Every kind: ``margin``, ``alpha``, ``seed``, ``sampling``, ``arms`` (each arm's identity, as its kind
    wrote it), ``shuffle_seed``, ``alpha_budget`` (None: none registered), ``datasets``, ``excluded``.
    A gate run or pilot: ``repeats``, ``limit``, ``max_questions``, ``order``, ``design``, ``sequential``,
    ``listed`` (the comparisons of a run with several; ``comparisons`` gives every kind's), ``family``,
    ``carries`` (the fixed run a sequential continuation carries), ``pilot_mode``, ``judge``, ``gold``,
    ``extensions``. A tune: ``settings``, ``order`` (the question order), ``max_questions``, ``design``,
    ``sequential`` and ``tune``. A calibration run: ``settings`` and ``calibration``.
    """

    kind: str
    margin: float
    alpha: float
    seed: int = 0
    sampling: SamplingRecord | None = None
    arms: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    shuffle_seed: int | None = None
    alpha_budget: float | None = None
    datasets: Mapping[str, DatasetEntry] = field(default_factory=dict)
    excluded: Excluded | None = None
    repeats: tuple[int, ...] = ()
    limit: int | None = None
    max_questions: int | None = None
    order: QuestionOrder | None = None
    design: str | None = None
    sequential: SequentialPlan | None = None
    listed: tuple[ComparisonPlan, ...] = ()
    family: Family | None = None
    carries: str | None = None
    pilot_mode: str | None = None
    judge: JudgeRecord | None = None
    gold: Gold | None = None
    extensions: tuple[Extension, ...] = ()
    settings: tuple[SettingRecord, ...] = ()
    tune: TuneRecord | None = None
    calibration: CalibrationRecord | None = None

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
        return next(s for s in self.settings if s.id == setting_id)

    def for_comparison(self, plan: ComparisonPlan) -> Registration:
        """The registration as the report of one of its comparisons reads it: that comparison first, its
        margin, alpha and sequential plan in place of the run's."""
        others = tuple(p for p in self.comparisons if p != plan)
        return replace(
            self, margin=plan.margin, alpha=plan.alpha, sequential=plan.sequential, listed=(plan, *others)
        )

    @classmethod
    def read(cls, kind: str, stored: Mapping[str, Any]) -> Registration:
        """The registration of a run of ``kind`` from its stored JSON, in any layout flyspec has written."""
        margin, alpha = float(stored["margin"]), float(stored["alpha"])
        sampling, budget = stored.get("sampling"), stored.get("alpha_budget")
        order = stored.get("question_order" if kind == "tune" else "order")
        listed = stored.get("comparisons") if kind == "gate" else None
        calibration = stored.get("calibration")
        sequential = _sequential(stored.get("sequential"))
        design = stored.get("design")
        if design is None and kind in ("gate", "pilot"):
            design = "sequential" if sequential is not None else "fixed"
        return cls(
            kind=kind,
            margin=margin,
            alpha=alpha,
            seed=int(stored.get("seed", 0)),
            sampling=SamplingRecord.from_dict(sampling) if isinstance(sampling, Mapping) else None,
            arms=dict(stored.get("arms") or {}),
            shuffle_seed=stored.get("shuffle_seed"),
            alpha_budget=float(budget) if budget is not None else None,
            datasets={
                name: DatasetEntry.from_dict(info if isinstance(info, Mapping) else {})
                for name, info in (stored.get("datasets") or {}).items()
            },
            excluded=Excluded.from_dict(stored["excluded"]) if stored.get("excluded") else None,
            repeats=tuple(int(r) for r in stored.get("repeats") or ()),
            limit=stored.get("limit"),
            max_questions=stored.get("max_questions"),
            order=QuestionOrder.from_dict(order) if isinstance(order, Mapping) and "rule" in order else None,
            design=design,
            sequential=sequential,
            listed=tuple(
                sorted((ComparisonPlan.from_dict(c) for c in listed), key=lambda c: c.role != "candidate")
            )
            if listed
            else (),
            family=Family.from_dict(stored["family"], alpha)
            if isinstance(stored.get("family"), Mapping)
            else None,
            carries=stored.get("carries"),
            pilot_mode=(stored.get("pilot") or {}).get("mode", "noise") if kind == "pilot" else None,
            judge=JudgeRecord.from_dict(stored["judge"])
            if isinstance(stored.get("judge"), Mapping)
            else None,
            gold=Gold.from_dict(stored["gold"]) if isinstance(stored.get("gold"), Mapping) else None,
            extensions=tuple(Extension.from_dict(e) for e in stored.get("extensions") or ()),
            settings=tuple(SettingRecord.from_dict(s) for s in stored.get("settings") or ()),
            tune=TuneRecord.from_dict(stored) if kind == "tune" and "order" in stored else None,
            calibration=CalibrationRecord(
                int(calibration["questions"]), str(calibration["tune"]), bool(calibration.get("graded"))
            )
            if kind == "calibration" and isinstance(calibration, Mapping)
            else None,
        )

    # ------------------------------------------------------------------------------------- writing

    def to_dict(self) -> dict[str, Any]:
        """The stored layout of this registration (what ``GateStore.register`` writes)."""
        out: dict[str, Any] = {
            "margin": self.margin,
            "alpha": self.alpha,
            "seed": self.seed,
            "sampling": self.sampling.to_dict() if self.sampling is not None else None,
            "arms": dict(self.arms),
            "shuffle_seed": self.shuffle_seed,
            "datasets": {name: entry.to_dict() for name, entry in self.datasets.items()},
        }
        if self.alpha_budget is not None:
            out["alpha_budget"] = self.alpha_budget
        if self.excluded is not None:
            out["excluded"] = self.excluded.to_dict()
        if self.kind in ("tune", "calibration"):
            out["settings"] = [s.to_dict() for s in self.settings]
        if self.kind == "calibration" and self.calibration is not None:
            out["calibration"] = self.calibration.to_dict()
        if self.kind == "tune" and self.tune is not None:
            out.update(self.tune.to_dict())
            out["question_order"] = self.order.to_dict() if self.order is not None else None
            out["max_questions"] = self.max_questions
        if self.kind in ("gate", "pilot"):
            out.update(self._run_keys())
        if self.design is not None and self.kind != "calibration":
            out["design"] = self.design
        if self.sequential is not None:
            out["sequential"] = self.sequential.to_dict()
        if self.extensions:
            out["extensions"] = [e.to_dict() for e in self.extensions]
        return out

    def _run_keys(self) -> dict[str, Any]:
        """The keys only a gate run or a pilot writes."""
        out: dict[str, Any] = {
            "repeats": list(self.repeats),
            "limit": self.limit,
            "max_questions": self.max_questions,
            "order": self.order.to_dict() if self.order is not None else None,
        }
        if self.carries is not None:
            out["carries"] = self.carries
        if self.listed:
            out["comparisons"] = [c.to_dict() for c in self.listed]
        if self.family is not None:
            out["family"] = {"alpha": self.family.alpha, "procedure": self.family.procedure}
        if self.pilot_mode is not None:
            out["pilot"] = {"mode": self.pilot_mode}
        if self.judge is not None:
            out["judge"] = self.judge.to_dict()
        if self.gold is not None:
            out["gold"] = self.gold.to_dict()
        return out


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
