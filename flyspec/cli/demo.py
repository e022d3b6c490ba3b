"""`flyspec demo`: the main job on the embedded default.

Prepares the Qwen2.5-Coder pair of the model zoo, then runs the sequential quality gate (docs/gate.md):
standard speculative decoding is the baseline, FLy the candidate (same models, same K; only the verifier
differs, so one engine answers both side by side), on GSM8K test questions in a seeded random order, with
a 2-point margin at alpha 0.025. It stops at the first PASS or FAIL the confidence sequence shows, at
``--max-questions`` or when the time budget runs out, and then says in plain words what was decided,
after how many questions, how fast each arm was and what the interval means.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from flyspec.cli.options import parse_quantization

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEFAULT_MARGIN = 0.02
DEFAULT_MINUTES = 30.0
# Both arms share the engine, so 32 slots are 16 questions in flight. Measured on 2 idle cores (3 minutes of
# answering each, same seed): bf16 with 16 slots stored 9,881 output tokens (31 answers), int8 with 16
# 10,977 (35), int8 with 32 14,611 (49): int8 and 32 slots, 1.48x the tokens of the old bf16 default.
DEFAULT_BATCH = 32
DEFAULT_QUANTIZATION = "auto"


def demo_arms(
    target: str,
    draft: str,
    num_speculative_tokens: int,
    dtype: str,
    max_num_seqs: int,
    quantization: str | None = "auto",
) -> tuple[dict, dict]:
    """The baseline (standard verification) and candidate (FLy) arms: same models, same K, same engine
    settings (the weight format too: "auto" resolves once for the one engine both share); only the
    verifier differs, so the gate runs them on one shared engine."""

    def arm(method: str) -> dict:
        return {
            "quantization": quantization,
            "kind": "engine",
            "model": target,
            "speculative_config": {
                "method": "draft_model",
                "model": draft,
                "num_speculative_tokens": num_speculative_tokens,
                "rejection_sample_method": method,
            },
            "dtype": dtype,
            "max_num_seqs": max_num_seqs,
        }

    return arm("standard"), arm("fly")


def _speed_lines(report: Any) -> list[str]:
    speeds = {s.arm: s for s in report.speeds}
    names = {"baseline": "Standard speculative decoding", "candidate": "FLy"}
    lines = []
    for arm, label in names.items():
        s = speeds.get(arm)
        if s is None or s.request_tokens_per_s is None:
            continue
        length = f"{s.mean_acceptance_length:.2f}" if s.mean_acceptance_length is not None else "-"
        forgiven = f"{100 * s.forgiven_share:.1f}%" if s.forgiven_share is not None else "-"
        lines.append(
            f"{label}: {s.request_tokens_per_s:.1f} output tokens/s per request, {length} tokens per target "
            f"forward pass (mean acceptance length), {forgiven} of kept draft tokens forgiven."
        )
    base, cand = speeds.get("baseline"), speeds.get("candidate")
    if base and cand and base.request_tokens_per_s and cand.request_tokens_per_s:
        ratio = cand.request_tokens_per_s / base.request_tokens_per_s
        lines.append(
            f"In the same batches, FLy generated {ratio:.2f}x the tokens per second of standard speculative "
            "decoding per request."
        )
    return lines


def _interval_lines(report: Any) -> list[str]:
    pooled = report.pooled
    if pooled is None or pooled.ci_low is None or pooled.ci_high is None:
        return []
    m = f"{100 * report.run.margin:g}"
    return [
        f"The interval is the range of accuracy differences (FLy minus standard) that the answers so far "
        f"leave plausible, at {100 * report.level:g}% confidence. It is a confidence sequence: it stays "
        "valid at every number of questions, which is why the demo may stop as soon as it clears the "
        f"margin. The margin says FLy may lose at most {m} points of accuracy and still count as good "
        f"enough: PASS needs the whole interval above -{m}, FAIL the whole interval below -{m}.",
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
            f"Prefix sharing: both arms send every question's prompt, so {cache['hits']:,} of the "
            f"{cache['queries']:,} prompt tokens ({100 * cache['hits'] / cache['queries']:.0f}%) reused the "
            "KV blocks the other arm's prompt had filled: their prefill was saved."
        )
    return lines


def explain(report: Any) -> str:
    """The newcomer's summary under the report: compared what, decided what, how fast, what it means."""
    stop = report.sequential
    lines = [
        "",
        "What this means",
        "---------------",
        "Both arms answered the same GSM8K test questions, drawn in a seeded random order, with the same "
        "prompts and greedy decoding, in one engine: the baseline verifies drafts losslessly (standard "
        "speculative decoding), FLy forgives some rejected draft tokens to go faster.",
        f"Decision: {report.decision}. " + " ".join(report.explanation),
        *_speed_lines(report),
        *_engine_lines(report.run.notes),
        *_interval_lines(report),
    ]
    if stop is not None and not stop.final:
        lines.append(
            f"To go on, run the same command again: it continues from question {stop.stopped_at + 1} and the "
            "interval stays valid however many more questions it takes."
        )
    return "\n".join(lines)


