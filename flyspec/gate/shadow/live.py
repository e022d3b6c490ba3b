"""A shadow run's live decision: the run's one ``Monitor`` fed as the worker stores each pair, so the stop
and the gauges cost the same at pair 100,000 as at pair 10. Rebuilding the report from the store instead
walks every pair again (the confidence sequence finds its bounds by root finding at each one): 0.3 s at
2,000 pairs and over a second at 8,000, each time, on the proxy's own cores and interpreter lock. The
Monitor stops where ``Rule.decide`` on the same stored pairs stops (stats/monitor.py), so the live stop is
the report's; /decision and /status still build the report when asked.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from flyspec.gate.data.results import stored_pairs
from flyspec.gate.data.spec import Registration
from flyspec.gate.data.store import GateStore, LabelRecord
from flyspec.gate.grading.graders import pair_hash
from flyspec.gate.runs.judging import Item, JudgedRunMonitor
from flyspec.gate.stats.decide import FAIL, PASS
from flyspec.gate.stats.judged import JudgedPair, judge_counts
from flyspec.gate.stats.monitor import Monitor, QuestionKey, in_order_judged


@dataclass(frozen=True)
class LiveDecision:
    """The decision as it stands, for the gauges: ``code`` -1 FAIL, 0 INCONCLUSIVE, 1 PASS
    (``flyspec_shadow_decision``), the interval ([-1, 1] before a pair counts), the drawn pairs waiting
    for a person's label and the judge's agreement with the labels given (None before one)."""

    code: int
    low: float
    high: float
    labels_waiting: int
    judge_agreement: float | None


class LiveWalk:
    """The run's Monitor along the arrival order, thread-safe: the worker ``register``s each pair's
    question, then hands it the ``graded`` answers and the ``judged`` pairs; ``labels`` applies the gold
    labels people stored (from any process) to the pairs waiting for them. ``digests``: the hash of each
    drawn pair's two answers, which its label must name (the worker's, as it grades)."""

    def __init__(self, registration: Registration, digests: dict[QuestionKey, str]) -> None:
        plan, gold = registration.sequential, registration.gold
        if plan is None:
            raise ValueError("a shadow run is registered sequential: its live decision walks its plan")
        self.graders: dict[QuestionKey, str] = {}
        self.monitor = (
            JudgedRunMonitor([], plan, registration.lanes, gold, self.graders)
            if gold is not None
            else Monitor([], plan, registration.lanes)
        )
        self.judged = gold is not None
        self.digests = digests
        self._lock = threading.Lock()

    @classmethod
    def of(cls, store: GateStore, run_id: str, digests: dict[QuestionKey, str]) -> LiveWalk:
        """The walk of what ``run_id`` has stored (a restarted process goes on from there)."""
        run = store.get_run(run_id)
        assert run is not None  # the shadow run registered it
        reg = run.registered
        live = cls(reg, digests)
        questions = store.questions(run_id)
        for q in questions:
            live.register((q.dataset, q.question_id), q.grader)
        answers = store.answers(run_id)
        if reg.gold is None:
            live.graded_records([(a.arm, a.repeat, a.dataset, a.question_id, a.correct) for a in answers])
            return live
        texts = {(a.arm, a.dataset, a.question_id): a.output for a in answers}
        (first, _), (second, _) = reg.lanes
        pairs = stored_pairs(store, run, reg.lanes, reg.gold)
        for key, pair in pairs.items():
            if pair.waiting:
                live.digests[key] = pair_hash(texts[(first, *key)], texts[(second, *key)])
        live.judged_pairs(list(pairs.items()))
        return live

    def register(self, key: QuestionKey, grader: str) -> None:
        """The next question in arrival order."""
        with self._lock:
            self.graders[key] = grader
            self.monitor.extend([key])

    def graded(self, items: list[Item]) -> None:
        """Answers graded on their own (exactly, or against the baseline's answer)."""
        self.graded_records(
            [(job.arm, job.repeat, job.question.dataset, job.question.id, g.correct) for job, _, g in items]
        )

    def graded_records(self, records: list[tuple[str, int, str, str, bool]]) -> None:
        """``graded`` from stored records: (arm, repeat, dataset, question id, correct)."""
        with self._lock:
            for record in records:
                self.monitor.add(*record)

    def judged_pairs(self, pairs: list[tuple[QuestionKey, JudgedPair]]) -> None:
        """Judged pairs, complete (both orders' verdicts), with the labels known when they completed."""
        with self._lock:
            for key, pair in pairs:
                self.monitor.add_pair(key, pair)
                if not pair.waiting:
                    self.digests.pop(key, None)

    def labels(self, labels: dict[QuestionKey, LabelRecord]) -> None:
        """Apply the labels of waiting pairs that name exactly their answers (as the report reads them)."""
        with self._lock:
            for key, label in labels.items():
                pair = self.monitor.items.get(key)
                if (
                    isinstance(pair, JudgedPair)
                    and pair.waiting
                    and label.pair_sha256 == self.digests.get(key)
                ):
                    self.monitor.add_pair(key, replace(pair, gold=label.value))
                    del self.digests[key]

    def state(self) -> LiveDecision:
        """The decision now: the Monitor's stop once it stopped, else its walk's bounds."""
        with self._lock:
            m = self.monitor
            stop = m.stop
            low, high = (stop.low, stop.high) if stop is not None else (m.low, m.high)
            code = {FAIL: -1, PASS: 1}.get(stop.decision, 0) if stop is not None else 0
            if not self.judged:
                return LiveDecision(code, low, high, 0, None)
            seen = in_order_judged(m.order, m.items)  # type: ignore[arg-type]
        counts = judge_counts(seen)
        return LiveDecision(code, low, high, sum(p.waiting for p in seen), counts.agreement)
