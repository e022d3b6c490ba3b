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

from flyspec.cli.options import HELP_MARKUP

gate_app = typer.Typer(
    name="gate",
    help="Paired quality gate: does a candidate decoding configuration (e.g. FLy) keep the baseline's "
    "accuracy within a pre-registered margin? plan -> pilot -> run -> report; compare existing eval logs; "
    "tune: the fastest lossy setting proven safe.",
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
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
    from flyspec.gate.stats.planning import questions_needed, questions_needed_noninferiority

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


# What a --config file may set: the command-line settings, by their option names.
_CONFIG_KEYS = (
    "store",
    "dataset",
    "limit",
    "max_questions",
    "baseline",
    "candidate",
    "margin",
    "alpha",
    "sequential",
    "max_minutes",
    "temperature",
    "top_p",
    "max_tokens",
    "seed",
    "order_seed",
    "run",
    "shuffle_seed",
    "exclude_run",
    "judge",
    "gold_rate",
    "judge_all",
    "population",
    "alpha_budget",
    "control",
    "control_alpha",
    "control_margin",
)


def _load_config(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config {path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must hold a JSON object")
    for plural in ("dataset", "exclude_run"):
        if plural + "s" in data and plural not in data:
            data[plural] = data.pop(plural + "s")
        if isinstance(data.get(plural), str):
            data[plural] = [data[plural]]
    unknown = sorted(set(data) - set(_CONFIG_KEYS))
    if unknown:
        raise ValueError(
            f"--config {path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(_CONFIG_KEYS)}"
        )
    return data


# Option names that differ from the GateOptions / TuneOptions field they set.
_FIELDS = {"dataset": "datasets", "run": "run_id", "exclude_run": "exclude_runs"}


def _controls(values: list[str] | dict[str, Any]) -> dict[str, Any]:
    """``--control NAME=ARM`` values (or a config file's object of them) as {name: arm}."""
    if isinstance(values, dict):
        return values
    out: dict[str, Any] = {}
    for value in values:
        name, sep, arm = value.partition("=")
        if not sep or not name.strip() or not arm.strip():
            raise ValueError(f'--control {value!r}: give NAME=ARM, e.g. draft=\'{{"kind": "engine", ...}}\'')
        if name in out:
            raise ValueError(f"--control: two controls are named {name!r}")
        out[name.strip()] = arm
    return out


def _fields(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings by option name as the options' fields: the unset ones (None) are left out, so the
    fields' own defaults apply (RunSettings, flyspec/gate/runs/options.py, is their one source)."""
    settings = dict(settings)
    if settings.get("control"):
        settings["controls"] = _controls(settings.pop("control"))
    settings.pop("control", None)
    out = {_FIELDS.get(k, k): v for k, v in settings.items() if v is not None}
    for name in ("datasets", "exclude_runs"):
        if name in out:
            out[name] = tuple(out[name])
    if "sequential" in out:
        out["sequential"] = bool(out["sequential"])
    return out


def _flags(params: dict[str, Any]) -> dict[str, Any]:
    """A `gate run` or `gate pilot` call's parameters as the settings by option name (``--run`` is
    ``run_name`` in Python), without those that are not settings."""
    flags = {k: v for k, v in params.items() if k not in ("config", "no_progress", "as_json", "strict")}
    flags["run"] = flags.pop("run_name")
    return flags


def _options(kind: str, config: Path | None, progress: bool, **flags: Any) -> Any:
    """One GateOptions from the config file and the flags (a flag overrides the file; unset flags, None,
    fall back to it)."""
    from flyspec.gate.runs.options import GateOptions

    s = _load_config(config)
    s.update({k: v for k, v in flags.items() if v is not None and v != [] and v is not False})
    if kind == "pilot" and s.get("sequential"):
        raise ValueError("--sequential: a pilot answers a fixed set of questions; use it with `gate run`")
    required = ("store", "dataset", "baseline", "margin") + (("candidate",) if kind == "gate" else ())
    for name in required:
        if s.get(name) in (None, []):
            raise ValueError(f"--{name.replace('_', '-')} is required (on the command line or in --config)")
    return GateOptions(kind=kind, progress=progress, **_fields(s))


def _run_and_report(options: Any, as_json: bool, strict: bool = False) -> None:
    """Run, then print the report (JSON last with --json); exit 130 after an interruption, else with
    `gate report`'s code for the decision."""
    from flyspec.gate.report.report import build_report
    from flyspec.gate.runs.runner import describe_interrupt, run

    try:
        result = run(options)
    except KeyboardInterrupt:
        print(describe_interrupt(options.store, options.name), file=sys.stderr)
        raise typer.Exit(130) from None
    report = build_report(options.store, options.name)
    _show(report, as_json)
    if result.interrupted:
        print(describe_interrupt(options.store, options.name), file=sys.stderr)
        raise typer.Exit(130)
    _exit_for(report.decision, strict)


_STORE_HELP = "SQLite file holding the run (created if missing; a run resumes where it stopped)."
_DATASET_HELP = (
    "gsm8k, math500, humaneval, aime:PATH, gpqa:PATH, mbpp:PATH or a JSONL path; repeat for several."
)
_ARM_HELP = 'Arm as a JSON object or a JSON file, e.g. \'{"kind": "engine", "model": "...", ...}\'.'

Store = Annotated[str | None, typer.Option("--store", help=_STORE_HELP)]
Datasets = Annotated[list[str] | None, typer.Option("--dataset", help=_DATASET_HELP)]
Limit = Annotated[
    int | None, typer.Option("--limit", help="The first N questions of each dataset's seeded random order.")
]
MaxQuestions = Annotated[
    int | None,
    typer.Option(
        "--max-questions",
        help="The first N questions of the seeded order over all datasets (a sequential run's maximum; "
        "default: every question).",
    ),
]
Baseline = Annotated[str | None, typer.Option("--baseline", help="Baseline arm. " + _ARM_HELP)]
Margin = Annotated[
    float | None,
    typer.Option("--margin", help="Tolerated accuracy loss, fraction in (0, 1), registered before the run."),
]
Alpha = Annotated[
    float | None, typer.Option("--alpha", help="One-sided level (default 0.025: 95% interval).")
]
MaxMinutes = Annotated[
    float | None,
    typer.Option(
        "--max-minutes",
        help="Stop answering after this long (models load first); rerunning the command continues.",
    ),
]
Temperature = Annotated[float | None, typer.Option("--temperature", help="Sampling temperature (default 0).")]
TopP = Annotated[float | None, typer.Option("--top-p", help="Nucleus sampling mass (default 1.0).")]
MaxTokens = Annotated[int | None, typer.Option("--max-tokens", help="Answer length cap (default 512).")]
Seed = Annotated[int | None, typer.Option("--seed", help="Run seed; per-question seeds derive from it.")]
OrderSeed = Annotated[int | None, typer.Option("--order-seed", help="Question-order seed (default: --seed).")]
ExcludeRun = Annotated[
    list[str] | None,
    typer.Option(
        "--exclude-run",
        help="Leave out the questions this run of the store used (repeatable); pilots are always left out. "
        "Fresh questions are not a new look's budget: under the default claim every look at the same arms "
        "counts in the alpha ledger.",
    ),
]
Config = Annotated[Path | None, typer.Option("--config", help="JSON file with any of these settings.")]
JudgeOption = Annotated[
    str | None,
    typer.Option(
        "--judge",
        help="Judge of the questions with grader 'judge', as a JSON object or file: "
        '{"base_url": "http://HOST:PORT/v1", "model": "NAME", "max_tokens": 512, "seed": 0}. It compares '
        "both arms' answers in both orders (temperature 0).",
    ),
]
Population = Annotated[
    str | None,
    typer.Option(
        "--population",
        help="What a sequential decision claims: 'superpopulation' (default: the method on questions like "
        "these, run-to-run randomness included) or 'finite' (exactly the registered questions in this "
        "run's outputs, nothing beyond them). A resumed run keeps its registered claim.",
    ),
]
AlphaBudget = Annotated[
    float | None,
    typer.Option(
        "--alpha-budget",
        help="The family-wise error of every look at these arms' comparison, on any questions, this run "
        "and later looks together: the chance that any of them wrongly PASSes (default: --alpha, leaving "
        "nothing for a second look; at most 0.05 unless --alpha is larger; set by the first look). E.g. "
        "--alpha 0.0125 --alpha-budget 0.025 keeps 0.0125 for a sequential continuation of an "
        "INCONCLUSIVE fixed run. Looks are kept per user in the alpha ledger ($FLYSPEC_GATE_LEDGER, "
        "default in the flyspec cache) and every report shows the budget and the earlier looks.",
    ),
]
NoProgress = Annotated[bool, typer.Option("--no-progress", help="No progress bar.")]
Strict = Annotated[bool, typer.Option("--strict", help="Exit 2 when the decision is INCONCLUSIVE.")]
AsJson = Annotated[bool, typer.Option("--json", help="End stdout with the report as one JSON object.")]


@gate_app.command("run")
def run_command(
    store: Store = None,
    dataset: Datasets = None,
    baseline: Baseline = None,
    candidate: Annotated[str | None, typer.Option("--candidate", help="Candidate arm. " + _ARM_HELP)] = None,
    margin: Margin = None,
    alpha: Alpha = None,
    sequential: Annotated[
        bool,
        typer.Option(
            "--sequential",
            help="Stop at the first crossing of an anytime-valid confidence sequence (PASS or FAIL), at "
            "--max-questions, at --max-minutes or at Ctrl-C.",
        ),
    ] = False,
    max_questions: MaxQuestions = None,
    max_minutes: MaxMinutes = None,
    limit: Limit = None,
    temperature: Temperature = None,
    top_p: TopP = None,
    max_tokens: MaxTokens = None,
    seed: Seed = None,
    order_seed: OrderSeed = None,
    run_name: Annotated[
        str | None, typer.Option("--run", help="Run name in the store (default 'gate').")
    ] = None,
    exclude_run: ExcludeRun = None,
    judge: JudgeOption = None,
    gold_rate: Annotated[
        float | None,
        typer.Option(
            "--gold-rate",
            help="Judged runs: the share of pairs whose answers differ drawn for a gold label (default "
            "0.2), by a hash independent of the question order, registered before the first answer. The "
            "decision is the prediction-powered interval: it rests on those labels (P(PASS) <= alpha at a "
            "true loss of the margin and P(FAIL) <= alpha at no loss, for any judge); the judge's verdicts "
            "only sharpen it as far as the labels show them right.",
        ),
    ] = None,
    judge_all: Annotated[
        bool,
        typer.Option(
            "--judge-all",
            help="The judge grades every question; each question's own grader labels the drawn pairs (to "
            "measure a judge against exact grading). Without it, people label with `gate label`.",
        ),
    ] = False,
    population: Population = None,
    alpha_budget: AlphaBudget = None,
    control: Annotated[
        list[str] | None,
        typer.Option(
            "--control",
            help="NAME=ARM: also compare an arm known to be worse (e.g. the draft model alone) with the "
            "baseline, a positive control the gate must FAIL; repeatable. Each control takes "
            "--control-alpha of --alpha, so the chance of any wrong decision stays at most --alpha; a "
            "sequential run answers the controls' pairs first and stops asking a control once it decided.",
        ),
    ] = None,
    control_alpha: Annotated[
        float | None,
        typer.Option("--control-alpha", help="Each control's share of --alpha (default: a fifth of it)."),
    ] = None,
    control_margin: Annotated[
        float | None,
        typer.Option("--control-margin", help="The controls' margin (default: --margin)."),
    ] = None,
    config: Config = None,
    no_progress: NoProgress = False,
    as_json: AsJson = False,
    strict: Strict = False,
) -> None:
    """Run (or resume) the paired gate: both arms answer the same questions with the same seeds.

    Exit code (as `gate report`, for the candidate): 0 PASS, 1 FAIL, 2 INCONCLUSIVE with --strict (else 0);
    130 after Ctrl-C.
    """
    _run_and_report(_options("gate", config, not no_progress, **_flags(locals())), as_json, strict)


@gate_app.command("pilot")
def pilot_command(
    store: Store = None,
    dataset: Datasets = None,
    baseline: Baseline = None,
    candidate: Annotated[
        str | None,
        typer.Option(
            "--candidate",
            help="Also run this arm once, to measure its flip rate against the baseline (needed at "
            "temperature 0, where the baseline twice measures nothing). " + _ARM_HELP,
        ),
    ] = None,
    margin: Annotated[
        float | None,
        typer.Option("--margin", help="The margin you plan to register (fraction), to size the real run."),
    ] = None,
    alpha: Alpha = None,
    max_questions: MaxQuestions = None,
    max_minutes: MaxMinutes = None,
    limit: Limit = None,
    temperature: Temperature = None,
    top_p: TopP = None,
    max_tokens: MaxTokens = None,
    seed: Seed = None,
    order_seed: OrderSeed = None,
    run_name: Annotated[
        str | None, typer.Option("--run", help="Run name in the store (default 'pilot').")
    ] = None,
    exclude_run: ExcludeRun = None,
    judge: JudgeOption = None,
    config: Config = None,
    no_progress: NoProgress = False,
    as_json: AsJson = False,
) -> None:
    """Measure the flip rate that plans a gate run: the baseline twice (fresh seeds, nothing cached), or
    with --candidate both arms once. Later gate runs in the store leave the pilot's questions out."""
    _run_and_report(_options("pilot", config, not no_progress, **_flags(locals())), as_json)


def _exit_for(decision: str | None, strict: bool) -> None:
    """The exit code of a decision: 0 PASS (or no decision: a pilot), 1 FAIL, 2 INCONCLUSIVE with --strict
    (else 0)."""
    from flyspec.gate.stats.decision import FAIL, INCONCLUSIVE

    if decision == FAIL:
        raise typer.Exit(1)
    if decision == INCONCLUSIVE and strict:
        raise typer.Exit(2)


def _exit_for_tune(report: Any, strict: bool) -> None:
    """A tune's exit code: 0 when a setting passed, 1 when the tune is finished and none passed, and while
    it is unfinished with none passed yet 2 with --strict (else 0)."""
    from flyspec.gate.stats.decision import FAIL, INCONCLUSIVE, PASS

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


def _numbers(text: str | None, kind: type, flag: str) -> tuple | None:
    if text is None:
        return None
    try:
        values = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag} {text!r}: give comma-separated {kind.__name__}s, e.g. 3,2,1") from None
    if not values:
        raise ValueError(f"{flag} {text!r}: give at least one value")
    return values


Candidates = Annotated[
    str | None,
    typer.Option(
        "--candidates",
        help="JSON list (or JSON file) of settings: speculative_config fragments such as "
        '{"fly_window_size": 2, "fly_entropy_threshold": 0.3} applied to the baseline engine arm, or '
        '{"arm": ARM, "speculative_config": {...}} for endpoint arms. Default: the grid of --windows '
        "x --thresholds.",
    ),
]
Policies = Annotated[
    str | None,
    typer.Option(
        "--policies",
        help="A grid over verification policies (JSON or a JSON file): an object, or a list of them, "
        "whose list values are expanded into every combination, e.g. "
        '[{"rejection_sample_method": "fly", "fly_window_size": [3, 1], '
        '"lossless_prefix_tokens": [0, 32]}, {"rejection_sample_method": "typical", '
        '"typical_acceptance_sampler_posterior_threshold": [0.09, 0.3]}] (see docs/gate.md).',
    ),
]
Windows = Annotated[
    str | None,
    typer.Option("--windows", help="Grid windows, e.g. 3,2,1 (default: min(6, K-1) down to 1)."),
]
Thresholds = Annotated[
    str | None, typer.Option("--thresholds", help="Grid entropy thresholds (default: 0.6,0.3).")
]
Order = Annotated[
    str | None,
    typer.Option(
        "--order",
        help="speed: slowest first, measured on the calibration questions (default); given: the "
        "candidates' order.",
    ),
]
OrderBy = Annotated[
    str | None,
    typer.Option(
        "--order-by", help="Speed measure of --order speed: mean_acceptance_length (default) or tokens_per_s."
    ),
]
CalibrationQuestions = Annotated[
    int | None,
    typer.Option(
        "--calibration-questions",
        help="Questions that measure speed (never graded, never test questions; default 8); 0 only with "
        "--order given.",
    ),
]
Fixed = Annotated[
    bool,
    typer.Option(
        "--fixed", help="Fixed-size tests on every test question instead of sequential tests (default)."
    ),
]
TestQuestions = Annotated[
    int | None,
    typer.Option(
        "--max-questions",
        help="Test questions: the next N of the seeded order after the calibration ones (default: all).",
    ),
]
TuneRun = Annotated[str | None, typer.Option("--run", help="Tune run name in the store (default 'tune').")]
TuneJson = Annotated[
    bool,
    typer.Option("--json", help="End stdout with one JSON object (`chosen` and `settings` in test order)."),
]
TuneStrict = Annotated[
    bool, typer.Option("--strict", help="Exit 2 while the tune is unfinished and nothing passed yet.")
]
_ORDER_BY_ALIASES = {"tokens-per-s": "tokens_per_s", "mean-acceptance-length": "mean_acceptance_length"}


@gate_app.command("tune")
def tune_command(
    store: Annotated[str, typer.Option("--store", help=_STORE_HELP)],
    dataset: Annotated[list[str], typer.Option("--dataset", help=_DATASET_HELP)],
    baseline: Annotated[
        str, typer.Option("--baseline", help="Baseline arm, standard verification. " + _ARM_HELP)
    ],
    margin: Annotated[
        float, typer.Option("--margin", help="Tolerated accuracy loss, fraction in (0, 1), registered.")
    ],
    alpha: Annotated[
        float | None,
        typer.Option("--alpha", help="One-sided level of each test and of the whole tune (default 0.025)."),
    ] = None,
    candidates: Candidates = None,
    policies: Policies = None,
    windows: Windows = None,
    thresholds: Thresholds = None,
    order: Order = None,
    order_by: OrderBy = None,
    calibration_questions: CalibrationQuestions = None,
    fixed: Fixed = False,
    max_questions: TestQuestions = None,
    max_minutes: MaxMinutes = None,
    temperature: Temperature = None,
    top_p: TopP = None,
    max_tokens: MaxTokens = None,
    seed: Seed = None,
    order_seed: OrderSeed = None,
    run_name: TuneRun = None,
    exclude_run: ExcludeRun = None,
    population: Population = None,
    alpha_budget: AlphaBudget = None,
    no_progress: NoProgress = False,
    as_json: TuneJson = False,
    strict: TuneStrict = False,
) -> None:
    """The fastest lossy setting (FLy, typical acceptance, lossless prefix) shown non-inferior to standard
    verification, the error rate controlled.

    The test order is fixed before any quality data: slowest first, measured on calibration questions.

    Each setting is tested against the margin at the full alpha; testing stops at the first that fails.

    The chance of choosing any setting worse than the margin stays at most alpha (fixed sequence).

    The baseline answers once and every setting reuses its answers; rerunning the command resumes.

    Exit code: 0 when a setting passed, 1 when none did, 2 with --strict while unfinished with none passed.
    """
    from flyspec.gate.runs.options import TuneOptions

    settings = {
        "store": store, "dataset": dataset, "baseline": baseline, "margin": margin, "alpha": alpha,
        "candidates": candidates, "policies": policies, "windows": _numbers(windows, int, "--windows"),
        "thresholds": _numbers(thresholds, float, "--thresholds"), "order": order,
        "order_by": _ORDER_BY_ALIASES.get(order_by, order_by) if order_by else None,
        "calibration_questions": calibration_questions, "sequential": not fixed,
        "max_questions": max_questions, "max_minutes": max_minutes, "temperature": temperature,
        "top_p": top_p, "max_tokens": max_tokens, "seed": seed, "order_seed": order_seed, "run": run_name,
        "exclude_run": exclude_run or (), "population": population, "alpha_budget": alpha_budget,
    }  # fmt: skip
    _tune_and_report(TuneOptions(progress=not no_progress, **_fields(settings)), as_json, strict)


def _tune_and_report(options: Any, as_json: bool, strict: bool) -> None:
    """Tune, then print the tune's report (JSON with --json); exit as `gate report` does for a tune, 130
    after an interruption."""
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
    from flyspec.gate.report.report import build_report

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


def _requests(run: Any) -> dict[str, str]:
    """Each registered question's request as text, by prompt hash, from the datasets the run read."""
    from flyspec.gate.data.datasets import load_dataset

    out: dict[str, str] = {}
    for spec in run.notes.get("dataset_sources", {}).values():
        try:
            questions = load_dataset(spec, shuffle_seed=run.registered.shuffle_seed or 0)
        except (ValueError, OSError):
            continue  # shown as missing; the labels do not depend on it
        for q in questions:
            text = (
                q.prompt
                if q.prompt is not None
                else "\n".join(f"[{m['role']}] {m['content']}" for m in q.messages or [])
            )
            out[q.prompt_hash] = text
    return out


_LABEL_PROMPT = "Better: [a] A  [b] B  [t] equally good  [s] skip  [q] quit > "


@gate_app.command("label")
def label_command(
    store: Path = typer.Option(..., "--store", help="The gate store file of a judged run."),
    run_id: str | None = typer.Option(None, "--run", help="Run name (default: the latest judged run)."),
) -> None:
    """Give the gold labels a judged run drew: each pair's two answers, blind and in random order.

    Press a (A is better), b (B is better), t (equally good), s (skip for now) or q (quit). Each label is
    stored as it is given; rerun to continue. `gate report` then decides on the labels given so far.
    """
    from rich.console import Console
    from rich.panel import Panel

    from flyspec.gate.data.store import GateStore
    from flyspec.gate.runs.labelling import gold_rule, pending, record

    console = Console(highlight=False)
    with GateStore(store) as opened:
        run, gold = gold_rule(opened, run_id)
        todo = pending(opened, run, gold, _requests(run))
        if not todo:
            console.print(f"gate label: run {run.run_id!r}: no pair waits for a label.")
            return
        console.print(
            f"gate label: run {run.run_id!r}: {len(todo)} pair(s) wait for a gold label, earliest first. "
            "Which answer is better for the request? Judge correctness first, then completeness."
        )
        done = 0
        for i, pair in enumerate(todo, 1):
            q = pair.question
            console.rule(f"pair {i} of {len(todo)}: {q.dataset}/{q.question_id}")
            console.print(Panel(pair.request, title="Request"))
            if pair.reference:
                console.print(Panel(pair.reference, title="Reference answer (may be incomplete)"))
            console.print(Panel(pair.answer_a, title="Answer A"))
            console.print(Panel(pair.answer_b, title="Answer B"))
            while True:
                try:
                    key = (
                        input("Better: [a] A  [b] B  [t] equally good  [s] skip  [q] quit > ").strip().lower()
                    )
                except EOFError:
                    key = "q"
                if key in ("a", "b", "t", "s", "q"):
                    break
                console.print("Press a, b, t, s or q, then Enter.")
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
