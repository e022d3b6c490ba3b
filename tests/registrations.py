"""A store's runs read back through the typed registration (flyspec/gate/data/spec.py): for every
run a version of flyspec registered, the typed record writes exactly what was stored, so a resume, which
compares the two key for key, sees no change."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from flyspec.gate.data.spec import Registration
from flyspec.gate.data.store import GateStore


def assert_registrations_round_trip(store: Path) -> list[str]:
    """Each run's stored registration, read and written again, is what was stored; returns the runs'
    kinds (so a caller can say which kinds it covered)."""
    with GateStore(store) as opened:
        runs = opened.runs()
    for run in runs:
        assert Registration.read(run.kind, run.registration).to_dict() == run.registration, run.run_id
    return [run.kind for run in runs]


def as_registered_before_bet_versions(store: Path, run_id: str) -> None:
    """Rewrite a stored judged run's registration as flyspec stored it before the bets had versions: no
    ``bet`` in its gold rule, no ``label_bet`` in its sequential plans."""
    with sqlite3.connect(store) as db:
        (text,) = db.execute("SELECT registration FROM runs WHERE run_id = ?", (run_id,)).fetchone()
        stored = json.loads(text)
        del stored["gold"]["bet"]
        for plan in [stored["sequential"], *(c["sequential"] for c in stored.get("comparisons", []))]:
            del plan["label_bet"]
        db.execute("UPDATE runs SET registration = ? WHERE run_id = ?", (json.dumps(stored), run_id))
