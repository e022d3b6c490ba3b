"""The judge-graded questions of one gate session: pair the two lanes' answers, ask the judge in both
orders, commit each verdict as it arrives (keyed by the pair's hash, so a resume never asks twice) and grade
the pair once both are in (the prompt and rule: flyspec/gate/grading/graders.py). Store work stays in the
main thread; only the HTTP calls run in the judge client's threads. Both answers of a judged question are
committed together. The decision uses the pair (flyspec/gate/data/results.py): the judge's prediction
and, for the drawn pairs, a gold label (computed here from an exact grader, or a person's, later).
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait

from flyspec.gate.arms.base import Completion, Job
from flyspec.gate.arms.judge import Judge, JudgeClient, Verdict
from flyspec.gate.data.questions import QuestionKey
from flyspec.gate.data.results import exact_pair, make_pair
from flyspec.gate.data.spec import Gold
from flyspec.gate.data.store import GateStore, JudgementRecord, LabelRecord
from flyspec.gate.grading.graders import (
    POSITIONS,
    UNDECIDED,
    Grade,
    grade,
    lane_label,
    outcome,
    pair_hash,
    preferred,
)
from flyspec.gate.stats.decide import Outcome
from flyspec.gate.stats.judged import JudgedPair
from flyspec.gate.stats.monitor import Lane, Monitor, SequentialPlan

Item = tuple[Job, Completion, Grade]
_WORDS = {
    "first": "baseline better",
    "second": "candidate better",
    "tie": "tie",
    "identical": "tie: identical answers",
    "disagree": "undecided: the two orders disagree",
    "unreadable": "undecided: a verdict could not be read",
}


class JudgedPairs:
    """Pairs of answers waiting for the judge, and the verdicts that came back."""

    def __init__(
        self, store: GateStore, run_id: str, judge: Judge, lanes: list[Lane], gold: Gold | None = None
    ) -> None:
        self.store = store
        self.run_id = run_id
        self.judge = judge
        self.gold = gold
        # The pairs completed since the last ``take_pairs`` (for the sequential monitor).
        self.pairs: list[tuple[QuestionKey, JudgedPair]] = []
        self.gold_labels = store.labels(run_id)
        self.first, self.second = lanes[0], lanes[1]
        self.labels = (lane_label(self.first), lane_label(self.second))
        # Read from the verdict: a store written before unreadable verdicts had their own preference holds
        # "tie" for them.
        self.stored = {
            (j.dataset, j.question_id, j.position, j.pair_sha256): preferred(j.position, j.verdict)
            for j in store.judgements(run_id)
            if (j.first_lane, j.second_lane) == self.labels
        }
        self.answers: dict[QuestionKey, dict[Lane, tuple[Job, Completion]]] = {}
        self.preferences: dict[QuestionKey, dict[str, str]] = {}
        self.futures: dict[Future[Verdict], tuple[QuestionKey, str, str]] = {}
        self.client: JudgeClient | None = None
        self.error: BaseException | None = None

    @property
    def busy(self) -> bool:
        """True while a judge call is in flight."""
        return bool(self.futures)

    def add(self, job: Job, completion: Completion) -> list[Item]:
        """Take one answer of a judged question; once both lanes answered, ask the judge about every
        position not yet stored. Returns the pair's graded items when nothing had to be asked."""
        key = (job.question.dataset, job.question.id)
        got = self.answers.setdefault(key, {})
        got[job.lane] = (job, completion)
        if len(got) < 2:
            return []
        first, second = got[self.first][1].text, got[self.second][1].text
        if first == second:
            return self._graded(key, "identical", "identical answers: a tie without asking the judge")
        digest = pair_hash(first, second)
        prefs = self.preferences.setdefault(key, {})
        for position in POSITIONS:
            known = self.stored.get((*key, position, digest))
            if known is not None:
                prefs[position] = known
            elif self.error is None:
                if self.client is None:
                    self.client = JudgeClient(self.judge)
                future = self.client.submit(job.question, position, first, second)
                self.futures[future] = (key, position, digest)
        return self._ready(key)

    def poll(self, timeout: float) -> list[Item]:
        """Store the verdicts that arrived (waiting up to ``timeout`` seconds for one) and return the items
        of the pairs they completed. A failed call is kept in ``error`` (the run then pauses)."""
        if not self.futures:
            return []
        done, _ = wait(list(self.futures), timeout=timeout, return_when=FIRST_COMPLETED)
        items: list[Item] = []
        for future in done:
            key, position, digest = self.futures.pop(future)
            try:
                verdict = future.result()
            except Exception as exc:  # handed to the session, which stops the run cleanly
                self.error = self.error or exc
                continue
            self.store.add_judgement(
                self.run_id,
                JudgementRecord(
                    dataset=key[0],
                    question_id=key[1],
                    first_lane=self.labels[0],
                    second_lane=self.labels[1],
                    position=position,
                    pair_sha256=digest,
                    verdict=verdict.verdict,
                    preferred=verdict.preferred,
                    output=verdict.output,
                    latency_s=verdict.latency_s,
                    source=verdict.source,
                ),
            )
            self.preferences[key][position] = verdict.preferred
            items += self._ready(key)
        return items

    def _ready(self, key: QuestionKey) -> list[Item]:
        prefs = self.preferences.get(key, {})
        if any(position not in prefs for position in POSITIONS):
            return []
        result = outcome(prefs["AB"], prefs["BA"])
        del self.preferences[key]
        return self._graded(key, result, f"judge: AB prefers {prefs['AB']}, BA prefers {prefs['BA']}", prefs)

    def take_pairs(self) -> list[tuple[QuestionKey, JudgedPair]]:
        """The pairs completed since the last call (in completion order)."""
        pairs, self.pairs = self.pairs, []
        return pairs

    def _pair(self, key: QuestionKey, job: Job, first: str, second: str, prefs: dict[str, str]) -> None:
        """Record the question's pair for the monitor; an exact gold source labels a drawn pair now."""
        gold = self.gold
        if gold is None:
            return
        label = self.gold_labels.get(key)
        if gold.source == "exact" and first != second and gold.selected(*key) and label is None:
            q = job.question
            d = int(grade(q.grader, second, q.answer).correct) - int(grade(q.grader, first, q.answer).correct)
            label = LabelRecord(*key, pair_hash(first, second), d, "exact", {"grader": q.grader})
            self.store.add_label(self.run_id, label)
            self.gold_labels[key] = label
        self.pairs.append((key, make_pair(gold, *key, first, second, prefs, label)))

    def _graded(
        self, key: QuestionKey, result: str, detail: str, prefs: dict[str, str] | None = None
    ) -> list[Item]:
        words = _WORDS[result]
        undecided = result in UNDECIDED
        got = self.answers.pop(key)
        (job_a, comp_a), (job_b, comp_b) = got[self.first], got[self.second]
        self._pair(key, job_a, comp_a.text, comp_b.text, prefs or {})
        return [
            (job_a, comp_a, Grade(words, result != "second" and not undecided, detail)),
            (job_b, comp_b, Grade(words, result != "first" and not undecided, detail)),
        ]

    def close(self, wait_for_calls: bool = True) -> None:
        """Stop the judge client (``wait_for_calls=False`` gives up on the calls in flight)."""
        if self.client is not None:
            self.client.close(wait=wait_for_calls)


class JudgedRunMonitor(Monitor):
    """The sequential monitor of a judged run registered with gold labels: judged pairs arrive through
    ``add_pair``; a question its own exact grader grades arrives answer by answer through ``add`` and enters
    as an exactly predicted pair."""

    def __init__(
        self,
        order: list[QuestionKey],
        plan: SequentialPlan,
        lanes: tuple[Lane, Lane],
        gold: Gold,
        graders: dict[QuestionKey, str],
    ) -> None:
        super().__init__(order, plan, lanes)
        self.gold = gold
        self.graders = graders

    def add(self, arm: str, repeat: int, dataset: str, question_id: str, correct: bool) -> Outcome | None:
        """One graded answer; only a question its own exact grader grades becomes a pair here."""
        self.correct[(arm, repeat, dataset, question_id)] = correct
        key = (dataset, question_id)
        if self.gold.judged(self.graders.get(key, "")):
            return None
        first = self.correct.get((*self.lanes[0], *key))
        second = self.correct.get((*self.lanes[1], *key))
        if first is None or second is None:
            return None
        return self.add_pair(key, exact_pair(self.gold, dataset, question_id, first, second))
