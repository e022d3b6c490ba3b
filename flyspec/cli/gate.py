"""`flyspec gate ...`: plan, run, pilot and report the paired quality gate (docs/gate.md).

`gate run` and `gate pilot` take the same settings, turn them into one `GateOptions` and call the same
runner; a `--config` JSON file may hold any of them (a flag overrides the file).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from flyspec.cli.options import App
from flyspec.cli.settings import settings_command
from flyspec.gate.runs.settings import GateOptions
from flyspec.gate.runs.tune import TuneOptions

gate_app = App(
    name="gate",
    help="Paired quality gate: does a candidate decoding configuration (e.g. FLy) keep the baseline's "
    "accuracy within a pre-registered margin? plan -> pilot -> run -> report; compare existing eval logs; "
    "tune: the fastest lossy setting proven safe.",
    no_args_is_help=True,
    add_completion=False,
)


def _emit_json(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, default=str))


def _show(report: Any, as_json: bool, html_file: Path | None = None) -> None:
    """Print a report: markdown, or one JSON object with --json; with --html also write its page."""
    if html_file is not None:
        html_file.write_text(report.to_html(), encoding="utf-8")
        print(f"wrote {html_file}", file=sys.stderr)
    if as_json:
        _emit_json(report.to_dict())
    else:
        print(report.to_markdown())


@gate_app.command("plan")
def plan(
    net_loss: float = typer.Option(
        ..., "--net-loss", help="Net accuracy loss to detect, as a fraction (0.02)."
    ),
    flip_rate: float = typer.Option(
        ..., "--flip-rate", help="Share of questions whose correctness flips (0.06)."
    ),
    margin: float | None = typer.Option(
        None, "--margin", help="Also plan the non-inferiority test for this margin (fraction, e.g. 0.02)."
    ),
    alpha: float = typer.Option(
        0.05, "--alpha", help="Two-sided level of the McNemar test; the non-inferiority test uses alpha/2."
    ),
    power: float = typer.Option(0.80, "--power", help="Probability of detecting the effect when it is real."),
    as_json: bool = typer.Option(False, "--json", help="End stdout with one JSON object (key `questions`)."),
) -> None:
    """How many paired questions a gate needs (Connor 1987 for McNemar; score test for non-inferiority)."""
    from flyspec.gate.stats.sizing import questions_needed, questions_needed_noninferiority

    questions = questions_needed(net_loss, flip_rate, alpha, power)
    result: dict[str, Any] = {
        "questions": questions,
        "net_loss": net_loss,
        "flip_rate": flip_rate,
        "alpha": alpha,
        "power": power,
    }
    lines = [
        f"Detecting a net loss of {100 * net_loss:g} points when {100 * flip_rate:g}% of questions flip "
        f"(McNemar, two-sided alpha {alpha:g}, power {100 * power:g}%): {questions} questions."
    ]
    if margin is not None:
        equal = questions_needed_noninferiority(margin, flip_rate, 0.0, alpha / 2, power)
        losing = (
            questions_needed_noninferiority(margin, flip_rate, -net_loss, alpha / 2, power)
            if net_loss < margin
            else None
        )
        result["noninferiority"] = {
            "margin": margin,
            "alpha": alpha / 2,
            "questions_if_equal": equal,
            "questions_if_losing_net_loss": losing,
        }
        lines.append(
            f"Showing non-inferiority within a margin of {100 * margin:g} points (one-sided alpha "
            f"{alpha / 2:g}) when the candidate is truly as accurate: {equal} questions"
            + (
                f"; when it truly loses {100 * net_loss:g} points: {losing} questions."
                if losing is not None
                else f"; a candidate that truly loses {100 * net_loss:g} points or more cannot pass."
            )
        )
    for line in lines:
        print(line)
    if as_json:
        _emit_json(result)


def _answered(options: GateOptions) -> bool:
    """Run (or resume) ``options``' run; True when it was interrupted. Ctrl-C before the first report
    exits 130 at once, saying how to resume."""
    from flyspec.gate.runs.run import describe_interrupt, run

    try:
        return run(options).interrupted
    except KeyboardInterrupt:
        print(describe_interrupt(options.store, options.name), file=sys.stderr)
        raise typer.Exit(130) from None


def _exit_after_run(options: GateOptions, interrupted: bool, decision: str | None, strict: bool) -> None:
    """130 after an interruption (saying how to resume), else `gate report`'s code for the decision."""
    from flyspec.gate.runs.run import describe_interrupt

    if interrupted:
        print(describe_interrupt(options.store, options.name), file=sys.stderr)
        raise typer.Exit(130)
    _exit_for(decision, strict)


