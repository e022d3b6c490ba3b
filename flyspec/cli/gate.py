"""`flyspec gate ...`: plan, run, pilot and report the paired quality gate (SPEC 3.3 and 11)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

gate_app = typer.Typer(
    name="gate",
    help="Paired quality gate: does a candidate decoding configuration (e.g. FLy) keep the baseline's "
    "accuracy within a pre-registered margin? plan -> pilot -> run -> report.",
    no_args_is_help=True,
    add_completion=False,
)

_RUN_KEYS = (
    "store",
    "dataset",
    "limit",
    "baseline",
    "candidate",
    "margin",
    "alpha",
    "temperature",
    "top_p",
    "max_tokens",
    "seed",
    "run",
    "shuffle_seed",
    "chunk_size",
)


def _emit_json(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, default=str))


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
    from flyspec.gate.stats import questions_needed, questions_needed_noninferiority

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


def _load_config(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"--config {path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: must hold a JSON object")
    if "datasets" in data and "dataset" not in data:
        data["dataset"] = data.pop("datasets")
    unknown = sorted(set(data) - set(_RUN_KEYS))
    if unknown:
        raise ValueError(
            f"--config {path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(_RUN_KEYS)}"
        )
    if isinstance(data.get("dataset"), str):
        data["dataset"] = [data["dataset"]]
    return data


def _merged(config: dict[str, Any], **flags: Any) -> dict[str, Any]:
    """Command-line flags override the config file; unset flags (None) fall back to it."""
    out = dict(config)
    out.update({k: v for k, v in flags.items() if v is not None and v != []})
    return out


def _require(settings: dict[str, Any], *names: str) -> None:
    for name in names:
        if settings.get(name) in (None, []):
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} is required (on the command line or in --config)")


def _finish(settings: dict[str, Any], run_id: str, as_json: bool) -> None:
    from flyspec.gate.report import build_report

    report = build_report(settings["store"], run_id)
    if as_json:
        _emit_json(report.to_dict())
    else:
        print(report.to_markdown())


def _interrupted(store: str, run_id: str) -> None:
    from flyspec.gate.runner import describe_interrupt

    print(describe_interrupt(store, run_id), file=sys.stderr)
    raise typer.Exit(130)


_STORE_HELP = "SQLite file holding the run (created if missing; a run resumes where it stopped)."
_DATASET_HELP = "gsm8k, math500, aime:PATH, gpqa:PATH or a JSONL path; repeat for several."
_ARM_HELP = 'Arm as a JSON object or a JSON file, e.g. \'{"kind": "engine", "model": "...", ...}\'.'


@gate_app.command("run")
def run(
    store: str | None = typer.Option(None, "--store", help=_STORE_HELP),
    dataset: list[str] | None = typer.Option(None, "--dataset", help=_DATASET_HELP),
    limit: int | None = typer.Option(None, "--limit", help="Use the first N questions of each dataset."),
    baseline: str | None = typer.Option(None, "--baseline", help="Baseline arm. " + _ARM_HELP),
    candidate: str | None = typer.Option(None, "--candidate", help="Candidate arm. " + _ARM_HELP),
    margin: float | None = typer.Option(
        None, "--margin", help="Tolerated accuracy loss, fraction in (0, 1), registered before the run."
    ),
    alpha: float | None = typer.Option(
        None, "--alpha", help="One-sided level (default 0.025: 95% interval)."
    ),
    temperature: float | None = typer.Option(None, "--temperature", help="Sampling temperature (default 0)."),
    top_p: float | None = typer.Option(None, "--top-p", help="Nucleus sampling mass (default 1.0)."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Answer length cap (default 512)."),
    seed: int | None = typer.Option(None, "--seed", help="Run seed; per-question seeds derive from it."),
    run_name: str | None = typer.Option(None, "--run", help="Run name in the store (default 'gate')."),
    chunk_size: int | None = typer.Option(None, "--chunk-size", help="Questions per interleaved batch."),
    config: Path | None = typer.Option(None, "--config", help="JSON file with any of these settings."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
    as_json: bool = typer.Option(False, "--json", help="End stdout with the report as one JSON object."),
) -> None:
    """Run (or resume) the paired gate: both arms answer the same questions with the same seeds."""
    from flyspec.gate.runner import run_gate

    s = _merged(
        _load_config(config),
        store=store,
        dataset=dataset,
        limit=limit,
        baseline=baseline,
        candidate=candidate,
        margin=margin,
        alpha=alpha,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        seed=seed,
        run=run_name,
        chunk_size=chunk_size,
    )
    _require(s, "store", "dataset", "baseline", "candidate", "margin")
    run_id = s.get("run", "gate")
    try:
        run_gate(
            s["store"],
            s["dataset"],
            s["baseline"],
            s["candidate"],
            s["margin"],
            s.get("alpha", 0.025),
            limit=s.get("limit"),
            temperature=s.get("temperature", 0.0),
            top_p=s.get("top_p", 1.0),
            max_tokens=s.get("max_tokens", 512),
            seed=s.get("seed", 0),
            run_id=run_id,
            shuffle_seed=s.get("shuffle_seed", 0),
            chunk_size=s.get("chunk_size"),
            progress=not no_progress,
        )
    except KeyboardInterrupt:
        _interrupted(s["store"], run_id)
    _finish(s, run_id, as_json)


@gate_app.command("pilot")
def pilot(
    store: str | None = typer.Option(None, "--store", help=_STORE_HELP),
    dataset: list[str] | None = typer.Option(None, "--dataset", help=_DATASET_HELP),
    limit: int | None = typer.Option(None, "--limit", help="Use the first N questions of each dataset."),
    baseline: str | None = typer.Option(None, "--baseline", help="Baseline arm. " + _ARM_HELP),
    margin: float | None = typer.Option(
        None, "--margin", help="The margin you plan to register (fraction), to size the real run."
    ),
    alpha: float | None = typer.Option(None, "--alpha", help="One-sided level (default 0.025)."),
    temperature: float | None = typer.Option(None, "--temperature", help="Sampling temperature (default 0)."),
    top_p: float | None = typer.Option(None, "--top-p", help="Nucleus sampling mass (default 1.0)."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Answer length cap (default 512)."),
    seed: int | None = typer.Option(None, "--seed", help="Run seed; per-question seeds derive from it."),
    run_name: str | None = typer.Option(None, "--run", help="Run name in the store (default 'pilot')."),
    chunk_size: int | None = typer.Option(None, "--chunk-size", help="Questions per interleaved batch."),
    config: Path | None = typer.Option(None, "--config", help="JSON file with any of these settings."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
    as_json: bool = typer.Option(False, "--json", help="End stdout with the report as one JSON object."),
) -> None:
    """Run the baseline twice (fresh seeds, no caching): flip rate with its interval, questions needed."""
    from flyspec.gate.runner import run_pilot

    s = _merged(
        _load_config(config),
        store=store,
        dataset=dataset,
        limit=limit,
        baseline=baseline,
        margin=margin,
        alpha=alpha,
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        seed=seed,
        run=run_name,
        chunk_size=chunk_size,
    )
    s.pop("candidate", None)
    _require(s, "store", "dataset", "baseline", "margin")
    run_id = s.get("run", "pilot")
    try:
        run_pilot(
            s["store"],
            s["dataset"],
            s["baseline"],
            s["margin"],
            s.get("alpha", 0.025),
            limit=s.get("limit"),
            temperature=s.get("temperature", 0.0),
            top_p=s.get("top_p", 1.0),
            max_tokens=s.get("max_tokens", 512),
            seed=s.get("seed", 0),
            run_id=run_id,
            shuffle_seed=s.get("shuffle_seed", 0),
            chunk_size=s.get("chunk_size"),
            progress=not no_progress,
        )
    except KeyboardInterrupt:
        _interrupted(s["store"], run_id)
    _finish(s, run_id, as_json)


@gate_app.command("report")
def report(
    store: Path = typer.Option(..., "--store", help="The gate store file."),
    run_id: str | None = typer.Option(None, "--run", help="Run name (default: the latest run)."),
    margin: float | None = typer.Option(
        None, "--margin", help="Use another margin than the registered one (warned loudly; not the decision)."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print the report as one JSON object (decision last)."
    ),
    html_file: Path | None = typer.Option(None, "--html", help="Also write an HTML report with a plot."),
    strict: bool = typer.Option(False, "--strict", help="Exit 2 when the decision is INCONCLUSIVE."),
) -> None:
    """Report a run: paired counts, exact tests, interval vs margin, decision, speed.

    Exit code: 0 PASS (or a pilot), 1 FAIL, 2 INCONCLUSIVE with --strict (else 0).
    """
    from flyspec.gate.report import FAIL, INCONCLUSIVE, build_report

    rep = build_report(store, run_id, margin)
    for warning in rep.warnings:
        if rep.margin_overridden and warning.startswith("USING MARGIN"):
            print(f"WARNING: {warning}", file=sys.stderr)
    if html_file is not None:
        html_file.write_text(rep.to_html(), encoding="utf-8")
        print(f"wrote {html_file}", file=sys.stderr)
    if as_json:
        _emit_json(rep.to_dict())
    else:
        print(rep.to_markdown())
    if rep.decision == FAIL:
        raise typer.Exit(1)
    if rep.decision == INCONCLUSIVE and strict:
        raise typer.Exit(2)
