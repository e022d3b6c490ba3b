"""The per-user alpha ledger's records: every look a user takes at a comparison, in one SQLite file per
user, keyed by the questions' content and by what decides each arm's outputs (docs/statistics.md, "Kept
per user, keyed by content and by outputs"; the accounting is flyspec/gate/stats/spending.py)."""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from flyspec.assets import cache_dir
from flyspec.gate.data.spec import ComparisonPlan, Registration
from flyspec.gate.data.store import GateStore, RunRecord
from flyspec.gate.stats.decide import SUPERPOPULATION
from flyspec.gate.stats.spending import Look, comparison_key

LEDGER_ENV = "FLYSPEC_GATE_LEDGER"
LEDGER_FILE = "gate-ledger.sqlite"
_LOSSLESS_MODES = ("standard", "target_only")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS looks (
    look_id TEXT NOT NULL,
    comparison TEXT NOT NULL,
    key TEXT NOT NULL,
    kind TEXT NOT NULL,
    claim TEXT NOT NULL,
    alpha REAL NOT NULL,
    budget REAL,
    carries TEXT,
    run_id TEXT NOT NULL,
    store TEXT NOT NULL,
    created_at REAL NOT NULL,
    questions TEXT NOT NULL,
    recorded_at REAL NOT NULL,
    PRIMARY KEY (look_id, comparison)
);
CREATE INDEX IF NOT EXISTS looks_by_key ON looks (key);
"""


def ledger_path() -> Path:
    """The user's ledger file: ``$FLYSPEC_GATE_LEDGER``, else ``gate-ledger.sqlite`` in the cache folder."""
    chosen = os.environ.get(LEDGER_ENV)
    return Path(chosen).expanduser() if chosen else cache_dir() / LEDGER_FILE


class HasContent(Protocol):
    @property
    def prompt_hash(self) -> str: ...

    @property
    def answer(self) -> str: ...


def question_key(question: HasContent) -> str:
    """A question's key in the ledger: the sha256 of what the model sees and the reference answer."""
    return hashlib.sha256(f"{question.prompt_hash}\n{question.answer}".encode()).hexdigest()[:32]


def output_identity(
    identity: Mapping[str, object], declared: Mapping[str, object] | None = None
) -> dict[str, object]:
    """What decides an arm's outputs, from its registered identity (docs/statistics.md's table);
    ``declared``: the speculative config a tune declared for an endpoint setting."""
    kind = identity.get("kind")
    if kind == "engine":
        spec = identity.get("speculative_config")
        mode = identity.get("verification")
        out: dict[str, object] = {"kind": "engine", "model": identity.get("model")}
        if mode == "draft_only":
            # The draft model's own answers: the verifier's settings do nothing there.
            draft = {k: spec.get(k) for k in ("method", "model", "num_speculative_tokens")} if spec else None
            return {**out, "verification": mode, "draft": draft}
        policy = spec.get("rejection_sample_method") if spec is not None else None
        lossless = spec is None or mode in _LOSSLESS_MODES or policy == "standard"
        return out if lossless else {**out, "speculative_config": spec}
    if kind == "openai":
        served = identity.get("served_model") or {}
        model = served.get("root") or served.get("id") or identity.get("model")
        out = {"kind": "openai", "model": model}
        return {**out, "speculative_config": dict(declared)} if declared else out
    return {k: v for k, v in identity.items() if k != "served_model"}


def comparison_key_of(registration: Registration, plan: ComparisonPlan) -> str | None:
    """The ledger's key of one registered comparison (None when an arm's identity is missing)."""
    arms = registration.arms
    declared = {s.id: s.speculative_config for s in registration.settings}
    base, cand = arms.get(plan.baseline[0]), arms.get(plan.candidate[0])
    if not isinstance(base, dict) or not isinstance(cand, dict):
        return None
    return comparison_key(output_identity(base), output_identity(cand, declared.get(plan.candidate[0])))


