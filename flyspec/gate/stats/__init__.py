"""The gate's statistics, nothing else of the gate imported: the paired tests and intervals of a fixed-size
run, sample-size planning, the anytime-valid confidence sequence, the fixed-sequence procedure of
``gate tune``, the sequential run's stopping rule and the forecast of its end, judged runs anchored on gold
labels (prediction-powered inference), the alpha ledger of a comparison, and the simulated outcomes of a
design.

Every statistic is re-exported here: ``from flyspec.gate.stats import decide, mcnemar, ...``.

The names load on first use (PEP 562), so that importing one statistic (the settings' checks, the
command line building its options) does not load them all, nor scipy.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING

from flyspec.lazy import lazy_attributes

if TYPE_CHECKING:
    from flyspec.gate.stats.decide import (
        FAIL,
        INCONCLUSIVE,
        NOT_TESTED,
        PASS,
        Decision,
        FixedSequenceResult,
        SequentialDecision,
        decide,
        fixed_sequence,
        sequential_decision,
    )
    from flyspec.gate.stats.forecast import Design, DesignOutcome, design_outcome, judged_questions_needed
    from flyspec.gate.stats.judged import (
        JudgedDecision,
        JudgedPair,
        JudgedSequence,
        gold_draw,
        gold_selected,
        judge_prediction,
        judged_decision,
        judged_values,
        usable_prefix,
    )
    from flyspec.gate.stats.label_advice import LabelAdvice, labels_needed
    from flyspec.gate.stats.paired import (
        McNemarResult,
        NonInferiorityResult,
        PairedCounts,
        mcnemar,
        net_difference_ci,
        noninferiority,
        paired_counts,
        tango_statistic,
        wilson_interval,
    )
    from flyspec.gate.stats.sequence import ConfidenceSequence, confidence_sequence
    from flyspec.gate.stats.simulation import sequential_decisions
    from flyspec.gate.stats.sizing import (
        SampleSizePlan,
        flip_rate_upper_bound,
        plan_noninferiority,
        questions_needed,
        questions_needed_noninferiority,
    )
    from flyspec.gate.stats.spending import Look, NextLook, alpha_left, comparison_key, next_look

__all__ = [
    "ConfidenceSequence",
    "Decision",
    "Design",
    "DesignOutcome",
    "FAIL",
    "FixedSequenceResult",
    "INCONCLUSIVE",
    "JudgedDecision",
    "JudgedPair",
    "JudgedSequence",
    "LabelAdvice",
    "Look",
    "McNemarResult",
    "NOT_TESTED",
    "NextLook",
    "NonInferiorityResult",
    "PASS",
    "PairedCounts",
    "SampleSizePlan",
    "SequentialDecision",
    "alpha_left",
    "comparison_key",
    "confidence_sequence",
    "decide",
    "design_outcome",
    "fixed_sequence",
    "flip_rate_upper_bound",
    "gold_draw",
    "gold_selected",
    "judge_prediction",
    "judged_decision",
    "judged_questions_needed",
    "judged_values",
    "labels_needed",
    "mcnemar",
    "net_difference_ci",
    "next_look",
    "noninferiority",
    "paired_counts",
    "plan_noninferiority",
    "questions_needed",
    "questions_needed_noninferiority",
    "sequential_decision",
    "sequential_decisions",
    "tango_statistic",
    "usable_prefix",
    "wilson_interval",
]

_HOMES = {
    "Decision": "flyspec.gate.stats.decide",
    "FAIL": "flyspec.gate.stats.decide",
    "FixedSequenceResult": "flyspec.gate.stats.decide",
    "INCONCLUSIVE": "flyspec.gate.stats.decide",
    "NOT_TESTED": "flyspec.gate.stats.decide",
    "PASS": "flyspec.gate.stats.decide",
    "SequentialDecision": "flyspec.gate.stats.decide",
    "decide": "flyspec.gate.stats.decide",
    "fixed_sequence": "flyspec.gate.stats.decide",
    "sequential_decision": "flyspec.gate.stats.decide",
    "Design": "flyspec.gate.stats.forecast",
    "DesignOutcome": "flyspec.gate.stats.forecast",
    "design_outcome": "flyspec.gate.stats.forecast",
    "judged_questions_needed": "flyspec.gate.stats.forecast",
    "JudgedDecision": "flyspec.gate.stats.judged",
    "JudgedPair": "flyspec.gate.stats.judged",
    "JudgedSequence": "flyspec.gate.stats.judged",
    "LabelAdvice": "flyspec.gate.stats.label_advice",
    "gold_draw": "flyspec.gate.stats.judged",
    "gold_selected": "flyspec.gate.stats.judged",
    "judge_prediction": "flyspec.gate.stats.judged",
    "judged_decision": "flyspec.gate.stats.judged",
    "judged_values": "flyspec.gate.stats.judged",
    "labels_needed": "flyspec.gate.stats.label_advice",
    "usable_prefix": "flyspec.gate.stats.judged",
    "McNemarResult": "flyspec.gate.stats.paired",
    "NonInferiorityResult": "flyspec.gate.stats.paired",
    "PairedCounts": "flyspec.gate.stats.paired",
    "mcnemar": "flyspec.gate.stats.paired",
    "net_difference_ci": "flyspec.gate.stats.paired",
    "noninferiority": "flyspec.gate.stats.paired",
    "paired_counts": "flyspec.gate.stats.paired",
    "tango_statistic": "flyspec.gate.stats.paired",
    "wilson_interval": "flyspec.gate.stats.paired",
    "ConfidenceSequence": "flyspec.gate.stats.sequence",
    "confidence_sequence": "flyspec.gate.stats.sequence",
    "sequential_decisions": "flyspec.gate.stats.simulation",
    "SampleSizePlan": "flyspec.gate.stats.sizing",
    "flip_rate_upper_bound": "flyspec.gate.stats.sizing",
    "plan_noninferiority": "flyspec.gate.stats.sizing",
    "questions_needed": "flyspec.gate.stats.sizing",
    "questions_needed_noninferiority": "flyspec.gate.stats.sizing",
    "Look": "flyspec.gate.stats.spending",
    "NextLook": "flyspec.gate.stats.spending",
    "alpha_left": "flyspec.gate.stats.spending",
    "comparison_key": "flyspec.gate.stats.spending",
    "next_look": "flyspec.gate.stats.spending",
}


__getattr__ = lazy_attributes(__name__, _HOMES)


class _Statistics(ModuleType):
    """The package, keeping ``decide`` for the public function when its module of the same name loads:
    the import system binds a submodule onto its package, which would hide the function behind the module
    ``flyspec.gate.stats.decide``; the function then comes from ``__getattr__``."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "decide" and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Statistics
