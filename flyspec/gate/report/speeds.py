"""Each lane's speed in a run, from its stored answers (counters, latencies) and the executors' recorded
busy time: output tokens/s, tokens/s per request, acceptance length and rate, the forgiven share."""

from __future__ import annotations

from collections import defaultdict

from flyspec.gate.data.store import AnswerRecord
from flyspec.gate.report.model import ArmSpeed, SharedThroughput


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
