"""What a stored run's rows come to, for the statistics, the reports and a person: a judged run's pairs
(built the same way while it answers, so a report recomputes exactly the pairs the run monitored), the
drawn pairs a person labels (``flyspec gate label``), a tune setting's test, and each lane's speed."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from flyspec.gate.data.questions import QuestionKey
from flyspec.gate.data.spec import BASELINE, Gold, Lane, Registration
from flyspec.gate.data.store import (
    AnswerRecord,
    GateStore,
    LabelRecord,
    RegisteredQuestion,
    RunEvent,
    RunRecord,
)
from flyspec.gate.grading.graders import lane_label, pair_hash, preferred
from flyspec.gate.stats.decide import Evidence, Rule
from flyspec.gate.stats.judged import JudgedPair, judge_prediction, usable_prefix
from flyspec.gate.stats.monitor import in_order_diffs, in_order_judged, paired_diffs

Correct = dict[tuple[str, int, str, str], bool]
"""Each stored answer's grade by (arm, repeat, dataset, question id)."""

CANDIDATE: Lane = ("candidate", 0)
VOTES = {"second": 1, "first": -1}
"""A judge order's vote: +1 when it prefers the candidate (the second lane), -1 the baseline, else 0."""
CHOICES = {"a": "A", "b": "B", "t": "tie"}

# ------------------------------------------------------------------------------ a judged run's pairs
# A label counts only for the two outputs it was given for (its ``pair_sha256``), and only a pair drawn by
# the registered rule carries one.


def make_pair(
    gold: Gold,
    dataset: str,
    question_id: str,
    first_output: str,
    second_output: str,
    preferences: Mapping[str, str | None],
    label: LabelRecord | None,
) -> JudgedPair:
    """One judged pair from the two outputs, the judge's preference in each order (``AB``, ``BA``) and the
    gold label stored for the question."""
    if first_output == second_output:
        return JudgedPair(identical=True)
    f = judge_prediction(VOTES.get(preferences["AB"] or "", 0), VOTES.get(preferences["BA"] or "", 0))
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
        out[key] = make_pair(gold, *key, a.output, b.output, prefs, stored_labels.get(key))
    return out


# ------------------------------------------------------------------------ gold labels from a person
# Where no exact grader exists, the drawn pairs' labels are a person's: each pair is shown blind, its two
# answers in an order drawn from the run's seed (neither the position nor the arm's name can sway the
# label), and stored the moment it is given, as given, so an interrupted session resumes where it stopped.
# The earliest waiting pair in the registered order comes first: the decision's prefix stops there.


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
        return 1 if (choice == "A") == self.a_is_candidate else -1


def gold_rule(store: GateStore, run_id: str | None) -> tuple[RunRecord, Gold]:
    """The run to label (the latest judged one when ``run_id`` is None) and its gold rule; ValueError when
    it has none a person gives."""
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
    from flyspec.gate.data.questions import load_dataset

    out: dict[str, str] = {}
    for spec in run.notes.get("dataset_sources", {}).values():
        try:
            questions = load_dataset(spec, shuffle_seed=run.registered.shuffle_seed or 0)
        except (ValueError, OSError):
            continue
        for q in questions:
            chat = "\n".join(f"[{m['role']}] {m['content']}" for m in q.messages or [])
            out[q.prompt_hash] = q.prompt if q.prompt is not None else chat
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
        base, cand = answers.get((*BASELINE, *key)), answers.get((*CANDIDATE, *key))
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
        # The candidate's answer is shown as A on a coin from the run's seed and the question.
        coin = hashlib.sha256(f"{gold.seed}:{q.dataset}:{q.question_id}:label-order".encode()).digest()
        flip = coin[0] % 2 == 1
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


# ------------------------------------------------------------------------------- a tune setting's test


