"""A shadow run: the mirror's pairs become a registered, resumable gate run (SPEC 11.6).

``ShadowRun`` is the mirror's sink. Registration happens when it is built, before the first mirrored
request: the sequential run of flyspec/gate/shadow/registration.py, in the gate's store, refused
when the same run name was registered with other settings (as ``gate run`` refuses a changed resume).

One worker thread owns the store. A pair handed to the sink is committed at once to ``shadow_pairs``
(the request, both answers, timings, token counts, acceptance) and registered as the next question of the
run (its id the row id: arrival order is the registered order); only then does the sink return, so a
``kill -9`` loses at most the pairs in flight. The pair is then judged in both orders by the gate's own
judged-run machinery (``JudgedPairs``: verdicts committed as they arrive, both answers committed together
once both verdicts are in), or, in a run registered with a pairwise grader (``equivalent_to_baseline``),
graded against the baseline's answer at once. A pair whose candidate errored is a known loss without
asking the judge (the registered rule), stored as an exact question so its gold label is the loss itself.
A restart registers and grades whatever a kill left half done. A judge that fails is asked again later;
clients never notice.

The decision is the report's (``build_report``: the same object as ``gate report --json``), refreshed as
verdicts and labels arrive; once it is PASS or FAIL, ``on_decided`` stops the mirroring.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyspec.gate.arms.base import Completion, Job
from flyspec.gate.data.datasets import Question
from flyspec.gate.data.lock import StoreLock
from flyspec.gate.data.spec import Registration
from flyspec.gate.data.store import AnswerRecord, GateStore, RegisteredQuestion
from flyspec.gate.grading.graders import EQUIVALENCE, JUDGE, Grade, grade_against_baseline
from flyspec.gate.report.report import Report, build_report
from flyspec.gate.runs.exclusion import record_looks
from flyspec.gate.runs.judging import Item, JudgedPairs
from flyspec.gate.shadow.pair_store import SqlitePairStore, StoredPair
from flyspec.gate.shadow.pairs import MirroredPair
from flyspec.gate.shadow.registration import DATASET, ERRORS, ShadowPlan

log = logging.getLogger(__name__)

LANES = [("baseline", 0), ("candidate", 0)]
REFRESH_S = 1.0
"""How often the worker rebuilds the decision (labels arrive from other processes too)."""
JUDGE_RETRY_S = 10.0
"""How long after a failed judge call the waiting pairs are asked again."""
DECIDED = ("PASS", "FAIL")


def _question(pair: StoredPair, grader: str) -> Question:
    """The pair's request as a gate question (what the judge is shown): its prompt or its messages."""
    qid = str(pair.id)
    if pair.route == "/completions":
        prompt = pair.request.get("prompt")
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
        return Question(qid, "", grader, DATASET, prompt=text)
    messages = [
        {
            "role": str(m.get("role", "")),
            "content": c if isinstance(c := m.get("content"), str) else json.dumps(c),
        }
        for m in pair.request.get("messages") or []
        if isinstance(m, dict)
    ]
    return Question(qid, "", grader, DATASET, messages=messages)


def request_text(question: Question) -> str:
    """A question's request as a person reads it: the prompt, or each message as ``[role] content``."""
    if question.prompt is not None:
        return question.prompt
    return "\n".join(f"[{m['role']}] {m['content']}" for m in question.messages or [])


def shadow_requests(path: str | Path, run_id: str) -> dict[str, str]:
    """Each stored pair's request as text, by its question's prompt hash (what `gate label` shows)."""
    pairs = SqlitePairStore(path, run_id)
    try:
        questions = [_question(pair, JUDGE) for pair in pairs.pairs()]
    finally:
        pairs.close()
    return {q.prompt_hash: request_text(q) for q in questions}


def _completion(answer: dict[str, Any], source: str) -> Completion:
    return Completion(
        text=answer.get("text") or "",
        finish_reason=answer.get("finish_reason"),
        prompt_tokens=answer.get("prompt_tokens") or 0,
        completion_tokens=answer.get("completion_tokens") or 0,
        latency_s=float(answer.get("latency_s") or 0.0),
        source=source,
    )


def _record(
    job: Job, completion: Completion, grade: Grade, acceptance: dict[str, Any] | None
) -> AnswerRecord:
    acc = acceptance or {}
    return AnswerRecord(
        arm=job.arm,
        repeat=job.repeat,
        dataset=job.question.dataset,
        question_id=job.question.id,
        seed=job.seed,
        output=completion.text,
        extracted=grade.extracted,
        correct=grade.correct,
        finish_reason=completion.finish_reason,
        prompt_tokens=completion.prompt_tokens,
        completion_tokens=completion.completion_tokens,
        latency_s=completion.latency_s,
        num_drafts=acc.get("num_drafts"),
        num_draft_tokens=acc.get("num_draft_tokens"),
        num_accepted_tokens=acc.get("num_accepted_tokens"),
        num_forgiven_tokens=acc.get("num_forgiven_tokens"),
        source=completion.source,
    )


