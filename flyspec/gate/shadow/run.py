"""A shadow run: the mirror's pairs become a registered, resumable gate run (docs/shadow.md).

``ShadowRun`` is the mirror's sink. Registration happens when it is built, before the first mirrored
request: the sequential run of flyspec/gate/shadow/registration.py, in the gate's store, refused
when the same run name was registered with other settings (as ``gate run`` refuses a changed resume).

One worker thread owns the store (its work: flyspec/gate/shadow/worker.py). A pair handed to the sink is
committed at once to ``shadow_pairs`` (the request, both answers, timings, token counts, acceptance) and
registered as the next question of the run (its id the row id: arrival order is the registered order);
only then does the sink return, so a
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

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from flyspec.gate.data.lock import StoreLock
from flyspec.gate.data.spec import Registration, keeping_bets
from flyspec.gate.data.store import GateStore
from flyspec.gate.report.build import Report, build_report
from flyspec.gate.runs.register import record_looks
from flyspec.gate.shadow.pair_store import SqlitePairStore
from flyspec.gate.shadow.pairs import MirroredPair
from flyspec.gate.shadow.registration import ShadowPlan
from flyspec.gate.shadow.worker import PairWorker
from flyspec.gate.stats.decide import FAIL, PASS

log = logging.getLogger(__name__)

REFRESH_S = 1.0
"""How often the worker rebuilds the decision (labels arrive from other processes too)."""


def register_shadow(store: GateStore, run_id: str, registration: Registration, has_pairs: bool) -> bool:
    """Register the shadow run, or check that this resume has its settings; True when it is new. A
    changed registration is refused once the run holds an answer or a stored pair (ValueError listing
    what changed, as ``gate run`` does)."""
    questions = store.questions(run_id)
    store.check_resumable(run_id, registration, questions, holds_data=has_pairs)
    new = store.register(run_id, registration, questions)
    record_looks(store, run_id)
    return new


@dataclass(frozen=True)
class LiveDecision:
    """The decision as it stands: the report's decision object, its bounds, the gold labels waiting, the
    judge's agreement with gold (None before the first label or without a judge) and the pairs stored."""

    decision: dict[str, object]
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
        self.pairs = SqlitePairStore(
            self.path, self.run_id
        )  # creates the file 0600 before the store opens it
        self._lock = StoreLock(self.path, self.run_id).acquire()
        try:
            with GateStore(self.path) as store:
                existing = store.get_run(self.run_id)
                # A run registered under earlier bets resumes with them.
                registration = keeping_bets(
                    registration, existing.registered if existing is not None else None
                )
                self.new = register_shadow(store, self.run_id, registration, self.pairs.count() > 0)
        except BaseException:
            self._lock.release()
            self.pairs.close()
            raise
        self.registration = registration
        self.stored = self.pairs.count()
        self.on_decided: Callable[[LiveDecision], None] = lambda decision: None
        self._inbox: queue.Queue[tuple[MirroredPair, Future[int]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="shadow-run", daemon=True)
        self._ready = threading.Event()
        self._state_lock = threading.Lock()
        self._state: LiveDecision | None = None
        self._built: tuple[tuple[object, ...], LiveDecision] | None = None
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
        """The report's decision, built again only when the run's rows or the stored pairs changed: the
        worker asks every second and /metrics at every scrape, and a sequential run's report simulates
        its label advice (seconds on a long run)."""
        with GateStore(self.path) as store:
            revision = (store.revision(self.run_id), self.pairs.count())
        kept = self._built
        if kept is not None and kept[0] == revision:
            return kept[1]
        state = live_decision(build_report(self.path, self.run_id), revision[1])
        self._built = (revision, state)
        return state

    # ----------------------------------------------------------------------------------- the worker

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
                self._refresh()

    def _refresh(self) -> None:
        try:
            state = self.decision()
        except Exception:  # a report that cannot be built yet (a store being written elsewhere) waits
            log.exception("shadow: the decision could not be built; retrying")
            return
        if state.decision.get("decision") in (PASS, FAIL):
            self.on_decided(state)
