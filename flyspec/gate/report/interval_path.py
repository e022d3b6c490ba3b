"""A sequential run's interval after each pair, along its registered order: the walk the report replays to
find the stop (``Monitor`` of flyspec/gate/stats/monitor.py, the walk of ``judged_stop`` and
``sequential_stop``), fed the stored pairs one at a time. It ends where the walk waits (a pair missing, or
waiting for its gold label) or stops (a crossing, or the registered maximum), so its last step is the
report's interval at the stop. The shadow's /status plots it against the margin."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flyspec.gate.data.results import stored_pairs
from flyspec.gate.data.store import GateStore, RunRecord
from flyspec.gate.stats.monitor import Monitor, QuestionKey


@dataclass(frozen=True)
class Step:
    """The ``1 - 2 alpha`` bounds of the net difference (candidate minus baseline, a fraction) after the
    first ``n`` pairs in the registered order."""

    n: int
    low: float
    high: float


def interval_path(store: GateStore, run_id: str) -> list[Step]:
    """The bounds after each pair the walk of sequential run ``run_id`` counts (empty before the first);
    ValueError for a run that is not sequential (its interval is only read once, at the end)."""
    run = store.get_run(run_id)
    if run is None:
        raise ValueError(f"run {run_id!r} is not in {store.path}")
    reg = run.registered
    if reg.sequential is None:
        raise ValueError(f"run {run_id!r} is not sequential: its interval is read once, not after each pair")
    order = [(q.dataset, q.question_id) for q in store.questions(run_id)]
    monitor = Monitor(order, reg.sequential, reg.lanes)
    feed = _judged_feed(store, run, monitor) if reg.gold is not None else _graded_feed(store, run_id, monitor)
    steps: list[Step] = []
    for key in order:
        before = monitor.prefix
        feed(key)
        if monitor.prefix == before:  # the walk waits here: a pair missing or waiting for its label
            break
        steps.append(Step(monitor.prefix, monitor.low, monitor.high))
        if monitor.stop is not None:
            break
    return steps


def _judged_feed(store: GateStore, run: RunRecord, monitor: Monitor) -> Callable[[QuestionKey], None]:
    gold = run.registered.gold
    assert gold is not None
    pairs = stored_pairs(store, run, run.registered.lanes, gold)

    def feed(key: QuestionKey) -> None:
        if key in pairs:
            monitor.add_pair(key, pairs[key])

    return feed


def _graded_feed(store: GateStore, run_id: str, monitor: Monitor) -> Callable[[QuestionKey], None]:
    by_question: dict[QuestionKey, list[tuple[str, int, bool]]] = {}
    for a in store.answers(run_id):
        by_question.setdefault((a.dataset, a.question_id), []).append((a.arm, a.repeat, a.correct))

    def feed(key: QuestionKey) -> None:
        for arm, repeat, correct in by_question.get(key, []):
            monitor.add(arm, repeat, *key, correct)

    return feed