@dataclass(frozen=True)
class SettingStatus:
    """Where one setting's test of a ``gate tune`` stands: its decision, whether it is final (a rerun would
    not change it), why it stopped, and the pairs and interval it used."""

    setting_id: str
    decision: str
    final: bool
    reason: str
    n: int
    lost: int
    gained: int
    low: float | None
    high: float | None
    loss_detected: bool


def grades(answers: Iterable[AnswerRecord]) -> Correct:
    """Each answer's grade by (arm, repeat, dataset, question id)."""
    return {(a.arm, a.repeat, a.dataset, a.question_id): a.correct for a in answers}


def setting_status(store: GateStore, run: RunRecord, setting_id: str) -> SettingStatus:
    """One setting's test, decided by its registered rule on the stored answers and its session events: a
    sequential test stops where its confidence sequence first crossed (or a pause was recorded); a fixed
    test is decided, on Tango's interval, once every test question has both answers."""
    correct = grades(store.answers(run.run_id))
    events = [e for e in store.events(run.run_id) if e.detail.get("setting") == setting_id]
    rule, data = evidence(store, run, run.registered, correct, (BASELINE, (setting_id, 0)), events)
    s = rule.decide(data)
    low, high = (s.low, s.high) if s.stopped_at else (None, None)
    return SettingStatus(
        setting_id, s.decision, s.final, s.reason, s.stopped_at, s.lost, s.gained, low, high, s.loss_detected
    )


def comparison_events(events: list[RunEvent], name: str) -> list[RunEvent]:
    """A run's session events with each stop placed where this comparison's sequence was (a run with
    several comparisons records every comparison's prefix in the stop's detail)."""
    out = []
    for e in events:
        reached = e.detail.get("stopped_at") if isinstance(e.detail, dict) else None
        if isinstance(reached, dict) and name in reached:
            e = replace(e, stopped_at=reached[name])
        out.append(e)
    return out


def evidence(
    store: GateStore,
    run: RunRecord,
    reg: Registration,
    correct: Correct,
    lanes: tuple[Lane, Lane] | None = None,
    events: list[RunEvent] | None = None,
) -> tuple[Rule, Evidence]:
    """The rule ``reg`` registered for one comparison (``lanes``: its registered pair, or a tune setting's
    against the baseline, with that setting's ``events``) and the stored pairs it decides on: a fixed run's
    every complete pair; a sequential run's along the registered order up to the first one missing, with
    the sessions' events; a judged run's judged pairs up to the first waiting for its gold label."""
    lanes = lanes or reg.lanes
    order = [(q.dataset, q.question_id) for q in store.questions(run.run_id)]
    if events is None:
        events = comparison_events(store.events(run.run_id), lanes[1][0])
    plan = reg.sequential
    if reg.gold is not None:
        seen = in_order_judged(order, stored_pairs(store, run, lanes, reg.gold))
        usable = usable_prefix(seen)
        if plan is not None:
            return plan.rule, Evidence(seen[:usable], events, awaiting=usable < len(seen))
        judged = Rule(reg.margin, reg.alpha, len(order), label_rate=reg.gold.rate, label_bet=reg.gold.bet)
        return judged, Evidence(seen[:usable])
    if plan is not None:
        return plan.rule, Evidence(in_order_diffs(order, correct, lanes), events)
    return Rule(reg.margin, reg.alpha, len(order)), Evidence(paired_diffs(order, correct, lanes))


# ------------------------------------------------------------------------------------- each lane's speed


@dataclass
class ArmSpeed:
    """Speed of one arm (one repeat) measured in this run.

    ``tokens_per_s``: the arm's tokens over its executor's busy time (None when the arm shared its engine
    with another arm: see ``Report.shared``). ``request_tokens_per_s``: tokens over the summed request
    latencies, comparable between arms that ran side by side in the same batches. Acceptance fields are
    None when the source did not report them (``acceptance_reported``), never zero.
    """

    arm: str
    repeat: int
    answers: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float | None
    request_tokens_per_s: float | None
    mean_latency_s: float | None
    mean_acceptance_length: float | None
    acceptance_rate: float | None
    forgiven_share: float | None
    acceptance_reported: bool = True
    forgiven_reported: bool = True


