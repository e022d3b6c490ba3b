"""The paired quality gate: does a candidate decoding configuration keep the baseline's accuracy?

`from flyspec.gate import GateOptions, run, run_gate, run_pilot, build_report, load_dataset`, and
`compare_logs` (``gate compare``), `TuneOptions`, `tune`, `build_tune_report` (``gate tune``); see
docs/gate.md. The names load on first use (PEP 562), so that `flyspec --help`, which imports the gate's
command module, stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flyspec.lazy import lazy_attributes

if TYPE_CHECKING:
    from flyspec.gate.data.questions import Question, load_dataset
    from flyspec.gate.logs.compare import compare_logs
    from flyspec.gate.report.build import Report, build_report
    from flyspec.gate.report.tune_report import build_tune_report
    from flyspec.gate.runs.run import RunResult, run, run_gate, run_pilot
    from flyspec.gate.runs.settings import GateOptions
    from flyspec.gate.runs.tune import TuneOptions, tune

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
    "GateOptions": "flyspec.gate.runs.settings",
    "Question": "flyspec.gate.data.questions",
    "load_dataset": "flyspec.gate.data.questions",
    "Report": "flyspec.gate.report.build",
    "build_report": "flyspec.gate.report.build",
    "RunResult": "flyspec.gate.runs.run",
    "run": "flyspec.gate.runs.run",
    "run_gate": "flyspec.gate.runs.run",
    "run_pilot": "flyspec.gate.runs.run",
    "compare_logs": "flyspec.gate.logs.compare",
    "TuneOptions": "flyspec.gate.runs.tune",
    "tune": "flyspec.gate.runs.tune",
    "build_tune_report": "flyspec.gate.report.tune_report",
}


__getattr__ = lazy_attributes(__name__, _HOMES)
