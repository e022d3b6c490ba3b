"""One answering session of a registered run: feed the unanswered jobs to the arms, then grade, commit and
monitor every answer in the main thread until the run is done or stops."""

from __future__ import annotations

import gc
import hashlib
import time
from collections.abc import Callable

from flyspec.gate.arms.base import Completion, Executor, Job
from flyspec.gate.arms.judge import Judge
from flyspec.gate.data.questions import Question, QuestionKey
from flyspec.gate.data.spec import Gold
from flyspec.gate.data.store import AnswerRecord, GateStore, RunNotes
from flyspec.gate.grading.graders import Grade, grade, grade_against_baseline, grader_named
from flyspec.gate.runs.dispatch import Answer, Dispatcher
from flyspec.gate.runs.judging import Item, JudgedPairs
from flyspec.gate.runs.progress import GateProgress, log
from flyspec.gate.runs.settings import RunSettings
from flyspec.gate.stats.decide import Outcome
from flyspec.gate.stats.monitor import Lane, Monitor

NOT_GRADED = "not graded (a calibration answer: it measures speed only)"
DRAIN_SHARE = 0.6
"""How much of a full answer's latency the answers in flight still need, on average, when admission stops
(they started at different times; the last to start needs nearly all of it)."""
MAX_DRAIN_SHARE = 0.25
"""Admission never stops earlier than this share of the budget before its end."""
GRACE_S = 60.0
"""Past the budget by this much, the answers still in flight are dropped."""


class Clock:
    """The answering time budget of one call, shared by every session of it."""

    def __init__(self, minutes: float | None) -> None:
        self.left = 60 * minutes if minutes is not None else None

    def spend(self, seconds: float) -> None:
        if self.left is not None:
            self.left -= seconds

    @property
    def out(self) -> bool:
        return self.left is not None and self.left <= 0


