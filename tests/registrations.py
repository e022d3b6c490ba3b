"""A store's runs read back through the typed registration (flyspec/gate/data/spec.py): for every
run a version of flyspec registered, the typed record writes exactly what was stored, so a resume, which
compares the two key for key, sees no change."""

from __future__ import annotations

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
