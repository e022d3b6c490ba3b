"""The gate's statistics, nothing else of the gate imported: the paired tests and intervals of a fixed-size
run, sample-size planning, the anytime-valid confidence sequence, the fixed-sequence procedure of
``gate tune``, the sequential run's stopping rule and the forecast of its end, judged runs anchored on gold
labels (prediction-powered inference), the alpha ledger of a comparison, and the simulated outcomes of a
design.

Every statistic is re-exported here: ``from flyspec.gate.stats import decide, mcnemar, ...``.
"""

from flyspec.gate.stats.decision import FAIL, INCONCLUSIVE, NOT_TESTED, PASS
from flyspec.gate.stats.designs import Design, DesignOutcome, design_outcome, judged_questions_needed
from flyspec.gate.stats.judged import (
    JudgedDecision,
    JudgedPair,
    JudgedSequence,
    LabelAdvice,
    gold_draw,
    gold_selected,
    judge_prediction,
    judged_decision,
    judged_values,
    labels_needed,
    usable_prefix,
)
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
from flyspec.gate.stats.spending import Look, NextLook, alpha_left, comparison_key, next_look

__all__ = [
    "CI_METHODS",
    "Design",
    "DesignOutcome",
    "JudgedDecision",
    "JudgedPair",
    "JudgedSequence",
    "LabelAdvice",
    "Look",
    "NextLook",
    "alpha_left",
    "comparison_key",
    "design_outcome",
    "gold_draw",
    "gold_selected",
    "judge_prediction",
    "judged_decision",
    "judged_questions_needed",
    "judged_values",
    "labels_needed",
    "next_look",
    "usable_prefix",
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
