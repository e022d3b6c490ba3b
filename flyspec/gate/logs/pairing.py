"""Pairing two evaluation logs question by question for the paired tests of ``gate compare``.

Both logs must hold exactly the same questions: the same ``(task, question id, epoch)`` keys, and, where
both logs carry a hash of the same kind (lm-eval's doc/prompt/target hashes, Inspect's input/target,
the gate store's prompt hash), the same hash. Anything else is refused with a message naming the first
few mismatching questions each way and how many there are, because pairing different questions would
make the lost/gained counts meaningless.

Every epoch of a question is one pair here. The paired tests treat pairs as independent, which several
epochs of the same question are not, so ``gate compare`` (flyspec/gate/logs/compare.py) refuses logs with
several epochs unless one epoch is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

from flyspec.gate.logs.evallogs import EvalLog, SampleScore

_SHOWN = 5


@dataclass(frozen=True)
class PairedTask:
    """One task's pairs in a fixed order (by question id, then epoch): 0/1 per side, same length."""

    task: str
    keys: list[tuple[str, int]]
    baseline: list[int]
    candidate: list[int]


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
