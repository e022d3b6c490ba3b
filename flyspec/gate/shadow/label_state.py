"""What the labelling page shows and stores (label_page.py serves it): the gold-label queue of a judged run,
the same one `flyspec gate label` works on (flyspec/gate/data/labelling.py), as JSON, with the progress a
labeller needs (labelled, waiting, and the decision as it stands with the report's advice on how many
labels would let the run decide, passed in by whoever serves the page) and the agreement between two
labellers of one pair.

A pair is shown blind: answers A and B in the order the run's seeded coin drew for it (the order
`gate label` shows), never which arm wrote which. The first label of a pair is its gold label; a second
person may then label it again, stored beside it and counted as agreement, never part of the decision.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyspec.gate.data.labelling import PendingPair, drawn, gold_rule, record, record_second, request_texts
from flyspec.gate.data.store import GateStore, LabelRecord, RunRecord

KEYS = {"a": "a", "b": "b", "e": "t"}
"""The page's keys and the label each stores: A better, B better, E equally good (``t`` in the store)."""


class LabelRefused(ValueError):
    """A label the queue does not take (the page answers it 409 with this message)."""


@dataclass(frozen=True)
class Queue:
    """One look at a run's drawn pairs: each with its gold label (None: it waits) and the second labels."""

    run: RunRecord
    pairs: list[tuple[PendingPair, LabelRecord | None]]
    seconds: list[LabelRecord]

    def find(self, dataset: str, question_id: str) -> tuple[PendingPair, LabelRecord | None] | None:
        """The drawn pair of a question, with its gold label; None when it was not drawn or has no pair."""
        return next(
            (
                p
                for p in self.pairs
                if (p[0].question.dataset, p[0].question.question_id) == (dataset, question_id)
            ),
            None,
        )

    def second_by(self, labeller: str) -> set[tuple[str, str]]:
        return {(s.dataset, s.question_id) for s in self.seconds if s.detail.get("labeller") == labeller}


def open_queue(
    store: GateStore, run_id: str | None, requests: Callable[[RunRecord], dict[str, str]] = request_texts
) -> Queue:
    """The queue of ``run_id`` (the latest judged run when None) in ``store``; ``requests`` gives a run's
    request texts by prompt hash (default: read from the run's datasets, as `gate label` does)."""
    run, gold = gold_rule(store, run_id)
    return Queue(run, drawn(store, run, gold, requests(run)), store.second_labels(run.run_id))


def _pair_json(pair: PendingPair, mode: str) -> dict[str, Any]:
    q = pair.question
    return {
        "dataset": q.dataset,
        "question_id": q.question_id,
        "position": q.position,
        "request": pair.request,
        "reference": pair.reference,
        "a": pair.answer_a,
        "b": pair.answer_b,
        "mode": mode,
    }


def _agreement(queue: Queue) -> dict[str, int]:
    """Pairs labelled by two people, and on how many the second label matched the gold one."""
    gold = {(p.question.dataset, p.question.question_id): label for p, label in queue.pairs if label}
    twice = agreed = 0
    for second in queue.seconds:
        first = gold.get((second.dataset, second.question_id))
        if first is not None and first.pair_sha256 == second.pair_sha256:
            twice += 1
            agreed += first.value == second.value
    return {"twice": twice, "agreed": agreed}


Progress = Callable[[Path, str], dict[str, Any]]
"""The run's decision and label advice by store path and run name
(``flyspec.gate.report.build.label_progress``)."""


def progress(store_path: Path, queue: Queue, decision: Progress) -> dict[str, Any]:
    """Labelled and waiting pairs, the agreement between labellers, the run's decision as it stands and
    the report's label advice (``more_labels``: how many more labels would let the run decide; None when
    the advice needs a higher label rate than the run registered, which its draw cannot give: the advice's
    sentence says so)."""
    labelled = sum(label is not None for _, label in queue.pairs)
    reading = decision(store_path, queue.run.run_id)
    needed, rate = reading["labels_needed"], reading["advised_rate"]
    reachable = needed is not None and rate is not None and rate <= reading["gold_rate"]
    return {
        "run": queue.run.run_id,
        "labelled": labelled,
        "waiting": len(queue.pairs) - labelled,
        **reading,
        "more_labels": max(0, needed - labelled) if reachable else None,
        "labellers": _agreement(queue),
    }


def state(store_path: Path, queue: Queue, labeller: str, decision: Progress) -> dict[str, Any]:
    """The page's view: the pairs ``labeller`` may label (those waiting first, then pairs someone else
    labelled, for a second label) and the progress."""
    waiting = [_pair_json(p, "gold") for p, label in queue.pairs if label is None]
    done = queue.second_by(labeller)
    second = [
        _pair_json(p, "second")
        for p, label in queue.pairs
        if label is not None
        and label.detail.get("labeller") != labeller
        and (p.question.dataset, p.question.question_id) not in done
    ]
    return {"pairs": waiting + second, "progress": progress(store_path, queue, decision)}


def submit(store: GateStore, queue: Queue, body: dict[str, Any]) -> str:
    """Store one label from the page; returns ``gold`` or ``second`` (which kind was stored). LabelRefused
    when the pair does not wait for this label; ValueError for a malformed body."""
    dataset, question_id = str(body.get("dataset", "")), str(body.get("question_id", ""))
    key, labeller, second = body.get("key"), str(body.get("labeller", "")).strip(), bool(body.get("second"))
    if key not in KEYS:
        raise ValueError(f"key {key!r}: a (A is better), b (B is better) or e (equally good)")
    if not labeller or len(labeller) > 80:
        raise ValueError("labeller: give your name (1 to 80 characters); it is stored with each label")
    found = queue.find(dataset, question_id)
    if found is None:
        raise LabelRefused(
            f"pair {dataset}/{question_id} is not waiting for a label: the run did not draw it for a gold "
            "label, or its two answers are missing or identical"
        )
    pair, gold = found
    if gold is None and not second:
        if record(store, queue.run, pair, KEYS[key], labeller) is None:
            raise LabelRefused(
                f"pair {dataset}/{question_id} was labelled meanwhile; reload for the next pair"
            )
        return "gold"
    if gold is None:
        raise LabelRefused(
            f"pair {dataset}/{question_id} has no gold label yet: label it first, not a second time"
        )
    by = gold.detail.get("labeller", "someone in the terminal")
    if not second:
        raise LabelRefused(
            f"pair {dataset}/{question_id} is not waiting: {by} labelled it already (a label is never "
            "replaced); it is offered again as a second label"
        )
    if by == labeller or not record_second(store, queue.run, pair, KEYS[key], labeller):
        raise LabelRefused(f"pair {dataset}/{question_id}: {labeller} labelled it already")
    return "second"
