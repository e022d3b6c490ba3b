"""What `flyspec demo` prints when it ends: a first screen of at most FIRST_SCREEN_LINES lines (the control's
verdict, FLy's verdict with its interval and pairs, FLy's speed against standard speculative decoding, the
forecast and the command that continues), then the gate's report, then the plain words for a newcomer (the
design is flyspec/demo/design.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flyspec.gate import Report, build_report
from flyspec.gate.data.store import GateStore
from flyspec.gate.report.advice import control_sentence
from flyspec.gate.report.decisions import answering_minutes
from flyspec.gate.stats.sizing import Design, forecast_from_rate

FIRST_SCREEN_LINES = 12
CONTINUE = "flyspec demo --until-decided"


def decided(store: Path, run_id: str) -> bool:
    """True when the run exists and every comparison of it has stopped for good (nothing to load)."""
    if not store.is_file():
        return False
    with GateStore(store) as opened:
        if opened.get_run(run_id) is None:
            return False
    report = build_report(store, run_id)
    return all(r.sequential is not None and r.sequential.final for r in (report, *report.family))


def _pts(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}"


def _control_line(control: Report) -> str:
    pooled, stop = control.pooled, control.sequential
    if pooled is None or pooled.decision is None or stop is None:
        return "Control (the draft model alone): no question answered by both arms yet."
    minutes = control.decided_after_minutes
    when = f" ({minutes:.0f} min of answering)" if minutes is not None else ""
    caught = {"FAIL": "caught: it loses more than the margin", "PASS": "NOT caught (check the control)"}
    verdict = caught.get(stop.decision, "not decided yet")
    return (
        f"Control (the draft model alone): {stop.decision} after {stop.stopped_at} questions{when}, "
        f"{verdict}; interval [{_pts(pooled.ci_low)}, {_pts(pooled.ci_high)}] points."
    )


def _fly_line(report: Report, setting: str) -> str:
    stop, m = report.sequential, f"{100 * report.registered_margin:g}"
    if stop is None:
        return f"FLy ({setting}): no pair answered yet."
    meaning = {
        "PASS": f"within the {m}-point margin of lossless decoding",
        "FAIL": f"loses more than the {m}-point margin",
    }.get(stop.decision, f"not decided at the {m}-point margin yet")
    return (
        f"FLy ({setting}): {stop.decision} after {stop.stopped_at} pairs in order, {meaning}; FLy minus "
        f"lossless in [{_pts(stop.low)}, {_pts(stop.high)}] points."
    )


def speed_line(report: Report) -> str | None:
    """FLy's tokens per second per request against standard speculative decoding's, in the same batches."""
    speeds = {s.arm: s for s in report.speeds}
    base, fly = speeds.get("baseline"), speeds.get("candidate")
    if not (base and fly and base.request_tokens_per_s and fly.request_tokens_per_s):
        return None
    fly_s, base_s = fly.request_tokens_per_s, base.request_tokens_per_s
    return (
        f"Speed: a FLy request ran {fly_s / base_s:.2f}x as fast as a standard speculative decoding request "
        f"in the same batches ({fly_s:.1f} against {base_s:.1f} output tokens/s)."
    )


UNLIMITED = 100_000
"""The question limit of the design simulated once the pool is used up (what more questions would give)."""


def forecast_line(report: Report, gpu_tokens_per_s: float, tokens_per_answer: int) -> str | None:
    """Until FLy is decided: how many more questions its decision needs (the registered design simulated at
    the flip rate seen, among runs not decided yet; without the pool's limit once the pool is used up), in
    hours at this run's pace (its pairs over its answering minutes) and in minutes on a GPU endpoint."""
    stop, plan = report.sequential, report.sequential_plan
    if stop is None or plan is None or stop.decision in ("PASS", "FAIL") or stop.stopped_at < 1:
        return None
    n = stop.stopped_at
    flips = max(stop.lost + stop.gained, 0.5) / n
    used_up = stop.final
    design = (
        Design("sequential", UNLIMITED)
        if used_up
        else Design("sequential", plan.max_questions, plan.sequence_population)
    )
    outlook = forecast_from_rate(flips, design, margin=plan.margin, alpha=plan.alpha, pairs=n)
    seen = f"at the flip rate seen ({100 * flips:.0f}%)"
    if outlook.median_pairs is None:
        return f"Forecast: {seen}, most simulated runs do not decide within {design.questions:,} questions."
    more = max(outlook.median_pairs - n, 1)
    with GateStore(Path(report.store)) as store:
        minutes = answering_minutes(store, report.run.run_id)
    here = f"{more / (n / minutes) / 60:.1f} hours here" if minutes > 0 else "unknown time here"
    gpu = more / (gpu_tokens_per_s * 60 / (2 * tokens_per_answer))
    beyond = (
        f", beyond the pool's {plan.max_questions:,} (more questions: your own traffic)" if used_up else ""
    )
    return (
        f"Forecast: {seen}, FLy's decision needs about {more:,} more questions (simulated median{beyond}): "
        f"{here}; about {gpu:.0f} minutes against a GPU endpoint serving FLy (`flyspec gate run --candidate "
        f"URL`, at an assumed {gpu_tokens_per_s:,.0f} output tokens/s, not measured here)."
    )


def first_screen(report: Report, setting: str, gpu_tokens_per_s: float, tokens_per_answer: int) -> list[str]:
    """The report's opening, at most FIRST_SCREEN_LINES lines: each verdict, the speed, the forecast and
    the command that continues."""
    stop = report.sequential
    lines = [
        "flyspec demo: the result",
        *(_control_line(control) for control in report.family),
        _fly_line(report, setting),
        speed_line(report),
        forecast_line(report, gpu_tokens_per_s, tokens_per_answer),
        f"Continue: `{CONTINUE}` (rerun; it resumes from the store)." if stop and not stop.final else None,
    ]
    return [line for line in lines if line is not None][:FIRST_SCREEN_LINES]


def _engine_lines(notes: dict[str, Any]) -> list[str]:
    lines = []
    weights = next((ex.get("weights") for ex in notes.get("executors", []) if ex.get("weights")), None)
    if weights:
        formats = ", ".join(f"{role} {weights[role]}" for role in ("target", "draft") if role in weights)
        lines.append(f"Weights: {formats} (the fastest this CPU runs, measured when the models loaded).")
    cache = notes.get("prefix_cache")
    if cache and cache["queries"]:
        lines.append(
            f"Prefix sharing: every arm sends every question's prompt, so {cache['hits']:,} of the "
            f"{cache['queries']:,} prompt tokens ({100 * cache['hits'] / cache['queries']:.0f}%) reused the "
            "KV blocks another arm's prompt had filled: their prefill was saved."
        )
    return lines


def _interval_lines(report: Report) -> list[str]:
    if report.sequential is None:
        return []
    m = f"{100 * report.registered_margin:g}"
    return [
        "The interval is the range of accuracy differences (FLy minus the lossless baseline) that the "
        f"answers so far leave plausible, at {100 * report.level:g}% confidence. It is a confidence "
        "sequence: it stays valid at every number of questions, which is why the demo may stop as soon as "
        f"it clears the margin. The margin says FLy may lose at most {m} points of accuracy and still "
        f"count as good enough: PASS needs the whole interval above -{m}, FAIL the whole interval below "
        f"-{m}. " + report.claim,
    ]


def explain(report: Report, pool: str = "the test") -> str:
    """The newcomer's words under the report. ``pool``: the question sets, in words."""
    acceptance = {s.arm: s for s in report.speeds}.get("candidate")
    lines = [
        "",
        "What this means",
        "---------------",
        f"Three arms answered the same {pool} questions, drawn in a seeded random order, with the same "
        "prompts and greedy decoding, in one engine, the three answers of a question side by side: the "
        "lossless baseline (standard speculative decoding: the target model's own answers), the draft "
        "model alone (every draft token accepted: the limit of lossy verification, a control the gate "
        "must catch) and FLy, which forgives some rejected draft tokens to go faster.",
        *(control_sentence(control) for control in report.family),
        f"FLy: {report.decision}. " + " ".join(report.explanation),
        *_interval_lines(report),
        *_engine_lines(report.run.notes),
    ]
    if acceptance is not None and acceptance.mean_acceptance_length is not None:
        lines.append(
            f"FLy's mean acceptance length was {acceptance.mean_acceptance_length:.2f} tokens per target "
            f"forward pass, {100 * (acceptance.forgiven_share or 0):.1f}% of its kept draft tokens forgiven."
        )
    return "\n".join(lines)