@dataclass
class SharedThroughput:
    """Tokens/s of an engine that answered several arms' requests in the same batches."""

    lanes: str
    answers: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float | None


def measure_speeds(
    answers: list[AnswerRecord], batches: list[tuple[str, int, int, int, float]]
) -> tuple[list[ArmSpeed], list[SharedThroughput]]:
    """Each lane's speed from its stored answers (counters, latencies) and recorded batches (busy time),
    and the throughput of engines that several lanes shared."""
    wall: dict[tuple[str, int], float] = defaultdict(float)
    tokens: dict[tuple[str, int], int] = defaultdict(int)
    shared: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for arm, repeat, answered, batch_tokens, wall_s in batches:
        if "+" in arm:  # an engine several lanes shared
            shared[arm] = [a + b for a, b in zip(shared[arm], (answered, batch_tokens, wall_s), strict=True)]
            continue
        wall[(arm, repeat)] += wall_s
        tokens[(arm, repeat)] += batch_tokens
    grouped: dict[tuple[str, int], list[AnswerRecord]] = defaultdict(list)
    for a in answers:
        grouped[(a.arm, a.repeat)].append(a)
    speeds = [
        _arm_speed(*lane, rows, wall.get(lane, 0.0), tokens[lane]) for lane, rows in sorted(grouped.items())
    ]
    throughput = [
        SharedThroughput(label, int(n), int(t), w, t / w if w > 0 else None)
        for label, (n, t, w) in shared.items()
    ]
    return speeds, throughput


def _arm_speed(arm: str, repeat: int, rows: list[AnswerRecord], w: float, batch_tokens: int) -> ArmSpeed:
    counted = [r for r in rows if r.num_drafts is not None]
    num_drafts = sum(r.num_drafts or 0 for r in counted)
    draft_tokens = sum(r.num_draft_tokens or 0 for r in counted)
    accepted = sum(r.num_accepted_tokens or 0 for r in counted)
    forgiven_rows = [r for r in counted if r.num_forgiven_tokens is not None]
    forgiven = sum(r.num_forgiven_tokens or 0 for r in forgiven_rows)
    latency = sum(r.latency_s for r in rows)
    generated = sum(r.completion_tokens for r in rows)
    forgiven_ok = bool(counted) and len(forgiven_rows) == len(counted)
    return ArmSpeed(
        arm=arm,
        repeat=repeat,
        answers=len(rows),
        completion_tokens=generated,
        wall_s=w,
        tokens_per_s=batch_tokens / w if w > 0 else None,
        request_tokens_per_s=generated / latency if latency > 0 else None,
        mean_latency_s=latency / len(rows),
        mean_acceptance_length=1 + accepted / num_drafts if num_drafts else None,
        acceptance_rate=accepted / draft_tokens if draft_tokens else None,
        forgiven_share=forgiven / accepted if accepted and forgiven_ok else None,
        acceptance_reported=bool(counted),
        forgiven_reported=forgiven_ok,
    )


def lane_speeds(
    store: GateStore, run_id: str, *, first_repeat_only: bool = True
) -> dict[str, dict[str, float | None]]:
    """Per arm of a run: tokens/s over its engine's busy time (per request for endpoint arms), mean
    acceptance length, forgiven share and answers, from the stored answers and batches."""
    speeds, _ = measure_speeds(store.answers(run_id), store.batches(run_id))
    return {
        s.arm: {
            "tokens_per_s": s.tokens_per_s if s.tokens_per_s is not None else s.request_tokens_per_s,
            "mean_acceptance_length": s.mean_acceptance_length,
            "forgiven_share": s.forgiven_share,
            "answers": s.answers,
        }
        for s in speeds
        if not first_repeat_only or s.repeat == 0
    }
