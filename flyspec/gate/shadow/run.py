"""A shadow run (docs/shadow.md): registered before the first mirrored request; its worker thread
(``PairWorker``) commits each pair and registers it as the next question before the sink returns (a
``kill -9`` loses at most the pairs in flight), then grades it against the baseline's answer or has it
judged in both orders, and hands what it stored to the run's live walk (live.py). Once that walk stops
at PASS or FAIL, ``on_decided`` runs.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from flyspec.checks import is_number
from flyspec.gate.arms.base import Completion, Job
from flyspec.gate.arms.endpoint import OpenAIArm
from flyspec.gate.arms.judge import Judge
from flyspec.gate.data.questions import Question, QuestionKey
from flyspec.gate.data.spec import (
    DEFAULT_GOLD_RATE,
    DatasetEntry,
    Gold,
    QuestionOrder,
    Registration,
    ShadowRecord,
)
from flyspec.gate.data.store import GateStore, RegisteredQuestion
from flyspec.gate.data.storefile import StoreLock
from flyspec.gate.grading.graders import (
    EQUIVALENCE,
    JUDGE,
    Grade,
    check_grader,
    grade_against_baseline,
    grader_named,
    pair_hash,
)
from flyspec.gate.report.build import build_report
from flyspec.gate.runs.judging import Item, JudgedPairs
from flyspec.gate.runs.register import commit
from flyspec.gate.runs.run import sequential_plan
from flyspec.gate.runs.session import answer_record
from flyspec.gate.shadow.live import LiveDecision, LiveWalk
from flyspec.gate.shadow.pairs import DATASET, ArmAnswer, MirroredPair, SqlitePairStore, StoredPair
from flyspec.gate.stats.decide import INCONCLUSIVE, SUPERPOPULATION, check_margin_alpha

log = logging.getLogger(__name__)

DEFAULT_MAX_PAIRS = 100_000
"""The registered maximum of a run started without --max-pairs (the sequence is valid at every size)."""
ORDER_RULE = "arrival order: each mirrored request is the next question once both arms have answered it"
CLAIM = (
    "the candidate against production on this traffic: each mirrored request is a random draw from the "
    "requests clients sent while the run lasted (by the registered sampling rule), so a decision speaks for "
    "that traffic in that period. Traffic drifts: a later mix of requests may differ."
)
ERRORS = (
    "a candidate answer that is an HTTP error, a timeout or not a completion is a wrong answer on that "
    "request (the baseline's is right there): the pair counts as a known loss, never as a skip"
)
LANES = [("baseline", 0), ("candidate", 0)]
REFRESH_S = 1.0
"""How often the worker reads the gold labels people gave (from other processes too)."""
JUDGE_RETRY_S = 10.0
"""How long after a failed judge call the waiting pairs are asked again."""


@dataclass(frozen=True)
class ShadowPlan:
    """The decision settings of a shadow run: pairs are judged (``judge``, gold labels drawn at
    ``gold_rate``) or graded by a pairwise ``grader`` such as ``equivalent_to_baseline:whitespace``."""

    run_id: str
    margin: float
    alpha: float
    judge: Judge | None
    gold_rate: float = DEFAULT_GOLD_RATE
    seed: int = 0
    max_pairs: int = DEFAULT_MAX_PAIRS
    grader: str | None = None

    def __post_init__(self) -> None:
        if (self.judge is None) == (self.grader is None):
            raise ValueError(
                "gate shadow grades each pair one way: give --judge JUDGE or --grader "
                "equivalent_to_baseline[:normaliser], not both and not neither"
            )
        if self.grader is not None:
            found, _ = grader_named(self.grader)
            if found.grade_pair is None or found.model_graded:
                raise ValueError(
                    f"--grader={self.grader!r}: live traffic has no reference answers, so the grader must "
                    "compare the candidate's answer with production's (equivalent_to_baseline[:normaliser])"
                )
            object.__setattr__(self, "grader", check_grader(self.grader))
        check_margin_alpha(self.margin, self.alpha)
        if not is_number(self.gold_rate, above=0, at_most=1):
            raise ValueError(f"--gold-rate={self.gold_rate!r}: the share of pairs labelled must be in (0, 1]")
        if not self.run_id:
            raise ValueError("--run: a shadow run needs a name")

    @property
    def gold(self) -> Gold | None:
        """The registered gold-label draw of a judged run (labels given by people)."""
        return Gold(self.gold_rate, self.seed, "human") if self.judge is not None else None


def shadow_registration(
    plan: ShadowPlan, baseline: OpenAIArm, candidate: OpenAIArm, sampling: Mapping[str, object]
) -> Registration:
    """A sequential gate run (i.i.d. claim) of ``candidate`` against ``baseline``, sampled by ``sampling``."""
    gold, n = plan.gold, plan.max_pairs
    sequential = sequential_plan(plan.margin, plan.alpha, n, n, plan.seed, SUPERPOPULATION, gold)
    return Registration(
        kind="gate",
        margin=plan.margin,
        alpha=plan.alpha,
        seed=plan.seed,
        arms={"baseline": baseline.identity(None), "candidate": candidate.identity(None)},
        datasets={DATASET: DatasetEntry()},
        repeats=(0,),
        max_questions=plan.max_pairs,
        order=QuestionOrder(plan.seed, ORDER_RULE, plan.max_pairs),
        design="sequential",
        sequential=sequential,
        judge=plan.judge.identity(None) if plan.judge is not None else None,
        gold=gold,
        shadow=ShadowRecord(CLAIM, sampling, ERRORS),
    )


def _completion(answer: ArmAnswer, source: str) -> Completion:
    return Completion(
        text=answer.text or "",
        finish_reason=answer.finish_reason,
        prompt_tokens=answer.prompt_tokens or 0,
        completion_tokens=answer.completion_tokens or 0,
        latency_s=answer.latency_s,
        source=source,
        acceptance=answer.acceptance,
    )


class PairWorker:
    """The run's worker thread's part, with its own store connection: commit, register, grade or judge."""

    def __init__(self, path: Path, plan: ShadowPlan, pairs: SqlitePairStore) -> None:
        self.plan = plan
        self.pairs = pairs
        self.run_id = plan.run_id
        self.store = GateStore(path)
        self.positions = len(self.store.questions(self.run_id))
        self.judged = self._judged()
        self.waiting: dict[str, StoredPair] = {}
        self.failed_at: float | None = None
        self.digests: dict[QuestionKey, str] = {}
        self.live: LiveWalk | None = None  # set once the walk of what is stored is built

    def _judged(self) -> JudgedPairs | None:
        judge = self.plan.judge
        return JudgedPairs(self.store, self.run_id, judge, LANES, self.plan.gold) if judge else None

    def recover(self) -> None:
        """Register and grade, in the stored order, what a kill left half done."""
        registered = {q.question_id for q in self.store.questions(self.run_id)}
        answered = {k[3] for k in self.store.answered_keys(self.run_id)}
        for pair in self.pairs.pairs():
            if str(pair.id) not in registered:
                self._register(pair)
            if str(pair.id) not in answered:
                self._grade(pair)

    def take(self, pair: MirroredPair) -> None:
        """Commit a new pair, register its question and grade it (or ask the judge)."""
        stored = self.pairs(pair)
        self._register(stored)
        self._grade(stored)

    def _question(self, pair: StoredPair) -> Question:
        """The pair's question; a judged run's pair whose candidate errored is a known loss, graded so."""
        grader = self.plan.grader or (JUDGE if pair.candidate.get("error") is None else EQUIVALENCE)
        return pair.question(grader)

    def _register(self, pair: StoredPair) -> None:
        q = self._question(pair)
        self.store.add_question(
            self.run_id, RegisteredQuestion(DATASET, q.id, self.positions, q.prompt_hash, "", q.grader)
        )
        self.positions += 1
        if self.live is not None:
            self.live.register((DATASET, q.id), q.grader)

    def _grade(self, pair: StoredPair) -> None:
        q = self._question(pair)
        baseline, candidate = pair.answers()
        jb, cb = Job("baseline", 0, q, 0, pair.id), _completion(baseline, pair.source)
        jc, cc = Job("candidate", 0, q, 0, pair.id), _completion(candidate, pair.source)
        self.waiting[q.id] = pair
        if candidate.error is not None:  # the registered rule: an error is a wrong answer, no judge asked
            wrong = Grade(None, False, f"error: {candidate.error}")
            self._store([(jb, cb, Grade(None, True, ERRORS)), (jc, cc, wrong)])
        elif self.judged is None:  # graded against the baseline's answer
            base, cand = grade_against_baseline(q.grader, cb.text, cc.text)
            self._store([(jb, cb, base), (jc, cc, cand)])
        else:
            gold = self.plan.gold
            if gold is not None and gold.selected(DATASET, q.id):  # the answers its label must name
                self.digests[(DATASET, q.id)] = pair_hash(cb.text, cc.text)
            self._store(self.judged.add(jb, cb) + self.judged.add(jc, cc))

    def _store(self, items: list[Item]) -> None:
        """Commit graded answers in one transaction (a pair's two answers together)."""
        if not items:
            return
        self.store.add_answers(self.run_id, [answer_record(*item) for item in items])
        for job, _, _ in items:
            self.waiting.pop(job.question.id, None)
        pairs = self.judged.take_pairs() if self.judged is not None else []
        if self.live is not None:
            self.live.graded(items)
            self.live.judged_pairs(pairs)

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


class ShadowRun:
    """The mirror's sink for a registered shadow run: ``start`` before the first pair, ``close`` last."""

    def __init__(self, path: str | Path, plan: ShadowPlan, registration: Registration) -> None:
        self.path = Path(path)
        self.plan = plan
        self.run_id = plan.run_id
        self.pairs = SqlitePairStore(self.path, self.run_id)  # creates the file 0600 before the store opens
        self._lock = StoreLock(self.path, self.run_id).acquire()
        try:
            with GateStore(self.path) as store:
                questions = store.questions(self.run_id)
                self.new = commit(store, self.run_id, registration, questions, self.pairs.count() > 0)
                self.registration = store.keeping_bets(self.run_id, registration)
        except BaseException:
            self._lock.release()
            self.pairs.close()
            raise
        self.stored = self.pairs.count()
        self.on_decided: Callable[[], object] = lambda: None
        self._inbox: queue.Queue[tuple[MirroredPair, Future[None]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="shadow-run", daemon=True)
        self._ready = threading.Event()
        self._building = threading.Lock()
        self._built: tuple[tuple[object, ...], dict[str, object]] | None = None
        self._live: LiveWalk | None = None
        self.error: BaseException | None = None

    def __call__(self, pair: MirroredPair) -> None:
        """Commit one pair and register it before returning; raises when the worker could not start."""
        if self.error is not None:
            raise RuntimeError(f"the shadow run's worker is not running: {self.error}")
        done: Future[None] = Future()
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

    def decision(self) -> dict[str, object]:
        """The decision object of ``gate report --json`` as the store holds it now, built by one thread at
        a time and only when the run's rows changed (a report walks every pair again and a sequential one
        simulates its label advice: asked by /decision and /status, never on the request path)."""
        with self._building, GateStore(self.path) as store:
            revision = store.revision(self.run_id)
            if self._built is None or self._built[0] != revision:
                self._built = (revision, build_report(store, self.run_id).decision_object())
            return self._built[1]

    def live(self) -> LiveDecision:
        """The decision as the live walk has it, with the gold labels stored so far (the gauges)."""
        live = self._live
        if live is None:  # the walk of what earlier processes stored is still being built
            return LiveDecision(0, -1.0, 1.0, 0, None)
        if live.digests:
            with GateStore(self.path) as store:
                live.labels(store.labels(self.run_id))
        return live.state()

    def _work(self) -> None:
        try:
            worker = PairWorker(self.path, self.plan, self.pairs)
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
                self._refresh(worker)

    def _refresh(self, worker: PairWorker) -> None:
        """Build the live walk once (after serving began: it walks every stored pair), read the labels
        people gave, and stop the mirroring once the walk decided."""
        try:
            if worker.live is None:
                worker.live = LiveWalk.of(worker.store, self.run_id, worker.digests)
                self._live = worker.live
            elif worker.digests:
                worker.live.labels(worker.store.labels(self.run_id))
        except Exception:  # a store being written elsewhere: asked again at the next refresh
            log.exception("shadow: the live decision could not be read; retrying")
            return
        stop = worker.live.monitor.stop
        if stop is not None and stop.decision != INCONCLUSIVE:
            self.on_decided()