Strict = Annotated[bool, typer.Option("--strict", help="Exit 2 when the decision is INCONCLUSIVE.")]
AsJson = Annotated[bool, typer.Option("--json", help="End stdout with the report as one JSON object.")]


@gate_app.command("run")
@settings_command(GateOptions, "run", config=True, kind="gate")
def run_command(options: GateOptions, as_json: AsJson = False, strict: Strict = False) -> None:
    """Run (or resume) the paired gate: both arms answer the same questions with the same seeds.

    Exit code (as `gate report`, for the candidate): 0 PASS, 1 FAIL, 2 INCONCLUSIVE with --strict (else 0);
    130 after Ctrl-C.
    """
    from flyspec.gate.report.build import build_report

    interrupted = _answered(options)
    report = build_report(options.store, options.name)
    _show(report, as_json)
    _exit_after_run(options, interrupted, report.decision, strict)


@gate_app.command("pilot")
@settings_command(GateOptions, "pilot", config=True, kind="pilot")
def pilot_command(options: GateOptions, as_json: AsJson = False) -> None:
    """Measure the flip rate that plans a gate run: the baseline twice (fresh seeds, nothing cached), or
    with --candidate both arms once. Later gate runs in the store leave the pilot's questions out."""
    from flyspec.gate.report.build import build_report

    interrupted = _answered(options)
    report = build_report(options.store, options.name)
    _show(report, as_json)
    _exit_after_run(options, interrupted, report.decision, False)


def _exit_for(decision: str | None, strict: bool) -> None:
    """The exit code of a decision: 0 PASS (or no decision: a pilot), 1 FAIL, 2 INCONCLUSIVE with --strict
    (else 0)."""
    from flyspec.gate.stats.decide import FAIL, INCONCLUSIVE

    if decision == FAIL:
        raise typer.Exit(1)
    if decision == INCONCLUSIVE and strict:
        raise typer.Exit(2)


def _exit_for_tune(report: Any, strict: bool) -> None:
    """A tune's exit code: 0 when a setting passed, 1 when the tune is finished and none passed, and while
    it is unfinished with none passed yet 2 with --strict (else 0)."""
    from flyspec.gate.stats.decide import FAIL, INCONCLUSIVE, PASS

    decision = PASS if report.chosen is not None else FAIL if report.complete else INCONCLUSIVE
    _exit_for(decision, strict)


LogArgument = Annotated[
    str,
    typer.Argument(
        help="Baseline log: an lm-eval samples_*.jsonl file or folder, an Inspect .eval/.json log or "
        "folder, or STORE.db:RUN:ARM."
    ),
]
DeclaredMargin = Annotated[
    float,
    typer.Option(
        "--margin",
        help="Tolerated accuracy loss, fraction in (0, 1). Declared now, after the data: the report says so.",
    ),
]
Metric = Annotated[
    str | None,
    typer.Option("--metric", help="lm-eval metric field or Inspect scorer (default: the only or first one)."),
]
Filter = Annotated[
    list[str] | None,
    typer.Option(
        "--filter",
        help="lm-eval filter: NAME for every task, or TASK=NAME for one (repeatable); needed for a task "
        "that logged several.",
    ),
]
Epoch = Annotated[
    list[str] | None,
    typer.Option(
        "--epoch",
        help="Compare this epoch only: N for both logs, or baseline=N / candidate=N (repeatable); "
        "required when a log holds several epochs per question (they are not independent pairs).",
    ),
]
HtmlFile = Annotated[Path | None, typer.Option("--html", help="Also write an HTML report with a plot.")]


@gate_app.command("compare")
def compare_command(
    baseline: LogArgument,
    candidate: Annotated[str, typer.Argument(help="Candidate log, in any of the same forms.")],
    margin: DeclaredMargin,
    alpha: Annotated[float, typer.Option("--alpha", help="One-sided level (95% interval at 0.025).")] = 0.025,
    metric: Metric = None,
    filter_name: Filter = None,
    epoch: Epoch = None,
    as_json: AsJson = False,
    html_file: HtmlFile = None,
    strict: Strict = False,
) -> None:
    """Paired decision from two existing per-sample logs (lm-eval, Inspect, or a gate store), nothing re-run.

    The logs are paired by task and question id; different question sets are refused, naming them.

    Each task and the pooled questions are decided with the gate's rule (Tango's interval vs the margin).

    The margin is declared after the data, and the report says so.

    Exit code: 0 PASS, 1 FAIL, 2 INCONCLUSIVE with --strict (else 0).
    """
    from flyspec.gate.logs.compare import compare_logs

    epochs = _epochs(epoch or [])
    rep = compare_logs(baseline, candidate, margin, alpha, metric=metric, filter=filter_name, epoch=epochs)
    print(
        f"gate compare: margin {100 * margin:g} points and alpha {alpha:g} declared now, after the data (not "
        "a pre-registered run)",
        file=sys.stderr,
    )
    _show(rep, as_json, html_file)
    _exit_for(rep.decision, strict)


