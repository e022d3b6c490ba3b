"""The paired quality gate: does a candidate decoding configuration keep the baseline's accuracy?

`from flyspec.gate import GateOptions, run, run_gate, run_pilot, build_report, load_dataset`, and
`compare_logs` (``gate compare``), `TuneOptions`, `tune`, `build_tune_report` (``gate tune``); see
docs/gate.md. The names load on first use (PEP 562), so that `flyspec --help`, which imports the gate's
command module, stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flyspec.gate.compare import compare_logs
    from flyspec.gate.datasets import Question, load_dataset
    from flyspec.gate.options import GateOptions
    from flyspec.gate.report import Report, build_report
    from flyspec.gate.runner import RunResult, run, run_gate, run_pilot
    from flyspec.gate.tune import TuneOptions, tune
    from flyspec.gate.tune_report import build_tune_report

__all__ = [
    "GateOptions",
    "Question",
    "Report",
    "RunResult",
    "TuneOptions",
    "build_report",
    "build_tune_report",
    "compare_logs",
    "load_dataset",
    "run",
    "run_gate",
    "run_pilot",
    "tune",
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
    "compare_logs": "flyspec.gate.compare",
    "TuneOptions": "flyspec.gate.tune",
    "tune": "flyspec.gate.tune",
    "build_tune_report": "flyspec.gate.tune_report",
}


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'flyspec.gate' has no attribute {name!r}")
