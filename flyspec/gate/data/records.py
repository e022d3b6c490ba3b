"""The records the gate's store keeps, one per row: an answer, a judge call, a gold label, a registered
question, a session event, and a registered run with its notes (flyspec/gate/data/store.py reads and
writes them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

from flyspec.gate.data.spec import Registration


@dataclass(frozen=True)
class AnswerRecord:
    """One graded answer of one arm to one question (one row of the ``answers`` table)."""

    arm: str
    repeat: int
    dataset: str
    question_id: str
    seed: int
    output: str
    extracted: str | None
    correct: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    num_drafts: int | None = None
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None
    num_forgiven_tokens: int | None = None
    source: str = ""


@dataclass(frozen=True)
class JudgementRecord:
    """One call of the judge on one question's pair of answers, in one position.

    ``first_lane``/``second_lane`` are the lanes compared (``baseline#0``, ``candidate#0``); ``position``
    is ``AB`` (the first lane's answer shown as A) or ``BA`` (swapped); ``pair_sha256`` is the hash of the
    two outputs judged, so a stored judgement is reused only for exactly those outputs. ``verdict`` is what
    the judge said (``A``, ``B``, ``tie``, or None when it could not be read) and ``preferred`` what that
    means for the lanes (``first``, ``second`` or ``tie``).
    """

    dataset: str
    question_id: str
    first_lane: str
    second_lane: str
    position: str
    pair_sha256: str
    verdict: str | None
    preferred: str
    output: str
    latency_s: float
    source: str


@dataclass(frozen=True)
class LabelRecord:
    """A gold label of one judged pair: ``value`` +1 (the candidate's answer is better), -1 (the
    baseline's) or 0 (equally good); ``source`` ``exact`` (the question's grader on both answers) or
    ``human`` (``flyspec gate label``); ``pair_sha256`` names the two outputs labelled; ``detail`` what was
    shown and answered (which answer was shown as A, the key pressed)."""

    dataset: str
    question_id: str
    pair_sha256: str
    value: int
    source: str
    detail: dict[str, object]


@dataclass(frozen=True)
class RegisteredQuestion:
    """A question as registered before the first answer: its identity, prompt hash and reference (the
    fields in the order of the ``questions`` table's columns after ``run_id``)."""

    dataset: str
    question_id: str
    position: int
    prompt_hash: str
    answer: str
    grader: str


@dataclass(frozen=True)
class RunEvent:
    """One session event of a run: ``start``, or ``stop`` with its reason and (sequential runs) the number of
    questions in the in-order sequence at that moment."""

    event: str
    reason: str | None
    stopped_at: int | None
    detail: dict[str, object]
    created_at: float


class RunNotes(TypedDict, total=False):
    """What a run notes while it runs, beside its registration (facts learned, not choices made):
    ``arm_settings`` and ``judge_settings`` (each one's full settings, never a secret),
    ``dataset_sources`` (the spec each dataset was read from), ``executors`` (what each executor reports
    of itself), ``code_sandbox`` (the sandbox this machine gives code questions), ``shared_engine`` and
    ``shared_engine_note`` (arms that ran in one engine, and how each was verified), ``system_fingerprints``
    (each endpoint's, per arm and URL), ``prefix_cache`` (the engine's queries and hits) and ``ledger``
    (what the alpha ledger said when the run was registered)."""

    arm_settings: dict[str, dict[str, object]]
    judge_settings: dict[str, object]
    dataset_sources: dict[str, str]
    executors: list[dict[str, object]]
    code_sandbox: dict[str, object]
    shared_engine: list[list[str]]
    shared_engine_note: str
    system_fingerprints: dict[str, dict[str, list[str]]]
    prefix_cache: dict[str, int]
    ledger: dict[str, object]


@dataclass(frozen=True)
class RunRecord:
    """A registered run: kind (``gate``, ``pilot``, ``tune`` or ``calibration``), margin, alpha and seed (the
    registration's: the store keeps them there only), its registration and notes. ``registration`` is the
    JSON as stored (what a resume is compared with, what a report's JSON shows); ``registered`` is the
    same, typed (``Registration.read``): read it, not the JSON. A report of one comparison of a run
    replaces ``registered`` with that comparison's view."""

    run_id: str
    kind: str
    created_at: float
    margin: float
    alpha: float
    seed: int
    registration: dict[str, object]
    notes: RunNotes
    registered: Registration = field(default=None, compare=False, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.registered is None:
            object.__setattr__(self, "registered", Registration.read(self.kind, self.registration))
