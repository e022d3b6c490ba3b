"""The paired quality gate: does a candidate decoding configuration keep the baseline's accuracy?

`from flyspec.gate import GateOptions, run, run_gate, run_pilot, build_report, load_dataset`
(docs/gate.md). The names load on first use (PEP 562), so that `flyspec --help`, which imports the gate's
command module, stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flyspec.gate.datasets import Question, load_dataset
    from flyspec.gate.options import GateOptions
    from flyspec.gate.report import Report, build_report
    from flyspec.gate.runner import RunResult, run, run_gate, run_pilot

__all__ = [
    "GateOptions",
    "Question",
    "Report",
    "RunResult",
    "build_report",
    "load_dataset",
    "run",
    "run_gate",
    "run_pilot",
]

_HOMES = {
    "GateOptions": "flyspec.gate.options",
    "Question": "flyspec.gate.datasets",
    "load_dataset": "flyspec.gate.datasets",
    "Report": "flyspec.gate.report",
    "build_report": "flyspec.gate.report",
    "RunResult": "flyspec.gate.runner",
    "run": "flyspec.gate.runner",
    "run_gate": "flyspec.gate.runner",
    "run_pilot": "flyspec.gate.runner",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'flyspec.gate' has no attribute {name!r}")