MaxQuestions = Annotated[
    int | None,
    typer.Option(
        "--max-questions",
        "--questions",
        "-n",
        min=1,
        help="At most this many GSM8K test questions (default: all 1,319).",
    ),
]
MaxMinutes = Annotated[
    float, typer.Option(help="Time budget for answering, after the models are ready; a rerun continues.")
]
Target = Annotated[str, typer.Option(help="Target model: zoo name, HF folder or .gguf file.")]
Draft = Annotated[str, typer.Option(help="Draft model (same vocabulary as the target).")]
K = Annotated[int, typer.Option("--k", min=2, help="Draft tokens per step (K).")]
Margin = Annotated[
    float, typer.Option(help="Pre-registered non-inferiority margin (0.02 = 2 accuracy points).")
]
MaxTokens = Annotated[int, typer.Option(min=1, help="Answer length cap in tokens.")]
MaxNumSeqs = Annotated[
    int, typer.Option(min=2, help="Requests decoded together (both arms' requests share them).")
]
Dtype = Annotated[str, typer.Option(help="float32 | bfloat16 | float16 | auto.")]
Quantization = Annotated[
    str,
    typer.Option(
        help="Weight quantization of both arms (the same for both, so the comparison stays fair): auto "
        "(the fastest format this CPU runs, measured at load; docs/performance.md), int8, int4 or none."
    ),
]
Seed = Annotated[int, typer.Option(min=0, help="Seed of the question order and the sampling.")]
Store = Annotated[
    Path, typer.Option(help="SQLite file holding every answer (an interrupted demo resumes from it).")
]
Html = Annotated[Path | None, typer.Option(help="Also write an HTML report with a plot.")]
NoProgress = Annotated[bool, typer.Option("--no-progress", help="No progress bar.")]
AsJson = Annotated[bool, typer.Option("--json", help="End with the report as one JSON line.")]


def demo(
    max_questions: MaxQuestions = None,
    max_minutes: MaxMinutes = DEFAULT_MINUTES,
    target: Target = DEFAULT_TARGET,
    draft: Draft = DEFAULT_DRAFT,
    num_speculative_tokens: K = 4,
    margin: Margin = DEFAULT_MARGIN,
    # 256 cut 8 of 10 GSM8K answers of this model short, which makes accuracy meaningless.
    max_tokens: MaxTokens = 512,
    max_num_seqs: MaxNumSeqs = DEFAULT_BATCH,
    dtype: Dtype = "bfloat16",
    quantization: Quantization = DEFAULT_QUANTIZATION,
    seed: Seed = 0,
    store: Store = Path("flyspec-demo.db"),
    html: Html = None,
    no_progress: NoProgress = False,
    as_json: AsJson = False,
) -> None:
    """Run the main job: is FLy as accurate as standard speculative decoding on GSM8K, and how much faster?

    Baseline: standard speculative decoding (lossless). Candidate: FLy (lossy). Same target and draft.

    The run stops at the first decision the evidence supports, or at the question or time budget.

    Each answer is stored as it arrives; rerunning the same command resumes (or continues) where it
    stopped.
    """
    from flyspec import assets
    from flyspec.gate import GateOptions, build_report, run

    for name in (target, draft):
        if name in assets.ZOO:
            assets.prepare(name)
    quant = parse_quantization(quantization)
    baseline, candidate = demo_arms(target, draft, num_speculative_tokens, dtype, max_num_seqs, quant)
    # The registered settings are part of the run id: the same command resumes, others start a new run.
    size = max_questions if max_questions is not None else "all"
    settings = f"n{size}-k{num_speculative_tokens}-t{max_tokens}-m{margin:g}-s{seed}"
    if quant is not None:
        settings += f"-{quant}"
    run_id = f"demo-gsm8k-seq-{settings}-{Path(target).name}"
    print(
        f"flyspec demo: GSM8K, baseline = standard speculative decoding, candidate = FLy "
        f"(K={num_speculative_tokens}), margin {margin * 100:g} points, sequential, at most "
        f"{max_minutes:g} minutes of answering; answers in {store}",
        file=sys.stderr,
    )
    options = GateOptions(
        store, ("gsm8k",), baseline, margin, candidate, sequential=True, max_questions=max_questions,
        max_minutes=max_minutes, max_tokens=max_tokens, seed=seed, run_id=run_id, progress=not no_progress,
    )  # fmt: skip
    result = run(options)
    report = build_report(store, run_id)
    print(report.to_markdown())
    print(explain(report))
    if html is not None:
        html.write_text(report.to_html(), encoding="utf-8")
        print(f"\nHTML report: {html}")
    if as_json:
        print(json.dumps(report.to_dict(), default=str))
    if result.interrupted:
        raise typer.Exit(130)
