"""The gate's statistics, nothing else of the gate imported: the paired tests and intervals of a fixed-size
run, sample-size planning, the anytime-valid confidence sequence, the fixed-sequence procedure of
``gate tune``, the sequential run's stopping rule and the forecast of its end.

Every statistic is re-exported here: ``from flyspec.gate.stats import decide, mcnemar, ...``.
"""

from flyspec.gate.stats.decision import FAIL, INCONCLUSIVE, NOT_TESTED, PASS
from flyspec.gate.stats.multiple import FixedSequenceResult, fixed_sequence
from flyspec.gate.stats.paired import (
    CI_METHODS,
    Decision,
    McNemarResult,
    NonInferiorityResult,
    PairedCounts,
    decide,
    decide_with_undecided,
    mcnemar,
    net_difference_ci,
    noninferiority,
    paired_counts,
    tango_statistic,
    wilson_interval,
)
from flyspec.gate.stats.planning import (
    SampleSizePlan,
    flip_rate_upper_bound,
    plan_noninferiority,
    questions_needed,
    questions_needed_noninferiority,
)
from flyspec.gate.stats.sequential import (
    ConfidenceSequence,
    SequentialDecision,
    confidence_sequence,
    sequential_decision,
    sequential_decision_with_undecided,
    sequential_decisions,
)

__all__ = [
    "CI_METHODS",
    "FAIL",
    "INCONCLUSIVE",
    "NOT_TESTED",
    "PASS",
    "ConfidenceSequence",
    "Decision",
    "FixedSequenceResult",
    "McNemarResult",
    "NonInferiorityResult",
    "PairedCounts",
    "SampleSizePlan",
    "SequentialDecision",
    "confidence_sequence",
    "decide",
    "decide_with_undecided",
    "fixed_sequence",
    "flip_rate_upper_bound",
    "mcnemar",
    "net_difference_ci",
    "noninferiority",
    "paired_counts",
    "plan_noninferiority",
    "questions_needed",
    "questions_needed_noninferiority",
    "sequential_decision",
    "sequential_decision_with_undecided",
    "sequential_decisions",
    "tango_statistic",
    "wilson_interval",
]