def register_shadow(store: GateStore, run_id: str, registration: Registration, has_pairs: bool) -> bool:
    """Register the shadow run, or check that this resume has its settings; True when it is new. A
    changed registration is refused once the run holds an answer or a stored pair (ValueError listing
    what changed, as ``gate run`` does)."""
    questions = store.questions(run_id)
    changed = store.check_resumable(run_id, registration, questions)
    if changed and has_pairs:
        existing = store.get_run(run_id)
        assert existing is not None
        keys = sorted(
            k
            for k in set(existing.registration) | set(registration.to_dict())
            if existing.registration.get(k) != registration.to_dict().get(k)
        )
        raise ValueError(
            f"run {run_id!r} in {store.path} was registered with different settings ({', '.join(keys)}), so "
            "it cannot be resumed. Start a new run with another --run name (stored pairs are kept)."
        )
    new = store.register(run_id, registration, questions)
    record_looks(store, run_id)
    return new


@dataclass(frozen=True)
class LiveDecision:
    """The decision as it stands: the report's decision object, its bounds, the gold labels waiting, the
    judge's agreement with gold (None before the first label or without a judge) and the pairs stored."""

    decision: dict[str, Any]
    low: float
    high: float
    labels_waiting: int
    judge_agreement: float | None
    pairs: int

    @property
    def code(self) -> int:
        """-1 FAIL, 0 INCONCLUSIVE, 1 PASS (``flyspec_shadow_decision``)."""
        return {"FAIL": -1, "PASS": 1}.get(str(self.decision.get("decision")), 0)


def live_decision(report: Report, pairs: int) -> LiveDecision:
    """The live decision read from a shadow run's report."""
    decision = report.decision_object()
    gold = report.gold
    low, high = decision.get("low"), decision.get("high")
    return LiveDecision(
        decision=decision,
        low=-1.0 if low is None else float(low),
        high=1.0 if high is None else float(high),
        labels_waiting=gold.awaiting if gold is not None else 0,
        judge_agreement=gold.agreement if gold is not None else None,
        pairs=pairs,
    )


