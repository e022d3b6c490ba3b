"""``gate compare``: a paired decision from two finished evaluations' per-sample logs, nothing re-run
(docs/gate.md, "Comparing existing logs").

The two logs (flyspec/gate/logs/evallogs.py) must hold exactly the same ``(task, question id, epoch)``
keys, with equal hashes where both carry one of a kind (``pair_logs``): pairing different questions would
make the lost/gained counts meaningless. They are decided with the rows of a fixed gate run
(``report.decisions.fixed_rows``), per task and pooled, with the margin declared after the data, which the
report says at its top. Several epochs of one question are not independent pairs, so a log with several is
refused unless ``epoch`` picks one (for both logs, or one per side).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from flyspec.checks import is_int
from flyspec.gate.data.store import RunRecord
from flyspec.gate.logs.evallogs import EvalLog, SampleScore, read_eval_log
from flyspec.gate.report.advice import compare_advice, explanation
from flyspec.gate.report.build import Report
from flyspec.gate.report.decisions import fixed_rows
from flyspec.gate.report.model import Comparison
from flyspec.gate.stats.decide import check_margin_alpha

KIND = "compare"

_SHOWN = 5


@dataclass(frozen=True)
class PairedTask:
    """One task's pairs in a fixed order (by question id, then epoch): 0/1 per side, same length."""

    task: str
    keys: list[tuple[str, int]]
    baseline: list[int]
    candidate: list[int]

    @property
    def pairs(self) -> list[tuple[bool, bool]]:
        """(baseline correct, candidate correct) per question, in order."""
        return [(bool(b), bool(c)) for b, c in zip(self.baseline, self.candidate, strict=True)]


@dataclass(frozen=True)
class PairedLogs:
    """Per-task pairs (tasks sorted by name) and all of them pooled in that order."""

    tasks: list[PairedTask]

    @property
    def pooled(self) -> tuple[list[int], list[int]]:
        """Every task's baseline and candidate scores, concatenated in task order."""
        return (
            [v for t in self.tasks for v in t.baseline],
            [v for t in self.tasks for v in t.candidate],
        )


def _order(key: tuple[str, str, int]) -> tuple[str, tuple[int, int | str], int]:
    task, qid, epoch = key
    # Numeric ids (lm-eval's doc_id) sort as numbers, so "10" comes after "9".
    return task, ((0, int(qid)) if qid.isdigit() else (1, qid)), epoch


def _index(log: EvalLog) -> dict[tuple[str, str, int], SampleScore]:
    index: dict[tuple[str, str, int], SampleScore] = {}
    for sample in log.samples:
        key = (sample.task, sample.question_id, sample.epoch)
        if key in index:
            raise ValueError(f"{log.source}: question {_name(key)} appears twice")
        index[key] = sample
    return index


def _name(key: tuple[str, str, int]) -> str:
    task, qid, epoch = key
    return f"{task}/{qid}" + (f"@{epoch}" if epoch else "")


def _listing(keys: set[tuple[str, str, int]]) -> str:
    ordered = sorted(keys, key=_order)
    shown = ", ".join(_name(k) for k in ordered[:_SHOWN])
    return f"{len(keys)} ({shown}{', ...' if len(keys) > _SHOWN else ''})"


def pair_logs(baseline: EvalLog, candidate: EvalLog) -> PairedLogs:
    """Pair the two logs' questions; ValueError naming the mismatches if they differ in any question."""
    base, cand = _index(baseline), _index(candidate)
    only_base, only_cand = set(base) - set(cand), set(cand) - set(base)
    if only_base or only_cand:
        base_tasks, cand_tasks = {k[0] for k in base}, {k[0] for k in cand}
        parts = [
            f"baseline {baseline.source} and candidate {candidate.source} do not hold the same questions"
        ]
        if base_tasks != cand_tasks:
            parts.append(
                f"tasks only in the baseline: {', '.join(sorted(base_tasks - cand_tasks)) or 'none'}; "
                f"only in the candidate: {', '.join(sorted(cand_tasks - base_tasks)) or 'none'}"
            )
        if only_base:
            parts.append(f"only in the baseline: {_listing(only_base)}")
        if only_cand:
            parts.append(f"only in the candidate: {_listing(only_cand)}")
        raise ValueError("; ".join(parts))
    differing: dict[str, set[tuple[str, str, int]]] = {}
    for key, sample in base.items():
        other = cand[key].hashes
        for kind, digest in sample.hashes.items():
            if kind in other and other[kind] != digest:
                differing.setdefault(kind, set()).add(key)
    if differing:
        detail = "; ".join(
            f"{kind} hash differs for {_listing(keys)}" for kind, keys in sorted(differing.items())
        )
        raise ValueError(
            f"baseline {baseline.source} and candidate {candidate.source} have the same question ids but "
            f"not the same questions: {detail}"
        )
    tasks: dict[str, PairedTask] = {}
    for key in sorted(base, key=_order):
        task, qid, epoch = key
        paired = tasks.setdefault(task, PairedTask(task, [], [], []))
        paired.keys.append((qid, epoch))
        paired.baseline.append(int(base[key].correct))
        paired.candidate.append(int(cand[key].correct))
    return PairedLogs([tasks[t] for t in sorted(tasks)])


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
        chosen: dict[str, int | None] = {"baseline": epoch, "candidate": epoch}
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


def _source(log: EvalLog, side: str) -> dict[str, object]:
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
    rows = fixed_rows({task.task: (len(task.keys), task.pairs) for task in paired.tasks}, margin, alpha)
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


def _report(registration: dict[str, object], rows: list[Comparison], margin: float, alpha: float) -> Report:
    """The report of a comparison, its margin declared after the data (said loudly, and in the advice)."""
    run = RunRecord(KIND, KIND, time.time(), registration, {})
    report = Report(
        store="",
        run=run,
        registered=run.registered,
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
