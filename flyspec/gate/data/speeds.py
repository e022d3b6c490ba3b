"""Each lane's speed in a run, from its stored answers (counters, latencies) and the executors' recorded
busy time: output tokens/s, tokens/s per request, acceptance length and rate, the forgiven share (what a
report shows, and what orders a tune's settings by speed)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from flyspec.gate.data.store import AnswerRecord, GateStore


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
        if "+" in arm:
            row = shared[arm]
            row[0] += answered
            row[1] += batch_tokens
            row[2] += wall_s
            continue
        wall[(arm, repeat)] += wall_s
        tokens[(arm, repeat)] += batch_tokens
    grouped: dict[tuple[str, int], list[AnswerRecord]] = defaultdict(list)
    for a in answers:
        grouped[(a.arm, a.repeat)].append(a)
    speeds = [_arm_speed(arm, repeat, rows, wall, tokens) for (arm, repeat), rows in sorted(grouped.items())]
    throughput = [
        SharedThroughput(label, int(n), int(t), w, t / w if w > 0 else None)
        for label, (n, t, w) in shared.items()
    ]
    return speeds, throughput


def _arm_speed(
    arm: str,
    repeat: int,
    rows: list[AnswerRecord],
    wall: dict[tuple[str, int], float],
    tokens: dict[tuple[str, int], int],
) -> ArmSpeed:
    counted = [r for r in rows if r.num_drafts is not None]
    num_drafts = sum(r.num_drafts or 0 for r in counted)
    draft_tokens = sum(r.num_draft_tokens or 0 for r in counted)
    accepted = sum(r.num_accepted_tokens or 0 for r in counted)
    forgiven_rows = [r for r in counted if r.num_forgiven_tokens is not None]
    forgiven = sum(r.num_forgiven_tokens or 0 for r in forgiven_rows)
    w = wall.get((arm, repeat), 0.0)
    latency = sum(r.latency_s for r in rows)
    generated = sum(r.completion_tokens for r in rows)
    forgiven_ok = bool(counted) and len(forgiven_rows) == len(counted)
    return ArmSpeed(
        arm=arm,
        repeat=repeat,
        answers=len(rows),
        completion_tokens=generated,
        wall_s=w,
        tokens_per_s=tokens[(arm, repeat)] / w if w > 0 else None,
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
