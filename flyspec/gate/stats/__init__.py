"""The gate's statistics (docs/statistics.md), importing nothing else of the gate. The functions of the spec
(sections 11.1 and 11.3) are importable from here and load on first use (PEP 562), so that the command line
does not load scipy; everything else is imported from its module."""

from __future__ import annotations

from typing import TYPE_CHECKING

# Bound here after its module of the same name has loaded, so that the module does not hide the function.
from flyspec.gate.stats.decide import decide
from flyspec.lazy import lazy_attributes

if TYPE_CHECKING:
    from flyspec.gate.stats.decide import sequential_decision
    from flyspec.gate.stats.paired import mcnemar, net_difference_ci, noninferiority, paired_counts
    from flyspec.gate.stats.sequence import confidence_sequence
    from flyspec.gate.stats.sizing import questions_needed, questions_needed_noninferiority

__all__ = [
    "confidence_sequence",
    "decide",
    "mcnemar",
    "net_difference_ci",
    "noninferiority",
    "paired_counts",
    "questions_needed",
    "questions_needed_noninferiority",
    "sequential_decision",
]

__getattr__ = lazy_attributes(
    __name__,
    {
        "sequential_decision": "flyspec.gate.stats.decide",
        "mcnemar": "flyspec.gate.stats.paired",
        "net_difference_ci": "flyspec.gate.stats.paired",
        "noninferiority": "flyspec.gate.stats.paired",
        "paired_counts": "flyspec.gate.stats.paired",
        "confidence_sequence": "flyspec.gate.stats.sequence",
        "questions_needed": "flyspec.gate.stats.sizing",
        "questions_needed_noninferiority": "flyspec.gate.stats.sizing",
    },
)