def question_seed(run_seed: int, dataset: str, question_id: str, repeat: int = 0) -> int:
    """Per-question seed: the same for every arm, so paired arms see the same randomness.

    Repeat 0 uses ``hash(run seed, question)``; a pilot's second pass (repeat 1) gets fresh seeds, so it
    measures how often sampling noise alone flips a question.
    """
    key = f"{run_seed}:{dataset}:{question_id}" + (f":{repeat}" if repeat else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") & 0x7FFFFFFF


def answer_record(job: Job, completion: Completion, g: Grade) -> AnswerRecord:
    """The stored record of a graded answer (a gate session's or a shadow run's)."""
    q = job.question
    acc = completion.acceptance
    return AnswerRecord(
        arm=job.arm,
        repeat=job.repeat,
        dataset=q.dataset,
        question_id=q.id,
        seed=job.seed,
        output=completion.text,
        extracted=g.extracted,
        correct=g.correct,
        finish_reason=completion.finish_reason,
        prompt_tokens=completion.prompt_tokens,
        completion_tokens=completion.completion_tokens,
        latency_s=completion.latency_s,
        num_drafts=acc.num_drafts if acc else None,
        num_draft_tokens=acc.num_draft_tokens if acc else None,
        num_accepted_tokens=acc.num_accepted_tokens if acc else None,
        num_forgiven_tokens=acc.num_forgiven_tokens if acc and completion.forgiven_reported else None,
        source=completion.source,
    )


class Session:
    """One call of ``run`` on a registered run: what is stored, what to answer, and how it is recorded."""

    def __init__(
        self,
        store: GateStore,
        options: RunSettings,
        run_id: str,
        lanes: list[Lane],
        questions: list[Question],
        monitors: dict[str, Monitor],
        *,
        graded: bool = True,
        judge: Judge | None = None,
        gold: Gold | None = None,
    ) -> None:
        self.store = store
        self.options = options
        # A tune's calibration answers are not graded: no quality data may order the tests.
        self.graded = graded
        self.gold = gold
        self.lanes = lanes
        self.run_id = run_id
        self.questions = questions
        # One sequential monitor per comparison (the candidate's first; none for a fixed run); a run stops
        # once all have.
        self.monitors = monitors
        # Only this session's lanes: a tune run stores every setting's answers in one run.
        self.done = {key for key in store.answered_keys(self.run_id) if (key[0], key[1]) in lanes}
        self.fingerprints: dict[str, dict[str, list[str]]] = {}
        # Why this session stopped and, for a sequential run, the in-order prefix length at that moment.
        self.reason: str | None = None
        self.stopped_at: int | None = None
        self._latencies: list[float] = []
        # Seconds spent answering in this session (what a tune's time budget counts).
        self.answering_s = 0.0
        self._dropped = False
        self.stored = [r for r in store.answers(self.run_id) if (r.arm, r.repeat) in lanes]
        # Reference outputs (the first lane's) for equivalent_to_baseline questions, and answers waiting
        # for theirs.
        first = lanes[0]
        self.references = {
            (r.dataset, r.question_id): r.output for r in self.stored if (r.arm, r.repeat) == first
        }
        self.waiting: dict[QuestionKey, list[tuple[Job, Completion]]] = {}
        self.judged = JudgedPairs(store, run_id, judge, lanes, gold) if judge is not None and graded else None
        self.max_seconds: float | None = None
        for record in self.stored:
            for monitor in self.monitors.values():
                monitor.add(record.arm, record.repeat, record.dataset, record.question_id, record.correct)

    @property
    def total(self) -> int:
        return len(self.lanes) * len(self.questions)

    @property
    def monitor(self) -> Monitor | None:
        """The candidate's sequential monitor (None for a fixed run)."""
        return next(iter(self.monitors.values()), None)

    @property
    def stopped(self) -> bool:
        """True when the run is sequential and every comparison has stopped."""
        return bool(self.monitors) and all(m.stop is not None for m in self.monitors.values())

    def live_lanes(self) -> set[Lane]:
        """The lanes still needed: every lane of a fixed run; in a sequential run, those of a comparison
        that has not stopped."""
        if not self.monitors:
            return set(self.lanes)
        return {lane for m in self.monitors.values() if m.stop is None for lane in m.lanes}

    def jobs(self, executor: Executor) -> list[Job]:
        """The executor's unanswered jobs in the registered order, its lanes side by side per question: every
        comparison's in-order prefix advances together (a control's decision and the candidate's pairs
        come in the same minutes, and no comparison waits for another to finish)."""
        live = self.live_lanes()
        seed = self.options.seed
        lanes = [lane for lane in self.lanes if lane[0] in executor.arms and lane in live]
        return [
            Job(arm, repeat, q, question_seed(seed, q.dataset, q.id, repeat), position)
            for position, q in enumerate(self.questions)
            for arm, repeat in lanes
            if (arm, repeat, q.dataset, q.id) not in self.done
        ]

    def _store(self, items: list[Item], bar: GateProgress) -> dict[str, Outcome]:
        """Commit graded answers in one transaction (a judged pair is stored whole or not at all), then
        update the monitors and the bar; returns the comparisons' sequential stops they caused."""
        if not items:
            return {}
        self.store.add_answers(self.run_id, [answer_record(*item) for item in items])
        stops: dict[str, Outcome] = {}
        for job, completion, g in items:
            self._note_fingerprint(job.arm, completion.source, completion.system_fingerprint)
            q = job.question
            added = {n: m.add(*job.lane, q.dataset, q.id, g.correct) for n, m in self.monitors.items()}
            stops.update({n: stop for n, stop in added.items() if stop is not None})
            bar.add(job.lane, g.correct)
        for key, pair in self.judged.take_pairs() if self.judged is not None else []:
            added = {n: m.add_pair(key, pair) for n, m in self.monitors.items()}
            stops.update({n: stop for n, stop in added.items() if stop is not None})
        return stops

    def _graded(self, answer: Answer) -> list[tuple[Job, Completion, Grade]]:
        """The grades this answer makes possible. An ``equivalent_to_baseline`` question grades the other
        lane against the first lane's output, so an answer that arrives before its reference waits (it is
        answered again after a crash, never stored ungraded)."""
        job, completion = answer.job, answer.completion
        q = job.question
        if not self.graded:
            return [(job, completion, Grade(None, False, NOT_GRADED))]
        gold = self.gold
        grader = grader_named(q.grader)[0]
        if grader.model_graded or (gold is not None and gold.every_question):
            if self.judged is None:
                raise ValueError(
                    f"question {q.dataset}/{q.id} has grader {q.grader!r} but the run has no judge"
                )
            return self.judged.add(job, completion)
        if not grader.pairwise:
            return [(job, completion, grade(q.grader, completion.text, q.answer))]
        key = (q.dataset, q.id)
        if job.lane == self.lanes[0]:
            self.references[key] = completion.text
            own = grade_against_baseline(q.grader, completion.text, completion.text)[0]
            waiting = self.waiting.pop(key, [])
            later = [(j, c, grade_against_baseline(q.grader, completion.text, c.text)[1]) for j, c in waiting]
            return [(job, completion, own), *later]
        reference = self.references.get(key)
        if reference is None:
            self.waiting.setdefault(key, []).append((job, completion))
            return []
        return [(job, completion, grade_against_baseline(q.grader, reference, completion.text)[1])]

    def _note_fingerprint(self, arm: str, url: str, fingerprint: str | None) -> None:
        if fingerprint is None:
            return
        seen = self.fingerprints.setdefault(arm, {}).setdefault(url, [])
        if fingerprint not in seen:
            seen.append(fingerprint)
            self.store.update_notes(self.run_id, {"system_fingerprints": self.fingerprints})

    def _pause(self, reason: str, dispatcher: Dispatcher, message: str) -> None:
        if self.reason is None:
            self.reason = reason
            self.stopped_at = self.monitor.prefix if self.monitor is not None else None
            dispatcher.stop()
            log(message)

    @property
    def stop_detail(self) -> dict[str, object]:
        """What a stop event records besides the candidate's prefix: each comparison's prefix (or where it
        stopped) when the run has several."""
        if len(self.monitors) < 2:
            return {}
        reached = {name: m.stop.stopped_at if m.stop else m.prefix for name, m in self.monitors.items()}
        return {"stopped_at": reached}

    def answer(
        self,
        executors: list[Executor],
        who: str,
        clock: Clock,
        detail: dict[str, str] | None = None,
        notes: Callable[[], RunNotes] | None = None,
    ) -> str:
        """Answer what the session lacks with ``executors``, which are freed afterwards (so one engine is
        gone before the next loads); returns why it ended. The store records the session's start (after
        loading: the time budget counts answering), the run's ``notes`` (facts the started executors know)
        and why it stopped (``detail``: which part of a tune), an error too."""
        store, monitor, detail, run_id = self.store, self.monitor, detail or {}, self.run_id
        try:
            if self.stopped and monitor is not None and monitor.stop is not None:
                stop = monitor.stop
                log(f"{who}: run {run_id!r} already stopped after {stop.stopped_at} questions; nothing to do")
                store.add_event(run_id, "stop", stop.reason, stop.stopped_at, {**detail, **self.stop_detail})
                return stop.reason
            if not any(self.jobs(ex) for ex in executors):
                store.add_event(run_id, "stop", "complete", detail=detail)
                return "complete"
            if clock.out:
                return "time_budget"
            for ex in executors:
                log(f"{who}: starting {ex.describe()}")
                ex.start()
            store.add_event(run_id, "start", detail=detail)
            if notes is not None:
                store.update_notes(run_id, notes())
            self.max_seconds = clock.left
            reason = "error"
            try:
                reason = self._dispatch(executors)
            finally:
                why = self.reason or reason
                store.add_event(run_id, "stop", why, self.stopped_at, {**detail, **self.stop_detail})
            clock.spend(self.answering_s)
            return reason
        finally:
            executors.clear()
            gc.collect()

    def _dispatch(self, executors: list[Executor]) -> str:
        """Answer every unanswered job (or until a stop); returns why it ended."""
        jobs = [self.jobs(ex) for ex in executors]
        budget = self.max_seconds
        deadline = time.monotonic() + budget if budget is not None else None
        progress = GateProgress(
            self.lanes,
            self.total,
            len(self.done),
            monitors=self.monitors,
            deadline=deadline,
            enabled=self.options.progress,
        )
        for record in self.stored:
            progress.add((record.arm, record.repeat), record.correct, new=False)
        started = time.monotonic()
        aborted = True
        try:
            with progress as bar, Dispatcher(executors, jobs, self.options.sampling) as dispatcher:
                try:
                    self._loop(dispatcher, bar, deadline)
                    aborted = False
                finally:
                    self._record_times(executors, jobs, dispatcher)
                    self._record_prefix_cache(executors)
                    if self.judged is not None:
                        self.judged.close(wait_for_calls=not aborted)
                dispatcher.raise_error()
                if self.judged is not None and self.judged.error is not None:
                    raise self.judged.error
        finally:
            self.answering_s += time.monotonic() - started
        return self.reason or "complete"

    def _stopped_by(self, stops: dict[str, Outcome], dispatcher: Dispatcher, in_flight: str) -> None:
        if not stops or self.reason is not None:
            return
        several = len(self.monitors) > 1
        for name, stop in stops.items():
            if several:
                log(f"gate: {name}: {stop.decision} after {stop.stopped_at} questions ({stop.reason})")
        if not self.stopped:
            # Another comparison goes on: the stopped one's candidate needs no more answers, so its jobs
            # (also those in flight) give their slots to the comparisons still deciding.
            live = self.live_lanes()
            dispatcher.drop(lambda j: j.lane in live)
            return
        primary = self.monitor
        assert primary is not None and primary.stop is not None
        self.reason, self.stopped_at = primary.stop.reason, primary.stop.stopped_at
        dispatcher.stop()
        what = "every comparison stopped" if several else f"{primary.stop.decision}"
        log(f"gate: stopped after {primary.stop.stopped_at} questions ({what}); {in_flight}")

    def _watch_budget(self, deadline: float, dispatcher: Dispatcher) -> None:
        """Stop taking new questions early enough that the answers in flight end by the budget (they take
        about DRAIN_SHARE of a full answer's latency, measured in this session); past the budget plus
        GRACE_S, drop what is still in flight (a rerun asks it again)."""
        now = time.monotonic()
        drain = DRAIN_SHARE * sum(self._latencies) / len(self._latencies) if self._latencies else 0.0
        drain = min(drain, MAX_DRAIN_SHARE * (self.max_seconds or 0.0))
        if self.reason is None and now > deadline - drain:
            early = f" {drain:.0f} s early" if drain >= 1 else ""
            self._pause(
                "time_budget",
                dispatcher,
                f"gate: time budget: no new question from now on{early}, so that the answers in flight "
                "(finished and stored) end about when the budget does",
            )
        elif self.reason == "time_budget" and now > deadline + GRACE_S and not self._dropped:
            self._dropped = True
            past = f"gate: {GRACE_S:.0f} s past the time budget"
            log(f"{past}: the answers still in flight are dropped (a rerun asks them again)")
            dispatcher.abort()

    def _loop(self, dispatcher: Dispatcher, bar: GateProgress, deadline: float | None) -> None:
        in_flight = "the answers in flight are finished and stored"
        # Judge calls in flight are waited for, like answers in flight.
        while not dispatcher.finished or (self.judged is not None and self.judged.busy):
            try:
                answer = dispatcher.next(timeout=0.25) if not dispatcher.finished else None
                if answer is not None:
                    # Grade and commit it (and any answers that waited for it).
                    self._latencies.append(answer.completion.latency_s)
                    self._stopped_by(self._store(self._graded(answer), bar), dispatcher, in_flight)
                else:
                    bar.refresh()
                if self.judged is not None:
                    wait = 0.25 if dispatcher.finished else 0.0
                    self._stopped_by(self._store(self.judged.poll(wait), bar), dispatcher, in_flight)
                    if self.judged.error is not None:
                        self._pause(
                            "error", dispatcher, f"gate: the judge failed; {in_flight} before stopping"
                        )
                if dispatcher.failed:
                    self._pause("error", dispatcher, f"gate: an arm failed; {in_flight} before stopping")
                if deadline is not None:
                    self._watch_budget(deadline, dispatcher)
            except KeyboardInterrupt:
                # Ctrl-C stops now (within 2 s), not after the answers in flight, which can take
                # minutes in a full batch: they are dropped, and a rerun asks them again. Nothing stored
                # is lost, and the report shows the run paused at the prefix reached.
                self._pause(
                    "interrupted",
                    dispatcher,
                    "gate: interrupted; the answers in flight are dropped (a rerun asks them again)",
                )
                dispatcher.abort()
                if self.judged is not None:
                    self.judged.close(wait_for_calls=False)
                return

    def _record_prefix_cache(self, executors: list[Executor]) -> None:
        counts = [c for ex in executors if (c := ex.take_prefix_cache()) is not None]
        if not counts:
            return
        run = self.store.get_run(self.run_id)
        before = (run.notes if run is not None else {}).get("prefix_cache", {"queries": 0, "hits": 0})
        total = {
            "queries": before["queries"] + sum(q for q, _ in counts),
            "hits": before["hits"] + sum(h for _, h in counts),
        }
        self.store.update_notes(self.run_id, {"prefix_cache": total})

    def _record_times(self, executors: list[Executor], jobs: list[list[Job]], dispatcher: Dispatcher) -> None:
        for todo, spent in zip(jobs, dispatcher.times, strict=True):
            if not spent.answers:
                continue
            # The lanes this executor answered in this session: a shared engine whose other lane was
            # already stored (a tune's baseline) ran one lane alone, and its busy time is that lane's.
            answered = {job.lane for job in todo}
            lanes = [lane for lane in self.lanes if lane in answered]
            arm, repeat = lanes[0] if len(lanes) == 1 else ("+".join(f"{a}#{r}" for a, r in lanes), -1)
            self.store.add_batch(
                self.run_id, arm, repeat, spent.answers, spent.completion_tokens, spent.seconds
            )
