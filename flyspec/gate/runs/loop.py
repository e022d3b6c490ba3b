"""The run loop every kind of run shares: ``gate run`` and ``gate pilot`` (flyspec/gate/runs/runner.py, which
``flyspec demo`` calls too) and ``gate tune`` (flyspec/gate/runs/tune.py, one run for its calibration and one
for its tests).

1. ``load_datasets``: every question, every reference answer checked against its grader;
2. ``register``, before the first answer: a resume with other settings is refused before any server is
   asked which model it serves (the identities are built first from the served models the store
   recorded), then every endpoint's /v1/models is read and the run is registered with what it reports;
3. per session, ``answer``: the executors start (an engine loads and warms up, outside the time budget),
   the session answers until done or stopped, and the store records why it stopped, an error included.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from flyspec.gate.arms.base import Arm, Executor
from flyspec.gate.arms.endpoint import OpenAIExecutor
from flyspec.gate.arms.judge import JUDGE_ARM, Judge
from flyspec.gate.data.datasets import Question, load_dataset
from flyspec.gate.data.registration import Extension, Registration
from flyspec.gate.data.store import GateStore, RegisteredQuestion
from flyspec.gate.grading.graders import check_reference, sandbox_notes
from flyspec.gate.runs.session import Session, log
from flyspec.gate.stats.claims import SUPERPOPULATION

Served = dict[str, dict[str, Any] | None]
"""Per arm name (and ``judge``): the model its server reports serving, None where nothing was asked."""
Datasets = dict[str, tuple[str, list[Question]]]
"""Per dataset name in reports: its spec as given and every question."""


def load_datasets(specs: Sequence[str], shuffle_seed: int) -> Datasets:
    """Every question of each dataset, by its report name, with its spec as given; every reference answer
    checked against its grader (ValueError naming the dataset and question)."""
    loaded: Datasets = {}
    for spec in specs:
        questions = load_dataset(spec, None, shuffle_seed=shuffle_seed)
        name = questions[0].dataset
        if name in loaded:
            raise ValueError(
                f"two datasets are both named {name!r}; rename one file so reports can tell them apart"
            )
        for q in questions:
            try:
                check_reference(q.grader, q.answer)
            except ValueError as exc:
                raise ValueError(
                    f"dataset {name!r}, question {q.id!r}: bad reference answer: {exc}"
                ) from None
        loaded[name] = (spec, questions)
    return loaded


def registered(questions: Sequence[Question]) -> list[RegisteredQuestion]:
    """The questions as the store registers them, in order."""
    return [
        RegisteredQuestion(q.dataset, q.id, i, q.prompt_hash, q.answer, q.grader)
        for i, q in enumerate(questions)
    ]


def identities(arms: dict[str, Arm], served: Served) -> dict[str, dict[str, Any]]:
    """Each arm's registered identity; an endpoint's includes the model its server reports (``served``)."""
    return {name: arm.identity(served.get(name)) for name, arm in arms.items()}


def stored_served(store: GateStore, run_id: str) -> Served:
    """The served models a registered run recorded (to check a resume before asking the servers); the
    judge's under the key ``judge``."""
    run = store.get_run(run_id)
    if run is None:
        return {JUDGE_ARM: None}
    reg = run.registered
    served: Served = {name: identity.get("served_model") for name, identity in reg.arms.items()}
    served[JUDGE_ARM] = dict(reg.judge.served_model) if reg.judge and reg.judge.served_model else None
    return served


def ask_served(executors: Iterable[Executor], judge: Judge | None = None) -> Served:
    """What every arm's server, and the judge's, reports serving now (ValueError when one does not serve
    the model named)."""
    served: Served = {}
    for ex in executors:
        served.update(ex.served_models())
    if judge is not None:
        served[JUDGE_ARM] = OpenAIExecutor(judge.endpoint).served_models()[JUDGE_ARM]
    return served


def register(
    store: GateStore,
    run_id: str,
    questions: list[RegisteredQuestion],
    describe: Callable[[Served], Registration],
    ask: Callable[[], Served],
    amend: Callable[[Registration], tuple[Extension, ...]] | None = None,
    confirm: Callable[[Registration], None] | None = None,
) -> bool:
    """Register ``run_id`` (or check that a resume has its settings); True when it is new.

    ``describe(served)`` is the registration for the given served models; ``ask()`` reads them from the
    servers, after the resume was checked on the recorded ones. ``amend(registration)`` runs on the
    recorded one before that check (a sequential run extends its maximum there) and returns the
    extensions both carry. ``confirm(registration)`` checks the final registration, with the served models,
    before anything is written (the alpha ledger: a server's card may name the model behind an alias).
    """
    guessed = describe(stored_served(store, run_id))
    extensions = amend(guessed) if amend is not None else ()
    guessed = replace(guessed, extensions=extensions)
    store.check_resumable(run_id, guessed, questions)
    final = replace(describe(ask()), extensions=extensions)
    if confirm is not None:
        confirm(final)
    return store.register(run_id, final, questions)


def population(store: GateStore, run_id: str, requested: str | None) -> str:
    """The claim a sequential run makes: as requested, else the one a registered run already makes (runs
    registered before the claim was a choice are ``finite``), else ``superpopulation``."""
    if requested is not None:
        return requested
    run = store.get_run(run_id)
    sequential = run.registered.sequential if run is not None else None
    return sequential.population if sequential is not None else SUPERPOPULATION


def announce_sandbox(graders: set[str], who: str) -> None:
    """Once at the start of a run with code questions: say which protections the code sandbox lacks here."""
    sandbox = sandbox_notes(graders)
    for missing in sandbox["missing"] if sandbox is not None else []:
        log(f"{who}: WARNING: the code sandbox runs without {missing}")


def start(executors: Iterable[Executor], who: str) -> None:
    """Get every executor ready to answer (an engine loads and warms up), saying so first."""
    for ex in executors:
        log(f"{who}: starting {ex.describe()}")
        ex.start()


def answer(
    store: GateStore,
    session: Session,
    executors: list[Executor],
    who: str,
    detail: dict[str, Any] | None = None,
    notes: Callable[[], dict[str, Any]] | None = None,
) -> str:
    """Start ``executors`` (an engine loads and warms up, outside the time budget), record the session's
    start (and the run's ``notes``, facts the started executors know), then answer what ``session`` lacks
    until done or stopped; the store records why it stopped (``detail`` says which part of a tune), an
    error too. Returns the reason."""
    start(executors, who)
    # After loading: a session's time from start to stop is answering time.
    store.add_event(session.run_id, "start", detail=detail)
    if notes is not None:
        store.update_notes(session.run_id, notes())
    try:
        reason = session.answer(executors)
    except BaseException:
        detail = {**(detail or {}), **session.stop_detail}
        store.add_event(session.run_id, "stop", session.reason or "error", session.stopped_at, detail)
        raise
    detail = {**(detail or {}), **session.stop_detail}
    store.add_event(session.run_id, "stop", reason, session.stopped_at, detail)
    return reason
