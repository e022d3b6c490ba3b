"""`flyspec demo`: the main job on the embedded default (docs/gate.md, "flyspec demo"; the design is
flyspec/gate/runs/main_job.py).

Prepares the Qwen2.5-Coder pair of the model zoo, then runs the sequential quality gate (docs/gate.md) with
three arms in one engine: standard speculative decoding (lossless baseline), the draft model alone (a
control the gate must FAIL) and FLy (the candidate), on GSM8K and MATH-500 test questions in a seeded random
order. The control's pairs are answered first; once the gate has caught it, FLy's comparison goes on until
its own decision, the question pool's end, the time budget (30 minutes of answering by default) or, with
``--until-decided``, until it decides. Then it says in plain words what was decided, after how many
questions and minutes, how fast each arm was and what deciding about FLy takes here and on a GPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from flyspec.cli.options import parse_quantization

DEFAULT_MINUTES = 30.0
# The three arms share the engine, so 32 slots are about 11 questions in flight (docs/performance.md has
# the measurements behind the batch and the weight format).
DEFAULT_BATCH = 32
DEFAULT_QUANTIZATION = "auto"
_LABELS = {
    "baseline": "Standard speculative decoding (lossless baseline)",
    "control": "Draft model alone (the control)",
    "candidate": "FLy",
}


def _speed_lines(report: Any) -> list[str]:
    speeds = {s.arm: s for s in report.speeds}
    lines = []
    for arm, label in _LABELS.items():
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
            f"In the same batches, a FLy request generated {ratio:.2f}x the tokens per second of a "
            "standard speculative decoding request."
        )
    return lines


def _interval_lines(report: Any) -> list[str]:
    pooled = report.pooled
    if pooled is None or pooled.ci_low is None or pooled.ci_high is None:
        return []
    m = f"{100 * report.run.margin:g}"
    return [
        "The interval is the range of accuracy differences (FLy minus standard speculative decoding) that "
        f"the answers so far leave plausible, at {100 * report.level:g}% confidence. It is a confidence "
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


def _what_it_takes(report: Any, choice: Any) -> list[str]:
    from flyspec.gate.runs.main_job import GPU_TOKENS_PER_S, TOKENS_PER_ANSWER

    stop = report.sequential
    if choice is None or stop is None or stop.final:
        return []
    two = choice.two_points
    gpu = GPU_TOKENS_PER_S * 60 / (2 * TOKENS_PER_ANSWER)
    return [
        "Deciding about FLy: at no true loss the simulation expects a median of "
        f"{choice.outcome.median or '-'} questions at the {100 * choice.margin:g}-point margin, and "
        f"{two.median or '-'} at 2 points ({_datasets(report)} hold {choice.pool:,}). `flyspec demo "
        "--until-decided` continues this run to its decision on this machine; a GPU endpoint serving FLy at "
        f"an assumed {GPU_TOKENS_PER_S:,.0f} output tokens/s (not measured here) would answer about "
        f"{gpu:,.0f} questions a minute."
    ]


def _datasets(report: Any) -> str:
    known = {"gsm8k": "GSM8K", "math500": "MATH-500"}
    names = [known.get(n, n) for n in report.run.registration.get("datasets", {})]
    return " and ".join(names) or "test"


def explain(report: Any, choice: Any = None) -> str:
    """The newcomer's summary under the report: the control first, then FLy's decision, how fast each arm
    was, what the interval means and what deciding about FLy takes."""
    from flyspec.gate.report.render import control_sentence

    stop = report.sequential
    lines = [
        "",
        "What this means",
        "---------------",
        f"Three arms answered the same {_datasets(report)} questions, drawn in a seeded random order, "
        "with the same prompts and greedy decoding, in one engine: standard speculative decoding (lossless, "
        "the baseline), the draft model alone (every draft token accepted: the limit of lossy "
        "verification, a control the gate must catch), and FLy, which forgives some rejected draft tokens to "
        "go faster.",
        *(control_sentence(control) for control in report.family),
        f"FLy: {report.decision}. " + " ".join(report.explanation),
        *_speed_lines(report),
        *_engine_lines(report.run.notes),
        *_interval_lines(report),
        *_what_it_takes(report, choice),
    ]
    if stop is not None and not stop.final:
        lines.append(
            f"To go on, run the same command again: it continues from question {stop.stopped_at + 1} and the "
            "interval stays valid however many more questions it takes (add --until-decided to run to a "
            "decision)."
        )
    return "\n".join(lines)


MaxQuestions = Annotated[
    int | None,
    typer.Option(
        "--max-questions",
        "--questions",
        "-n",
        min=1,
        help="At most this many questions of the seeded order (default: all of GSM8K and MATH-500, 1,819).",
    ),
]
MaxMinutes = Annotated[
    float,
    typer.Option(
        help="Time budget for answering, after the models are ready; the run stops taking new questions "
        "early enough to end within it, and a rerun continues."
    ),
]
UntilDecided = Annotated[
    bool,
    typer.Option(
        "--until-decided",
        help="No time budget: run on until both comparisons decide or the questions run out (hours on a "
        "CPU; without a terminal, one progress line per 25 pairs). Survives a kill: rerun to continue.",
    ),
]
Datasets = Annotated[
    list[str] | None,
    typer.Option(
        "--dataset",
        help="Question sets (repeatable): gsm8k, math500 (the default, both), or a JSONL of your own "
        "(docs/gate.md, 'Gate your own traffic').",
    ),
]
Target = Annotated[str, typer.Option(help="Target model: zoo name, HF folder or .gguf file.")]
Draft = Annotated[str, typer.Option(help="Draft model (same vocabulary as the target).")]
K = Annotated[int, typer.Option("--k", min=2, help="Draft tokens per step (K).")]
Margin = Annotated[
    float | None,
    typer.Option(
        help="FLy's pre-registered non-inferiority margin (0.05 = 5 accuracy points). Default: the narrowest "
        "margin the question pool can decide, chosen by simulating the design before the first answer."
    ),
]
FlipRate = Annotated[
    float,
    typer.Option(
        help="The share of questions FLy is expected to flip, which sizes the default margin (earlier demo "
        "runs: 0.16)."
    ),
]
MaxTokens = Annotated[int, typer.Option(min=1, help="Answer length cap in tokens.")]
MaxNumSeqs = Annotated[
    int, typer.Option(min=3, help="Requests decoded together (the three arms' requests share them).")
]
Dtype = Annotated[str, typer.Option(help="float32 | bfloat16 | float16 | auto.")]
Quantization = Annotated[
    str,
    typer.Option(
        help="Weight quantization of every arm (the same for all, so the comparison stays fair): auto "
        "(the fastest format this CPU runs, measured at load; docs/performance.md), int8, int4 or none."
    ),
]
BatchInvariant = Annotated[
    bool,
    typer.Option(
        "--batch-invariant",
        help="Compute every token the same way whatever else is in the batch, so run-to-run noise flips no "
        "question (about 1.8x the CPU time; docs/performance.md).",
    ),
]
Seed = Annotated[int, typer.Option(min=0, help="Seed of the question order and the sampling.")]
Store = Annotated[
    Path, typer.Option(help="SQLite file holding every answer (an interrupted demo resumes from it).")
]
Html = Annotated[Path | None, typer.Option(help="Also write an HTML report with a plot.")]
NoProgress = Annotated[bool, typer.Option("--no-progress", help="No progress bar.")]
AsJson = Annotated[bool, typer.Option("--json", help="End with the report as one JSON line.")]


def _decided(store: Path, run_id: str) -> bool:
    """True when the run exists and every comparison of it has stopped for good (nothing to load)."""
    from flyspec.gate.data.store import GateStore
    from flyspec.gate.report.report import build_report

    if not store.is_file():
        return False
    with GateStore(store) as opened:
        if opened.get_run(run_id) is None:
            return False
    report = build_report(store, run_id)
    return all(r.sequential is not None and r.sequential.final for r in (report, *report.family))


def demo(
    max_questions: MaxQuestions = None,
    max_minutes: MaxMinutes = DEFAULT_MINUTES,
    until_decided: UntilDecided = False,
    dataset: Datasets = None,
    target: Target = "qwen2.5-coder-1.5b-instruct",
    draft: Draft = "qwen2.5-coder-0.5b-instruct",
    num_speculative_tokens: K = 4,
    margin: Margin = None,
    flip_rate: FlipRate = 0.16,
    # 256 cut 8 of 10 GSM8K answers of this model short, which makes accuracy meaningless.
    max_tokens: MaxTokens = 512,
    max_num_seqs: MaxNumSeqs = DEFAULT_BATCH,
    dtype: Dtype = "bfloat16",
    quantization: Quantization = DEFAULT_QUANTIZATION,
    batch_invariant: BatchInvariant = False,
    seed: Seed = 0,
    store: Store = Path("flyspec-demo.db"),
    html: Html = None,
    no_progress: NoProgress = False,
    as_json: AsJson = False,
) -> None:
    """Run the main job: does the gate catch a harmful setting, and is FLy within a margin of lossless
    decoding on GSM8K and MATH-500?

    Arms, in one engine: standard speculative decoding (lossless baseline), the draft model alone (a control
    that must FAIL) and FLy (K=4). The margin is chosen by simulation before the first answer, and said first.

    Each answer is stored as it arrives; rerunning the same command resumes (or continues) where it stopped.
    """
    from flyspec import assets
    from flyspec.gate import GateOptions, build_report, run
    from flyspec.gate.arms.engine import preload
    from flyspec.gate.arms.registry import parse_arm
    from flyspec.gate.data.datasets import load_dataset
    from flyspec.gate.runs import main_job

    for name in (target, draft):
        if name in assets.ZOO:
            assets.prepare(name)
    quant = parse_quantization(quantization)
    arms = main_job.demo_arms(
        target, draft, num_speculative_tokens, dtype, max_num_seqs, quant, batch_invariant=batch_invariant
    )
    datasets = tuple(dataset) if dataset else main_job.DATASETS
    pool = sum(len(load_dataset(d)) for d in datasets)
    choice = main_job.choose_margin(pool, flip_rate, margin=margin)
    fly_margin = choice.margin
    # The registered settings are part of the run id: the same command resumes, others start a new run.
    size = max_questions if max_questions is not None else "all"
    settings = f"n{size}-k{num_speculative_tokens}-t{max_tokens}-m{fly_margin:g}-s{seed}"
    if quant is not None:
        settings += f"-{quant}"
    if batch_invariant:
        settings += "-bi"
    if dataset:
        settings += "-" + "+".join(Path(d).stem for d in datasets)
    run_id = f"demo-3arm-seq-{settings}-{Path(target).name}"
    control = main_job.control_outlook(pool)
    for line in main_job.opening_lines(choice, control, datasets):
        print(line, file=sys.stderr, flush=True)
    if not _decided(store, run_id):
        llm = preload([parse_arm(name, arm) for name, arm in arms.items()])
        modes = {name: arm.get("verification") for name, arm in arms.items()}
        rate = main_job.probe_rate(llm, modes)
        print(main_job.timing_line(choice, control, rate), file=sys.stderr, flush=True)
    options = GateOptions(
        store, datasets, arms["baseline"], fly_margin, arms["candidate"], alpha=main_job.ALPHA,
        controls={"control": arms["control"]}, control_alpha=main_job.CONTROL_ALPHA,
        control_margin=main_job.CONTROL_MARGIN, sequential=True, max_questions=max_questions,
        max_minutes=None if until_decided else max_minutes, max_tokens=max_tokens, seed=seed, run_id=run_id,
        progress=not no_progress,
    )  # fmt: skip
    result = run(options)
    report = build_report(store, run_id)
    print(report.to_markdown())
    print(explain(report, choice))
    if html is not None:
        html.write_text(report.to_html(), encoding="utf-8")
        print(f"\nHTML report: {html}")
    if as_json:
        print(json.dumps(report.to_dict(), default=str))
    if result.interrupted:
        raise typer.Exit(130)
