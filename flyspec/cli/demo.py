"""`flyspec demo`: the main job on the embedded default (docs/gate.md, "The demo: `flyspec demo`"; the
design is flyspec/demo/design.py, the words at the end flyspec/demo/report.py).

Prepares the Qwen2.5-Coder pair of the model zoo, then runs the sequential quality gate (docs/gate.md)
with three arms in one engine: the lossless baseline (standard speculative decoding), the draft model
alone (a control the gate must FAIL) and FLy (the candidate), on GSM8K test questions (MATH-500 too where
the design needs them) in a seeded random order, the three answers of a question side by side. Once the
gate has caught the control, its requests in flight are cancelled and FLy's comparison goes on until its
own decision, the question pool's end, the time budget (30 minutes of answering by default) or, with
``--until-decided``, until it decides. Then a first screen says each verdict, FLy's speed against standard
speculative decoding and what deciding about FLy takes, above the full report.
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
        help="Question sets (repeatable): gsm8k, math500, or a JSONL of your own (docs/gate.md, 'Gate your "
        "own traffic'). Default: GSM8K, with MATH-500 added only where the design needs more questions.",
    ),
]
Target = Annotated[str, typer.Option(help="Target model: zoo name, HF folder or .gguf file.")]
Draft = Annotated[str, typer.Option(help="Draft model (same vocabulary as the target).")]
K = Annotated[
    int | None,
    typer.Option("--k", min=2, help="FLy's draft tokens per step (K; default: the demo's setting)."),
]
Window = Annotated[
    int | None,
    typer.Option(
        "--fly-window-size",
        min=1,
        help="FLy's window: later native acceptances checked, as vLLM's fly_window_size (default: the "
        "demo's setting, or min(6, K - 1) with --k).",
    ),
]
Threshold = Annotated[
    float | None,
    typer.Option(
        "--fly-entropy-threshold",
        min=0.0,
        help="FLy's entropy threshold in nats (default: the demo's setting).",
    ),
]
Margin = Annotated[
    float | None,
    typer.Option(
        help="FLy's pre-registered non-inferiority margin (0.05 = 5 accuracy points). Default: the narrowest "
        "margin the question pool can decide, chosen by simulating the design before the first answer."
    ),
]
FlipRate = Annotated[
    float | None,
    typer.Option(
        help="The share of questions FLy is expected to flip, which sizes the default margin (default: what "
        "the demo's FLy setting flipped on this pair when measured)."
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


def _settings(k: int | None, window: int | None, threshold: float | None, **given: Any) -> Any:
    """The demo's settings from its options (ValueError names a bad one): FLy's setting is the demo's,
    changed where --k, --fly-window-size or --fly-entropy-threshold say (a new K takes vLLM's default
    window unless one is given)."""
    from dataclasses import replace

    from flyspec.demo import design

    fly = design.FLY_SETTING
    if k is not None and k != fly.num_speculative_tokens:
        fly = replace(fly, num_speculative_tokens=k, window_size=None)
    if window is not None:
        fly = replace(fly, window_size=window)
    if threshold is not None:
        fly = replace(fly, entropy_threshold=threshold)
    given["datasets"] = tuple(given["datasets"] or ()) or None
    given["quantization"] = parse_quantization(given["quantization"])
    return design.DemoSettings(fly=fly, **given)


def _report(settings: Any, choice: Any, html: Path | None, as_json: bool) -> None:
    """Print the first screen, the run's report and the newcomer's words; when asked, the HTML file and
    the JSON line."""
    from flyspec.demo import design, report

    built = report.build_report(settings.store, settings.run_id(choice))
    first = report.first_screen(
        built, settings.fly.label(), design.GPU_TOKENS_PER_S, design.TOKENS_PER_ANSWER
    )
    print("\n".join(first) + "\n")
    print(built.to_markdown())
    print(report.explain(built, design.pool_words(choice.datasets)))
    if html is not None:
        html.write_text(built.to_html(), encoding="utf-8")
        print(f"\nHTML report: {html}")
    if as_json:
        print(json.dumps(built.to_dict(), default=str))


def _prepare(name: str) -> None:
    """Convert a zoo model not yet prepared in a child process (`flyspec models prepare`), so that whatever
    the conversion touched goes back to the OS before the engine loads: a first demo peaks no higher than
    a later one. The child prints its own progress and errors; its exit code ends the demo."""
    import subprocess

    from flyspec import assets

    if name not in assets.ZOO or assets.is_prepared(name):
        return
    command = [sys.executable, "-c", "from flyspec.cli import main; main()", "models", "prepare", name]
    code = subprocess.run(command, check=False).returncode
    if code:
        raise typer.Exit(code)


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def demo(
    max_questions: MaxQuestions = None,
    max_minutes: MaxMinutes = DEFAULT_MINUTES,
    until_decided: UntilDecided = False,
    dataset: Datasets = None,
    target: Target = "qwen2.5-coder-1.5b-instruct",
    draft: Draft = "qwen2.5-coder-0.5b-instruct",
    num_speculative_tokens: K = None,
    window: Window = None,
    threshold: Threshold = None,
    margin: Margin = None,
    flip_rate: FlipRate = None,
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
    decoding on GSM8K (and MATH-500 where the design needs it)?

    Arms, in one engine: the lossless baseline (standard speculative decoding), the draft model alone (a
    control that must FAIL) and FLy, the three answers of a question side by side. The margin and the
    question pool are chosen by simulation before the first answer, and said first; the report opens with
    each verdict, FLy's speed against standard speculative decoding and what deciding about FLy takes.

    Each answer is stored as it arrives; rerunning the same command resumes (or continues) where it stopped.
    """
    from flyspec.demo import design
    from flyspec.demo.report import decided
    from flyspec.gate import run

    settings = _settings(
        num_speculative_tokens, window, threshold, target=target, draft=draft, datasets=dataset,
        max_questions=max_questions, margin=margin, flip_rate=flip_rate, max_tokens=max_tokens,
        max_num_seqs=max_num_seqs, dtype=dtype, quantization=quantization, batch_invariant=batch_invariant,
        seed=seed, store=store,
    )  # fmt: skip
    for name in (target, draft):
        _prepare(name)
    choice = settings.choose()
    control = design.control_outlook(choice.pool)
    for line in design.opening_lines(choice, control, fly=settings.fly.label()):
        _say(line)
    if not decided(settings.store, settings.run_id(choice)):
        _say(design.timing_line(choice, control, design.start(settings, choice)))
    budget = None if until_decided else max_minutes
    result = run(design.gate_options(settings, choice, budget, not no_progress))
    _report(settings, choice, html, as_json)
    if result.interrupted:
        raise typer.Exit(130)
