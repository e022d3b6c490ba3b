"""The words under `flyspec demo`'s report, for a newcomer: the control first, then FLy's decision, how fast
each arm was, what the interval means and what deciding about FLy takes (the design is
flyspec/gate/runs/main_job.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flyspec.gate.report.render import control_sentence
from flyspec.gate.report.report import Report, build_report

BASELINE_WORDS = {
    "standard": "standard speculative decoding",
    "target_only": "the target alone (no drafts)",
}


def decided(store: Path, run_id: str) -> bool:
    """True when the run exists and every comparison of it has stopped for good (nothing to load)."""
    from flyspec.gate.data.store import GateStore

    if not store.is_file():
        return False
    with GateStore(store) as opened:
        if opened.get_run(run_id) is None:
            return False
    report = build_report(store, run_id)
    return all(r.sequential is not None and r.sequential.final for r in (report, *report.family))


def _speed_lines(report: Report, baseline: str) -> list[str]:
    speeds = {s.arm: s for s in report.speeds}
    labels = {
        "baseline": f"Lossless baseline ({BASELINE_WORDS[baseline]})",
        "control": "Draft model alone (the control)",
        "candidate": "FLy",
    }
    lines = []
    for arm, label in labels.items():
        s = speeds.get(arm)
        if s is None or s.request_tokens_per_s is None:
            continue
        length = (
            f", {s.mean_acceptance_length:.2f} tokens per target forward pass (mean acceptance length), "
            f"{100 * (s.forgiven_share or 0):.1f}% of kept draft tokens forgiven"
            if s.mean_acceptance_length is not None and arm == "candidate"
            else ""
        )
        lines.append(f"{label}: {s.request_tokens_per_s:.1f} output tokens/s per request{length}.")
    base, cand = speeds.get("baseline"), speeds.get("candidate")
    if base and cand and base.request_tokens_per_s and cand.request_tokens_per_s:
        ratio = cand.request_tokens_per_s / base.request_tokens_per_s
        lines.append(
            f"In the same batches, a FLy request generated {ratio:.2f}x the tokens per second of a request "
            f"decoded by {BASELINE_WORDS[baseline]}."
        )
    return lines


def _interval_lines(report: Report) -> list[str]:
    pooled = report.pooled
    if pooled is None or pooled.ci_low is None or pooled.ci_high is None:
        return []
    m = f"{100 * report.run.margin:g}"
    return [
        "The interval is the range of accuracy differences (FLy minus the lossless baseline) that the "
        f"answers so far leave plausible, at {100 * report.level:g}% confidence. It is a confidence "
        "sequence: it stays valid at every number of questions, which is why the demo may stop as soon as "
        f"it clears the margin. The margin says FLy may lose at most {m} points of accuracy and still "
        f"count as good enough: PASS needs the whole interval above -{m}, FAIL the whole interval below "
        f"-{m}. " + report.claim,
    ]


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


def _what_it_takes(report: Report, choice: Any, gpu_tokens_per_s: float, tokens_per_answer: int) -> list[str]:
    stop = report.sequential
    if choice is None or stop is None or stop.final:
        return []
    two = choice.two_points
    gpu = gpu_tokens_per_s * 60 / (2 * tokens_per_answer)
    hold = "holds" if len(choice.datasets) == 1 else "hold"
    return [
        "Deciding about FLy: at no true loss the simulation expects a median of "
        f"{choice.outcome.median or '-'} questions at the {100 * choice.margin:g}-point margin, and "
        f"{two.median or '-'} at 2 points ({_datasets(choice.datasets)} {hold} {choice.pool:,}). "
        "`flyspec demo --until-decided` continues this run to its decision on this machine; a GPU "
        f"endpoint serving FLy at an assumed {gpu_tokens_per_s:,.0f} output tokens/s (not measured here) "
        f"would answer about {gpu:,.0f} questions a minute."
    ]


def _datasets(names: tuple[str, ...]) -> str:
    known = {"gsm8k": "GSM8K", "math500": "MATH-500"}
    return " and ".join(known.get(n, Path(n).stem) for n in names) or "the test sets"


def explain(
    report: Report,
    choice: Any = None,
    *,
    baseline: str = "standard",
    gpu_tokens_per_s: float = 3000.0,
    tokens_per_answer: int = 300,
) -> str:
    """The newcomer's summary under the report. ``choice``: the registered margin and pool with their
    simulated outlook (flyspec.gate.runs.main_job.MarginChoice); ``baseline``: how the lossless baseline
    decoded ("standard" or "target_only")."""
    stop = report.sequential
    pool = _datasets(choice.datasets) if choice is not None else "the test"
    lines = [
        "",
        "What this means",
        "---------------",
        f"Three arms answered the same {pool} questions, drawn in a seeded random order, with the same "
        "prompts and greedy decoding, in one engine: the lossless baseline "
        f"({BASELINE_WORDS[baseline]}: the target model's own answers), the draft model alone (every draft "
        "token accepted: the limit of lossy verification, a control the gate must catch), and FLy, which "
        "forgives some rejected draft tokens to go faster.",
        *(control_sentence(control) for control in report.family),
        f"FLy: {report.decision}. " + " ".join(report.explanation),
        *_speed_lines(report, baseline),
        *_engine_lines(report.run.notes),
        *_interval_lines(report),
        *_what_it_takes(report, choice, gpu_tokens_per_s, tokens_per_answer),
    ]
    if stop is not None and not stop.final:
        lines.append(
            f"To go on, run the same command again: it continues from question {stop.stopped_at + 1} and the "
            "interval stays valid however many more questions it takes (add --until-decided to run to a "
            "decision)."
        )
    return "\n".join(lines)
