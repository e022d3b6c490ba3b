"""``gate compare``: a paired decision from two finished evaluations' per-sample logs, nothing re-run.

Each side is an lm-evaluation-harness samples log, an Inspect AI log or one arm of a gate store
(flyspec/gate/logs/evallogs.py); the two are paired question by question (flyspec/gate/logs/pairing.py,
which refuses different question sets naming them) and decided with the same rule as a gate run
(``stats.decide`` on Tango's interval at level ``1 - 2 alpha``), per task and pooled.

The logs existed before the margin was chosen, so the margin and alpha are declared after the data and the
report says so at its top: a margin picked after seeing the results can be picked to give any answer.

Several epochs of one question (Inspect's ``epochs``, a store's repeats) are not independent pairs: the
paired tests would count one question several times and report an interval that is too narrow. A log
with several epochs is refused unless ``epoch`` picks one of them (one for both logs, or one per side: two
runs need not number their epochs alike).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from flyspec.checks import is_int
from flyspec.gate.data.store import RunRecord
from flyspec.gate.logs.evallogs import EvalLog, read_eval_log
from flyspec.gate.logs.pairing import pair_logs
from flyspec.gate.report.comparisons import compare_pairs
from flyspec.gate.report.model import Comparison
from flyspec.gate.report.render import compare_advice, explanation
from flyspec.gate.report.report import Report
from flyspec.gate.stats.decide import check_margin_alpha

KIND = "compare"


def _epochs(log: EvalLog) -> list[int]:
    return sorted({s.epoch for s in log.samples})


def _one_epoch(log: EvalLog, side: str, epoch: int | None) -> EvalLog:
    """The log's samples of one epoch: the chosen one, or the only one there is."""
    epochs = _epochs(log)
    if epoch is None:
        if len(epochs) > 1:
            raise ValueError(
                f"{side} {log.source}: holds {len(epochs)} epochs per question "
                f"({', '.join(map(str, epochs))}); "
                "the paired tests need independent pairs and several epochs of one question are not, so "
                f"choose one with --epoch N (both logs) or --epoch {side}=N"
            )
        return log
    if epoch not in epochs:
        raise ValueError(
            f"--epoch {epoch}: {side} {log.source} has no epoch {epoch} "
            f"(epochs: {', '.join(map(str, epochs))})"
        )
    return replace(log, samples=[s for s in log.samples if s.epoch == epoch])


def side_epochs(epoch: int | Mapping[str, int] | None) -> dict[str, int | None]:
    """The epoch of each side: one number for both, or ``{"baseline": N, "candidate": M}`` (either may be
    left out); ValueError for anything else."""
    if epoch is None or isinstance(epoch, int):
        chosen: dict[str, Any] = {"baseline": epoch, "candidate": epoch}
    elif isinstance(epoch, Mapping):
        unknown = sorted(set(epoch) - {"baseline", "candidate"})
        if unknown:
            raise ValueError(
                f"epoch: unknown side(s) {', '.join(map(str, unknown))}; give baseline or candidate"
            )
        chosen = {side: epoch.get(side) for side in ("baseline", "candidate")}
    else:
        raise ValueError(f"epoch={epoch!r}: give an integer, or one per side")
    for side, value in chosen.items():
        if value is not None and not is_int(value, 0):
            raise ValueError(f"epoch={value!r} ({side}): must be an integer >= 0")
    return chosen


def _source(log: EvalLog, side: str) -> dict[str, Any]:
    return {
        "side": side,
        "source": log.source,
        "kind": log.kind,
        "metric": log.metric,
        "filter": log.filter,
        "samples": len(log.samples),
    }


def compare_logs(
    baseline: str,
    candidate: str,
    margin: float,
    alpha: float = 0.025,
    *,
    metric: str | None = None,
    filter: str | Sequence[str] | None = None,
    epoch: int | Mapping[str, int] | None = None,
) -> Report:
    """Pair two per-sample logs and decide at ``margin`` (declared now, after the data).

    ``baseline``/``candidate``: an lm-eval samples file or folder, an Inspect log file or folder, or
    ``STORE.db:RUN:ARM``. ``metric``: lm-eval's metric field or Inspect's scorer; ``filter``: lm-eval's
    filter, ``NAME`` for every task or ``TASK=NAME`` for one (a list of them); ``epoch``: the epoch to
    compare when a log holds several, one for both sides or ``{"baseline": N, "candidate": M}``.
    ValueError naming the problem for anything that cannot be paired.
    """
    check_margin_alpha(margin, alpha)
    epochs = side_epochs(epoch)
    sources = {"baseline": baseline, "candidate": candidate}
    logs = {
        side: _one_epoch(read_eval_log(spec, metric, filter), side, epochs[side])
        for side, spec in sources.items()
    }
    # One epoch per side by now; pair them even when the two runs number them differently.
    (base_epoch,), (cand_epoch,) = _epochs(logs["baseline"]), _epochs(logs["candidate"])
    if base_epoch != cand_epoch:
        relabelled = [replace(s, epoch=base_epoch) for s in logs["candidate"].samples]
        logs["candidate"] = replace(logs["candidate"], samples=relabelled)
    paired = pair_logs(logs["baseline"], logs["candidate"])
    rows = []
    everything: list[tuple[bool, bool]] = []
    for task in paired.tasks:
        pairs = [(bool(b), bool(c)) for b, c in zip(task.baseline, task.candidate, strict=True)]
        everything += pairs
        rows.append(compare_pairs(task.task, pairs, len(pairs), margin, alpha))
    rows.append(compare_pairs("pooled", everything, len(everything), margin, alpha))
    registration = {
        "margin": float(margin),
        "alpha": float(alpha),
        "declared": "after the data",
        "pre_registered": False,
        "epoch": epochs["baseline"] if epochs["baseline"] == epochs["candidate"] else None,
        "epochs": epochs,
        "sources": {side: _source(log, side) for side, log in logs.items()},
        "tasks": {task.task: len(task.keys) for task in paired.tasks},
    }
    return _report(registration, rows, margin, alpha)


def _report(registration: dict[str, Any], rows: list[Comparison], margin: float, alpha: float) -> Report:
    """The report of a comparison, its margin declared after the data (said loudly, and in the advice)."""
    run = RunRecord(KIND, KIND, time.time(), float(margin), float(alpha), 0, registration, {})
    report = Report(
        store="",
        run=run,
        margin=float(margin),
        margin_overridden=False,
        alpha=float(alpha),
        level=1 - 2 * float(alpha),
        comparisons=rows,
    )
    report.warnings.append(
        f"MARGIN {100 * margin:g} POINTS AND ALPHA {alpha:g} WERE DECLARED NOW, AFTER THE DATA: this is not "
        "a pre-registered run. Both logs existed before the margin was chosen, and a margin chosen after "
        "seeing the results can be chosen to give any answer; the decision is only as good as the reason "
        "for this margin. To decide with a margin fixed in advance, use `flyspec gate run`."
    )
    report.explanation = explanation(report)
    report.advice = compare_advice(report)
    return report
