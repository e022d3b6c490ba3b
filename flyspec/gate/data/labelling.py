"""Gold labels from a person (``flyspec gate label``): the pairs a judged run drew for a label, in the run's
registered order, each shown blind.

A judged run decides on the judge's verdicts anchored on gold labels for a random subset of its pairs
(docs/gate.md, "Open-ended answers: the judge"). Where no exact grader exists, the labels are a person's:
this module lists the drawn pairs still waiting (both answers stored and different, no label yet), shows
each pair's two answers in an order drawn from the run's seed (so neither the position nor the arm's name
can sway the label), and stores the label the moment it is given, as it was given (which answer was shown
first, the key pressed), so an interrupted session resumes where it stopped. The earliest waiting pair in
the order comes first: the decision's prefix stops there.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime

from flyspec.gate.data.spec import Gold
from flyspec.gate.data.store import GateStore, LabelRecord, RegisteredQuestion, RunRecord
from flyspec.gate.grading.judge import pair_hash

Lane = tuple[str, int]
FIRST: Lane = ("baseline", 0)
SECOND: Lane = ("candidate", 0)
CHOICES = {"a": "A", "b": "B", "t": "tie"}


@dataclass(frozen=True)
class PendingPair:
    """A drawn pair waiting for its label: the question, its request and reference, and the two answers
    in the order they are shown (``a_is_candidate``: the candidate's answer is shown as A)."""

    position: int
    question: RegisteredQuestion
    request: str
    reference: str
    answer_a: str
    answer_b: str
    a_is_candidate: bool
    pair_sha256: str

    def value(self, choice: str) -> int:
        """The label of a choice (``A``, ``B`` or ``tie``): +1 when the candidate's answer is better, -1 when
        the baseline's is, 0 when they are equally good."""
        if choice == "tie":
            return 0
        candidate_chosen = (choice == "A") == self.a_is_candidate
        return 1 if candidate_chosen else -1


def _shown_first(seed: int, dataset: str, question_id: str) -> bool:
    """Whether the candidate's answer is shown as A: a coin from the run's seed and the question."""
    digest = hashlib.sha256(f"{seed}:{dataset}:{question_id}:label-order".encode()).digest()
    return digest[0] % 2 == 1


def gold_rule(store: GateStore, run_id: str | None) -> tuple[RunRecord, Gold]:
    """The run to label and its gold rule; ValueError when it has none a person gives."""
    runs = store.runs()
    run = (
        store.get_run(run_id)
        if run_id is not None
        else next((r for r in reversed(runs) if r.registered.gold is not None), None)
    )
    if run is None:
        names = ", ".join(r.run_id for r in runs) or "none"
        what = f"run {run_id!r} is not in {store.path}" if run_id else f"{store.path} holds no judged run"
        raise ValueError(f"{what} (runs: {names})")
    gold = run.registered.gold
    if gold is None:
        raise ValueError(
            f"run {run.run_id!r} is not a judged run with gold labels (it needs questions with grader "
            "'judge' and a --judge), so it has nothing to label"
        )
    if gold.source != "human":
        raise ValueError(
            f"run {run.run_id!r} takes its gold labels from each question's exact grader, which labelled the "
            "drawn pairs as they were answered: there is nothing for a person to label"
        )
    return run, gold


def request_texts(run: RunRecord) -> dict[str, str]:
    """Each registered question's request as text, by prompt hash, from the datasets the run read (a
    dataset that can no longer be read is left out: its requests show as missing, the labels do not
    depend on them)."""
    # Imported here: reading datasets pulls in the graders, which only a labelling session needs.
    from flyspec.gate.data.datasets import load_dataset

    out: dict[str, str] = {}
    for spec in run.notes.get("dataset_sources", {}).values():
        try:
            questions = load_dataset(spec, shuffle_seed=run.registered.shuffle_seed or 0)
        except (ValueError, OSError):
            continue
        for q in questions:
            text = (
                q.prompt
                if q.prompt is not None
                else "\n".join(f"[{m['role']}] {m['content']}" for m in q.messages or [])
            )
            out[q.prompt_hash] = text
    return out


def drawn(
    store: GateStore, run: RunRecord, gold: Gold, requests: dict[str, str]
) -> list[tuple[PendingPair, LabelRecord | None]]:
    """Every drawn pair of ``run`` with two different answers, in registered order, each with its gold
    label when it has one for these two answers (None: it waits). ``requests`` maps a question's prompt
    hash to the request text shown (the caller reads the datasets)."""
    answers = {(a.arm, a.repeat, a.dataset, a.question_id): a.output for a in store.answers(run.run_id)}
    labels = store.labels(run.run_id)
    out = []
    for q in store.questions(run.run_id):
        key = (q.dataset, q.question_id)
        base, cand = answers.get((*FIRST, *key)), answers.get((*SECOND, *key))
        if (
            base is None
            or cand is None
            or base == cand
            or not gold.judged(q.grader)
            or not gold.selected(*key)
        ):
            continue
        digest = pair_hash(base, cand)
        known = labels.get(key)
        flip = _shown_first(gold.seed, *key)
        a, b = (cand, base) if flip else (base, cand)
        request = requests.get(q.prompt_hash, "(the request is not in the datasets given)")
        pair = PendingPair(q.position, q, request, q.answer, a, b, flip, digest)
        out.append((pair, known if known is not None and known.pair_sha256 == digest else None))
    return out


def pending(store: GateStore, run: RunRecord, gold: Gold, requests: dict[str, str]) -> list[PendingPair]:
    """The drawn pairs of ``run`` still waiting for a label, in registered order."""
    return [pair for pair, label in drawn(store, run, gold, requests) if label is None]


def _label(pair: PendingPair, key: str, labeller: str | None) -> LabelRecord:
    if key not in CHOICES:
        raise ValueError(f"label {key!r}: a (A is better), b (B is better) or t (equally good)")
    detail: dict[str, object] = {"key": key, "shown_as_a": "candidate" if pair.a_is_candidate else "baseline"}
    if labeller is not None:
        detail["labeller"] = labeller
        detail["labelled_at"] = datetime.now(UTC).isoformat(timespec="seconds")
    q = pair.question
    return LabelRecord(q.dataset, q.question_id, pair.pair_sha256, pair.value(CHOICES[key]), "human", detail)


def record(
    store: GateStore, run: RunRecord, pair: PendingPair, key: str, labeller: str | None = None
) -> LabelRecord | None:
    """Store a person's label for ``pair`` (``key``: ``a``, ``b`` or ``t``), exactly as given, with the
    labeller's name and the time when given; None (nothing stored) when the pair was labelled meanwhile."""
    label = _label(pair, key, labeller)
    return label if store.add_label(run.run_id, label) else None


def record_second(store: GateStore, run: RunRecord, pair: PendingPair, key: str, labeller: str) -> bool:
    """Store a second person's label of a labelled ``pair`` (agreement between labellers, never part of the
    decision); False when ``labeller`` already gave one."""
    return store.add_second_label(run.run_id, labeller, _label(pair, key, labeller))
