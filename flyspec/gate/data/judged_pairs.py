"""A judged run's pairs as the statistics read them (flyspec/gate/stats/judged.py): per question, whether
the two answers are identical, the judge's prediction from its two orders, whether the pair was drawn for
a gold label, and the label once given.

Built the same way while a run answers (flyspec/gate/runs/judging.py) and from the store afterwards, so a
report recomputes exactly the pairs the run monitored. A label counts only for the two outputs it was
given for (its ``pair_sha256``), and only a pair drawn by the registered rule carries one.
"""

from __future__ import annotations

from collections.abc import Mapping

from flyspec.gate.data.spec import Gold
from flyspec.gate.data.store import GateStore, LabelRecord, RunRecord
from flyspec.gate.grading.judge import lane_label, pair_hash, preferred
from flyspec.gate.stats.judged import JudgedPair, judge_prediction

Lane = tuple[str, int]
QuestionKey = tuple[str, str]
VOTES = {"second": 1, "first": -1}
"""A judge order's vote: +1 when it prefers the candidate (the second lane), -1 the baseline, else 0."""


def make_pair(
    gold: Gold,
    dataset: str,
    question_id: str,
    first_output: str,
    second_output: str,
    preferences: Mapping[str, str],
    label: LabelRecord | None,
) -> JudgedPair:
    """One judged pair from the two outputs, the judge's preference in each order (``AB``, ``BA``) and the
    gold label stored for the question (ignored unless it was given for these two outputs)."""
    if first_output == second_output:
        return JudgedPair(identical=True)
    f = judge_prediction(VOTES.get(preferences["AB"], 0), VOTES.get(preferences["BA"], 0))
    selected = gold.selected(dataset, question_id)
    value = None
    if selected and label is not None and label.pair_sha256 == pair_hash(first_output, second_output):
        value = label.value
    return JudgedPair(False, f, selected, value)


def exact_pair(gold: Gold, dataset: str, question_id: str, first: bool, second: bool) -> JudgedPair:
    """A question of a judged run graded by its own exact grader on every pair: its difference is known,
    so it enters as a pair whose prediction is exact (and, when drawn, whose label is that difference)."""
    d = int(second) - int(first)
    selected = gold.selected(dataset, question_id)
    return JudgedPair(False, float(d), selected, d if selected else None)


def stored_pairs(
    store: GateStore, run: RunRecord, lanes: tuple[Lane, Lane], gold: Gold
) -> dict[QuestionKey, JudgedPair]:
    """Every complete pair of a judged run, by question: both answers stored and, for a judged question
    whose answers differ, both of the judge's verdicts on exactly those answers."""
    first, second = lanes
    labels = (lane_label(first), lane_label(second))
    answers = {(a.arm, a.repeat, a.dataset, a.question_id): a for a in store.answers(run.run_id)}
    verdicts = {
        (j.dataset, j.question_id, j.position, j.pair_sha256): preferred(j.position, j.verdict)
        for j in store.judgements(run.run_id)
        if (j.first_lane, j.second_lane) == labels
    }
    stored_labels = store.labels(run.run_id)
    out: dict[QuestionKey, JudgedPair] = {}
    for q in store.questions(run.run_id):
        key = (q.dataset, q.question_id)
        a, b = answers.get((*first, *key)), answers.get((*second, *key))
        if a is None or b is None:
            continue
        if not gold.judged(q.grader):
            out[key] = exact_pair(gold, *key, a.correct, b.correct)
            continue
        digest = pair_hash(a.output, b.output)
        prefs = {pos: verdicts.get((*key, pos, digest)) for pos in ("AB", "BA")}
        if a.output != b.output and any(v is None for v in prefs.values()):
            continue
        out[key] = make_pair(gold, *key, a.output, b.output, prefs, stored_labels.get(key))  # type: ignore[arg-type]
    return out