class ShadowRun:
    """The mirror's sink for a registered shadow run (see the module's docstring). ``start`` before the
    first pair; ``close`` at the end."""

    def __init__(self, path: str | Path, plan: ShadowPlan, registration: Registration) -> None:
        self.path = Path(path)
        self.plan = plan
        self.run_id = plan.run_id
        self.registration = registration
        self.pairs = SqlitePairStore(
            self.path, self.run_id
        )  # creates the file 0600 before the store opens it
        self._lock = StoreLock(self.path, self.run_id).acquire()
        try:
            with GateStore(self.path) as store:
                self.new = register_shadow(store, self.run_id, registration, self.pairs.count() > 0)
        except BaseException:
            self._lock.release()
            self.pairs.close()
            raise
        self.stored = self.pairs.count()
        self.on_decided: Callable[[LiveDecision], None] = lambda decision: None
        self._inbox: queue.Queue[tuple[MirroredPair, Future[int]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="shadow-run", daemon=True)
        self._ready = threading.Event()
        self._state_lock = threading.Lock()
        self._state: LiveDecision | None = None
        self.error: BaseException | None = None

    # ------------------------------------------------------------------------------------- the sink

    def __call__(self, pair: MirroredPair) -> None:
        """Commit one pair (and register it as the run's next question) before returning; raises when the
        worker could not start (the mirror counts the pair as not stored)."""
        if self.error is not None:
            raise RuntimeError(f"the shadow run's worker is not running: {self.error}")
        done: Future[int] = Future()
        self._inbox.put((pair, done))
        done.result()

    def start(self) -> None:
        """Start the worker: it finishes what a previous process left half done, then takes new pairs."""
        self._thread.start()
        self._ready.wait()

    def close(self) -> None:
        """Stop the worker (judge calls in flight are dropped: a restart asks them again) and unlock."""
        if self._thread.is_alive():
            self._inbox.put(None)
            self._thread.join()
        self.pairs.close()
        self._lock.release()

    def decision(self) -> LiveDecision:
        """The decision as the store holds it now (the same build as ``gate report``)."""
        state = self._build()
        with self._state_lock:
            self._state = state
        return state

    @property
    def last(self) -> LiveDecision | None:
        """The decision as the worker last built it (None before the first)."""
        with self._state_lock:
            return self._state

    def _build(self) -> LiveDecision:
        return live_decision(build_report(self.path, self.run_id), self.pairs.count())

    # ----------------------------------------------------------------------------------- the worker

    def _work(self) -> None:
        try:
            worker = _Worker(self)
            worker.recover()
        except Exception as exc:  # e.g. the store cannot be opened: every pair is then refused, counted
            log.exception("shadow: the run's worker could not start; no pair is stored")
            self.error = exc
            return
        finally:
            self._ready.set()
        refreshed = 0.0
        while True:
            try:
                item = self._inbox.get(timeout=0.1)
            except queue.Empty:
                item = ()
            if item is None:
                worker.close()
                return
            if item:
                pair, done = item
                try:
                    done.set_result(worker.take(pair))
                except Exception as exc:  # the mirror counts it as a store error
                    done.set_exception(exc)
            try:
                worker.poll()
            except Exception:  # a verdict that could not be stored is asked again after a restart
                log.exception("shadow: storing the judge's verdicts failed")
            if time.monotonic() - refreshed >= REFRESH_S:
                refreshed = time.monotonic()
                self._refresh()

    def _refresh(self) -> None:
        try:
            state = self.decision()
        except Exception:  # a report that cannot be built yet (a store being written elsewhere) waits
            log.exception("shadow: the decision could not be built; retrying")
            return
        if state.decision.get("decision") in DECIDED:
            self.on_decided(state)


class _Worker:
    """What the worker thread does with its own store connection: commit and register pairs, grade or
    judge them, store what comes back."""

    def __init__(self, run: ShadowRun) -> None:
        self.run = run
        self.run_id = run.run_id
        self.store = GateStore(run.path)
        self.positions = len(self.store.questions(self.run_id))
        self.judged = self._judged()
        self.waiting: dict[str, StoredPair] = {}
        self.failed_at: float | None = None

    def _judged(self) -> JudgedPairs | None:
        judge = self.run.plan.judge
        return JudgedPairs(self.store, self.run_id, judge, LANES, self.run.plan.gold) if judge else None

    def recover(self) -> None:
        """Register the stored pairs a kill left without a question, and grade or judge every registered
        pair without its answers (in the stored order)."""
        registered = {q.question_id for q in self.store.questions(self.run_id)}
        answered = {k[3] for k in self.store.answered_keys(self.run_id)}
        for pair in self.run.pairs.pairs():
            qid = str(pair.id)
            if qid not in registered:
                self._register(pair)
            if qid not in answered:
                self._grade(pair)

    def take(self, pair: MirroredPair) -> int:
        """Commit a new pair, register its question and grade it (or send it to the judge); returns its id."""
        pair_id = self.run.pairs(pair)
        stored = StoredPair(
            pair_id,
            pair.source,
            pair.route,
            pair.request,
            pair.baseline.to_dict(),
            pair.candidate.to_dict(),
        )
        self._register(stored)
        self._grade(stored)
        return pair_id

    def _grader(self, pair: StoredPair) -> str:
        """The registered grader, or for a judged run's pair whose candidate errored, the exact comparison
        with the baseline: such a pair is a known loss, labelled by itself."""
        grader = self.run.plan.grader
        if grader is not None:
            return grader
        return JUDGE if pair.candidate.get("error") is None else EQUIVALENCE

    def _register(self, pair: StoredPair) -> None:
        q = _question(pair, self._grader(pair))
        self.store.add_question(
            self.run_id, RegisteredQuestion(DATASET, q.id, self.positions, q.prompt_hash, "", q.grader)
        )
        self.positions += 1

    def _grade(self, pair: StoredPair) -> None:
        q = _question(pair, self._grader(pair))
        jb, cb = Job("baseline", 0, q, 0, pair.id), _completion(pair.baseline, pair.source)
        jc, cc = Job("candidate", 0, q, 0, pair.id), _completion(pair.candidate, pair.source)
        self.waiting[q.id] = pair
        error = pair.candidate.get("error")
        if error is not None:  # the registered rule: an error is a wrong answer, no judge asked
            wrong = Grade(None, False, f"error: {error}")
            self._store([(jb, cb, Grade(None, True, ERRORS)), (jc, cc, wrong)])
        elif self.judged is None:  # graded against the baseline's answer
            base, cand = grade_against_baseline(q.grader, cb.text, cc.text)
            self._store([(jb, cb, base), (jc, cc, cand)])
        else:
            self._store(self.judged.add(jb, cb) + self.judged.add(jc, cc))

    def _store(self, items: list[Item]) -> None:
        """Commit graded answers in one transaction (a pair's two answers together)."""
        if not items:
            return
        records = []
        for job, completion, grade in items:
            pair = self.waiting[job.question.id]
            answer = pair.baseline if job.arm == "baseline" else pair.candidate
            records.append(_record(job, completion, grade, answer.get("acceptance")))
        self.store.add_answers(self.run_id, records)
        for job, _, _ in items:
            self.waiting.pop(job.question.id, None)
        if self.judged is not None:
            self.judged.take_pairs()  # the decision is the report's, built from the store

    def poll(self) -> None:
        """Store the verdicts that arrived; after a failed judge call, ask the waiting pairs again later."""
        if self.judged is None:
            return
        self._store(self.judged.poll(0))
        if self.judged.error is not None and self.failed_at is None:
            self.failed_at = time.monotonic()
            log.warning(
                "shadow: the judge failed (%s); asking again in %.0f s", self.judged.error, JUDGE_RETRY_S
            )
        if self.failed_at is not None and time.monotonic() - self.failed_at >= JUDGE_RETRY_S:
            self.failed_at = None
            self.judged.close(wait_for_calls=False)
            self.judged = self._judged()
            for pair in list(self.waiting.values()):
                self._grade(pair)

    def close(self) -> None:
        if self.judged is not None:
            self.judged.close(wait_for_calls=False)
        self.store.close()