def look_claim(plan: ComparisonPlan) -> str:
    """What a comparison's PASS claims: a sequential plan's population, else about the method."""
    return plan.sequential.population if plan.sequential is not None else SUPERPOPULATION


def look_kind(registration: Registration) -> str:
    """A run's kind of look: ``tune``, or its registered design."""
    return "tune" if registration.kind == "tune" else registration.design_name


def look_id(run: RunRecord) -> str:
    """A look's id across stores: its run and the moment it was registered (a moved or copied store keeps
    both, so it stays the same look)."""
    return f"{run.run_id}@{run.created_at!r}"


@dataclass(frozen=True)
class Entry:
    """One look at one comparison: its ledger ``key``, the comparison's name in its run, the look, and
    when it was registered."""

    key: str
    comparison: str
    look: Look
    created_at: float


def run_entries(store: GateStore, run: RunRecord) -> list[Entry]:
    """The looks one registered run takes, one per comparison (a gate run's or a tune's; a pilot and a
    calibration run take none)."""
    if run.kind not in ("gate", "tune"):
        return []
    questions = frozenset(question_key(q) for q in store.questions(run.run_id))
    where = str(store.path.resolve())
    reg, budget = run.registered, run.registered.alpha_budget
    out = []
    for plan in reg.comparisons:
        key = comparison_key_of(reg, plan)
        if key is None:
            continue
        look = Look(
            run.run_id,
            look_kind(reg),
            plan.alpha,
            questions,
            budget=max(budget, plan.alpha) if budget is not None else None,
            carries=reg.carries,
            claim=look_claim(plan),
            look_id=look_id(run),
            where=where,
        )
        out.append(Entry(key, plan.name, look, run.created_at))
    return out


def store_entries(store: GateStore) -> list[Entry]:
    """Every look registered in the store."""
    return [entry for run in store.runs() for entry in run_entries(store, run)]


class UserLedger:
    """The user's ledger file (``ledger_path()``). Use as a context manager."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else ledger_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
        except (OSError, sqlite3.DatabaseError) as exc:
            raise ValueError(
                f"the gate's alpha ledger {self.path} cannot be opened ({exc}); it records every look at a "
                f"comparison for this user: make its folder writable, or set {LEDGER_ENV} to a writable file"
            ) from None

    def __enter__(self) -> UserLedger:
        return self

    def __exit__(self, *exc: object) -> None:
        self._db.close()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """One writer at a time from check to record: two runs registering at once see each other."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def entries(self, key: str) -> list[Entry]:
        """Every look recorded at the comparison ``key``, oldest first."""
        rows = self._db.execute(
            "SELECT look_id, comparison, kind, claim, alpha, budget, carries, run_id, store, created_at, "
            "questions FROM looks WHERE key = ? ORDER BY created_at, look_id",
            (key,),
        )
        out = []
        for lid, comparison, kind, claim, alpha, budget, carries, run_id, store, created, questions in rows:
            look = Look(
                run_id, kind, alpha, frozenset(json.loads(questions)), budget, carries, claim, lid, store
            )
            out.append(Entry(key, comparison, look, created))
        return out

    def record(self, entries: list[Entry]) -> None:
        """Record looks (a look already recorded is updated: a sequential run's questions grow)."""
        now = time.time()
        self._db.executemany(
            "INSERT INTO looks VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (look_id, comparison) DO UPDATE SET questions = excluded.questions, "
            "store = excluded.store, recorded_at = excluded.recorded_at",
            [
                (
                    e.look.id,
                    e.comparison,
                    e.key,
                    e.look.kind,
                    e.look.claim,
                    e.look.alpha,
                    e.look.budget,
                    e.look.carries,
                    e.look.run_id,
                    e.look.where,
                    e.created_at,
                    json.dumps(sorted(str(q) for q in e.look.questions)),
                    now,
                )
                for e in entries
            ],
        )
