"""The worker of a shadow run (flyspec/gate/shadow/run.py): each stored pair as a gate question (its
request as prompt or messages, its id the pair's row id), its two answers as the gate's ``Job`` and
``Completion``, graded against the baseline's answer or judged in both orders by the judged-run machinery
(``JudgedPairs``), and committed as ``AnswerRecord`` rows with the pair's timings, token counts and
acceptance counters. One thread owns it and its store connection."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from flyspec.gate.arms.base import Completion, Job
from flyspec.gate.data.questions import Question
from flyspec.gate.data.results import request_texts
from flyspec.gate.data.store import AnswerRecord, GateStore, RegisteredQuestion, RunRecord
from flyspec.gate.grading.graders import EQUIVALENCE, JUDGE, Grade, grade_against_baseline
from flyspec.gate.runs.judging import Item, JudgedPairs
from flyspec.gate.shadow.pair_store import SqlitePairStore, StoredPair
from flyspec.gate.shadow.pairs import MirroredPair
from flyspec.gate.shadow.registration import DATASET, ERRORS, ShadowPlan

log = logging.getLogger(__name__)

LANES = [("baseline", 0), ("candidate", 0)]
JUDGE_RETRY_S = 10.0
"""How long after a failed judge call the waiting pairs are asked again."""


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


def label_requests(path: str | Path) -> Callable[[RunRecord], dict[str, str]]:
    """The request texts a labeller sees for a run of the store at ``path``: its datasets' (as `gate label`
    reads them) and, for a live-traffic run, its stored pairs'."""

    def requests(run: RunRecord) -> dict[str, str]:
        texts = request_texts(run)
        if run.registered.shadow is not None:
            texts.update(shadow_requests(path, run.run_id))
        return texts

    return requests


def _completion(answer: dict[str, object], source: str) -> Completion:
    return Completion(
        text=answer.get("text") or "",
        finish_reason=answer.get("finish_reason"),
        prompt_tokens=answer.get("prompt_tokens") or 0,
        completion_tokens=answer.get("completion_tokens") or 0,
        latency_s=float(answer.get("latency_s") or 0.0),
        source=source,
    )


def _record(
    job: Job, completion: Completion, grade: Grade, acceptance: dict[str, object] | None
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


class PairWorker:
    """What a shadow run's worker thread does with its own store connection (open it in that thread):
    commit and register pairs, grade or judge them, store what comes back."""

    def __init__(self, path: Path, plan: ShadowPlan, pairs: SqlitePairStore) -> None:
        self.plan = plan
        self.pairs = pairs
        self.run_id = plan.run_id
        self.store = GateStore(path)
        self.positions = len(self.store.questions(self.run_id))
        self.judged = self._judged()
        self.waiting: dict[str, StoredPair] = {}
        self.failed_at: float | None = None

    def _judged(self) -> JudgedPairs | None:
        judge = self.plan.judge
        return JudgedPairs(self.store, self.run_id, judge, LANES, self.plan.gold) if judge else None

    def recover(self) -> None:
        """Register the stored pairs a kill left without a question, and grade or judge every registered
        pair without its answers (in the stored order)."""
        registered = {q.question_id for q in self.store.questions(self.run_id)}
        answered = {k[3] for k in self.store.answered_keys(self.run_id)}
        for pair in self.pairs.pairs():
            qid = str(pair.id)
            if qid not in registered:
                self._register(pair)
            if qid not in answered:
                self._grade(pair)

    def take(self, pair: MirroredPair) -> int:
        """Commit a new pair, register its question and grade it (or send it to the judge); returns its id."""
        pair_id = self.pairs(pair)
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
        grader = self.plan.grader
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