def _epochs(values: list[str]) -> int | dict[str, int] | None:
    """``--epoch`` values: ``N`` for both logs, or ``baseline=N`` / ``candidate=N``."""
    both: int | None = None
    sides: dict[str, int] = {}
    for value in values:
        side, sep, number = value.rpartition("=")
        try:
            parsed = int(number)
        except ValueError:
            raise ValueError(f"--epoch {value!r}: give N, baseline=N or candidate=N") from None
        if not sep:
            both = parsed
        elif side in ("baseline", "candidate"):
            sides[side] = parsed
        else:
            raise ValueError(f"--epoch {value!r}: the side is baseline or candidate")
    if both is not None and sides:
        raise ValueError("--epoch: give N for both logs or one per side, not both")
    return sides or both


TuneJson = Annotated[
    bool,
    typer.Option("--json", help="End stdout with one JSON object (`chosen` and `settings` in test order)."),
]
TuneStrict = Annotated[
    bool, typer.Option("--strict", help="Exit 2 while the tune is unfinished and nothing passed yet.")
]


@gate_app.command("tune")
@settings_command(TuneOptions, "tune")
def tune_command(options: TuneOptions, as_json: TuneJson = False, strict: TuneStrict = False) -> None:
    """The fastest lossy setting (FLy, typical acceptance, lossless prefix) shown non-inferior to standard
    verification, the error rate controlled.

    The test order is fixed before any quality data: slowest first, measured on calibration questions.

    Each setting is tested against the margin at the full alpha; testing stops at the first that fails.

    The chance of choosing any setting worse than the margin stays at most alpha (fixed sequence).

    The baseline answers once and every setting reuses its answers; rerunning the command resumes.

    Exit code: 0 when a setting passed, 1 when none did, 2 with --strict while unfinished with none passed.
    """
    from flyspec.gate.report.tune_report import build_tune_report
    from flyspec.gate.runs.tune import describe_pause, tune

    store = options.store
    try:
        result = tune(options)
    except KeyboardInterrupt:
        print(
            f"gate tune: interrupted; every stored answer is kept in {store}; rerun to resume",
            file=sys.stderr,
        )
        raise typer.Exit(130) from None
    if result.reason != "complete":
        print(describe_pause(result, store), file=sys.stderr)
    with_report = result.reason == "complete" or _has_run(store, options.name)
    rep = build_tune_report(store, options.name) if with_report else None
    if rep is not None:
        _show(rep, as_json)
    if result.interrupted:
        raise typer.Exit(130)
    if rep is not None:
        _exit_for_tune(rep, strict)
    elif strict:
        raise typer.Exit(2)


def _run_kind(store: Path, run_id: str | None) -> str | None:
    """The kind of the run ``gate report`` shows (None when the store or run does not exist)."""
    from flyspec.gate.data.store import GateStore

    if not store.is_file():
        return None
    with GateStore(store) as opened:
        runs = opened.runs()
        run = opened.get_run(run_id) if run_id is not None else (runs[-1] if runs else None)
    return run.kind if run is not None else None


def _has_run(store: str, run_id: str) -> bool:
    from flyspec.gate.data.store import GateStore

    with GateStore(store) as opened:
        return opened.get_run(run_id) is not None


