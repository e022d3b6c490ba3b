"""The decision and label advice the labelling page shows (flyspec/gate/shadow/label.py), read from
the run's report: the page itself sits in the traffic layer, which does not import the report, so whoever
serves it passes ``label_progress`` in. The page asks after every label, and a sequential run's report
simulates its label advice (seconds on a long run), so a reading is kept until the run's rows change."""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

from flyspec.gate.data.store import GateStore
from flyspec.gate.report.build import build_report


class LabelProgress(TypedDict):
    """What the labelling page shows of a run's report (``label_progress``)."""

    decision: str | None
    interim: str | None
    low: float | None
    high: float | None
    margin: float
    judge_agreement: float | None
    labels_needed: int | None
    advised_rate: float | None
    gold_rate: float | None
    advice: str | None


_readings: dict[tuple[Path, str], tuple[tuple[object, ...], LabelProgress]] = {}


def label_progress(store_path: Path, run_id: str) -> LabelProgress:
    """The run's decision as it stands (None while drawn pairs wait: the report's reading is then interim),
    its interval and margin, the judge's agreement with gold, and the report's label advice (the sentence
    and ``labels_needed``, the labels that would let the run decide at the label rate ``advised_rate``;
    None when none would) beside the run's registered ``gold_rate``. The report is built again only when
    the store's rows for the run changed since the last call (``GateStore.revision``)."""
    with GateStore(store_path) as store:
        revision = store.revision(run_id)
    kept = _readings.get((store_path, run_id))
    if kept is not None and kept[0] == revision:
        return kept[1]
    reading = _read(store_path, run_id)
    _readings[(store_path, run_id)] = (revision, reading)
    return reading


def _read(store_path: Path, run_id: str) -> LabelProgress:
    report = build_report(store_path, run_id)
    pooled, gold = report.pooled, report.gold
    interim = pooled.interim_decision if pooled is not None else None
    return {
        "decision": pooled.decision if pooled is not None and interim is None else None,
        "interim": interim,
        "low": pooled.ci_low if pooled is not None else None,
        "high": pooled.ci_high if pooled is not None else None,
        "margin": report.registered.margin,
        "judge_agreement": gold.agreement if gold is not None else None,
        "labels_needed": gold.labels_needed if gold is not None else None,
        "advised_rate": gold.advised_rate if gold is not None else None,
        "gold_rate": gold.rate if gold is not None else None,
        "advice": gold.advice if gold is not None else None,
    }