@gate_app.command("report")
def report(
    store: Path = typer.Option(..., "--store", help="The gate store file."),
    run_id: str | None = typer.Option(None, "--run", help="Run name (default: the latest run)."),
    margin: float | None = typer.Option(
        None,
        "--margin",
        help="Also show an exploratory decision at another margin (warned loudly; the registered decision, "
        "its JSON and the exit code stay those of the registered margin).",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the report as one JSON object (decision last)."
    ),
    html_file: Path | None = typer.Option(None, "--html", help="Also write an HTML report with a plot."),
    strict: bool = typer.Option(False, "--strict", help="Exit 2 when the decision is INCONCLUSIVE."),
) -> None:
    """Report a run: paired counts, exact tests, interval vs margin, decision, speed.

    Exit code (of the registered decision): 0 PASS (or a pilot), 1 FAIL, 2 INCONCLUSIVE with --strict
    (else 0). For a tune: 0 when a setting passed, 1 when none did, 2 with --strict while unfinished.
    """
    from flyspec.gate.report.build import build_report

    if _run_kind(store, run_id) == "tune":
        from flyspec.gate.report.tune_report import build_tune_report

        tuned = build_tune_report(store, run_id)
        _show(tuned, as_json)
        _exit_for_tune(tuned, strict)
        return
    rep = build_report(store, run_id, margin)
    for warning in rep.warnings:
        if rep.margin_overridden and warning.startswith("USING MARGIN"):
            print(f"WARNING: {warning}", file=sys.stderr)
    _show(rep, as_json, html_file)
    _exit_for(rep.decision, strict)


_LABEL_PROMPT = "Better: [a] A  [b] B  [t] equally good  [s] skip  [q] quit > "


def _show_pair(console: Any, pair: Any, where: str) -> None:
    """A drawn pair as a person labels it: the request, the reference if any, and answers A and B."""
    from rich.panel import Panel
    from rich.text import Text

    q = pair.question
    console.rule(f"{where}: {q.dataset}/{q.question_id}")
    # As plain Text: a request or an answer holding [brackets] is shown as written, never read as markup.
    console.print(Panel(Text(pair.request), title="Request"))
    if pair.reference:
        console.print(Panel(Text(pair.reference), title="Reference answer (may be incomplete)"))
    console.print(Panel(Text(pair.answer_a), title="Answer A"))
    console.print(Panel(Text(pair.answer_b), title="Answer B"))


def _ask(console: Any) -> str:
    """The key a person pressed: a, b, t, s or q (asked again until it is one; end of input quits)."""
    while True:
        try:
            key = input(_LABEL_PROMPT).strip().lower()
        except EOFError:
            return "q"
        if key in ("a", "b", "t", "s", "q"):
            return key
        console.print("Press a, b, t, s or q, then Enter.")


@gate_app.command("label")
def label_command(
    store: Path = typer.Option(..., "--store", help="The gate store file of a judged run."),
    run_id: str | None = typer.Option(None, "--run", help="Run name (default: the latest judged run)."),
    web: bool = typer.Option(False, "--web", help="Serve the labelling page instead of asking here."),
    host: str = typer.Option("127.0.0.1", "--host", help="With --web: the address to bind."),
    port: int = typer.Option(8101, "--port", help="With --web: the port to bind."),
    label_token: str | None = typer.Option(
        None, "--label-token", help="With --web: the token the page asks for (required off loopback)."
    ),
) -> None:
    """Give the gold labels a judged run drew: each pair's two answers, blind and in random order.

    Press a (A is better), b (B is better), t (equally good), s (skip for now) or q (quit). Each label is
    stored as it is given; rerun to continue. `gate report` then decides on the labels given so far.
    With --web, the same queue is served as a page in the browser (keys A / B / E / S).
    """
    from rich.console import Console

    from flyspec.gate.data.results import gold_rule, pending, record
    from flyspec.gate.data.store import GateStore

    if web:
        from flyspec.cli.label_web import serve_label_page

        serve_label_page(store, run_id, host, port, label_token)
        return
    console = Console(highlight=False)
    with GateStore(store) as opened:
        run, gold = gold_rule(opened, run_id)
        from flyspec.gate.shadow.label import label_requests

        todo = pending(opened, run, gold, label_requests(opened.path)(run))
        if not todo:
            console.print(f"gate label: run {run.run_id!r}: no pair waits for a label.")
            return
        console.print(
            f"gate label: run {run.run_id!r}: {len(todo)} pair(s) wait for a gold label, earliest first. "
            "Which answer is better for the request? Judge correctness first, then completeness."
        )
        done = 0
        for i, pair in enumerate(todo, 1):
            _show_pair(console, pair, f"pair {i} of {len(todo)}")
            key = _ask(console)
            if key == "q":
                break
            if key == "s":
                continue
            record(opened, run, pair, key)
            done += 1
        left = len(todo) - done
        console.print(
            f"gate label: {done} label(s) stored in {store}; {left} pair(s) still wait. `flyspec gate report "
            f"--store {store} --run {run.run_id}` decides on the labels given so far."
        )
