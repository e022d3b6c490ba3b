"""`flyspec bench`: throughput sweep of target-only, standard and lossy (FLy, typical acceptance) decoding,
with or without a lossless prefix, optionally against a peer.

Settings come from a preset ("quick", the default: batch 1, K=4, 4 prompts x 128 tokens, one
repetition; "reference": the sweep behind BENCHMARKS.md, batch sizes 1 to 32, unquantized and int8) and
any option given explicitly overrides it. Options are validated and the arm list is planned before torch
is imported or any weights load.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from flyspec.bench.sweep import Arm, parse_int_list, plan_arms

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


@dataclass(frozen=True)
class Settings:
    """A fully resolved sweep (preset values with explicit options applied)."""

    model: str = DEFAULT_MODEL
    drafters: tuple[str, ...] = (DEFAULT_DRAFT,)
    methods: tuple[str, ...] = ("target", "standard", "fly")
    batch_sizes: tuple[int, ...] = (1,)
    ks: tuple[int, ...] = (4,)
    headline_k: int = 4
    fly_windows: tuple[int, ...] = ()
    fly_threshold: float = 0.3
    lossless_prefixes: tuple[int, ...] = (0,)
    peer: str | None = None
    dataset: str = "gsm8k"
    num_prompts: int = 4
    max_tokens: int = 128
    repeats: int = 1
    warmup_tokens: int = 16
    breakdown: bool = False
    ignore_eos: bool = True
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    threads: int | None = None
    quantizations: tuple[str | None, ...] = (None,)


PRESETS = {
    "quick": Settings(),
    # What BENCHMARKS.md shows: both weight formats at the batch sizes the gate and the server use, K=2
    # (best at batch 1 before) and 4 (the demo's), about 35 minutes on 2 idle cores. Wider sweeps (K up
    # to 6, more batch sizes, FLy windows) are a matter of options.
    "reference": Settings(
        batch_sizes=(1, 16, 32),
        quantizations=(None, "int8"),
        ks=(2, 4),
        peer="hf",
        breakdown=True,
    ),
}


def _positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name}={value}: must be >= 1")


def resolve_settings(preset: str, overrides: dict[str, Any]) -> Settings:
    """The preset with every non-None override applied; ValueError naming a bad option."""
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}: must be one of {', '.join(PRESETS)}")
    for name in ("num_prompts", "max_tokens", "repeats", "headline_k", "threads"):
        _positive(name, overrides.get(name))
    if overrides.get("warmup_tokens") is not None and overrides["warmup_tokens"] < 1:
        raise ValueError(f"warmup_tokens={overrides['warmup_tokens']}: must be >= 1")
    threshold = overrides.get("fly_threshold")
    if threshold is not None and not threshold >= 0:
        raise ValueError(f"fly_threshold={threshold}: must be finite and >= 0")
    return replace(PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None})


def plan(settings: Settings) -> list[Arm]:
    """The sweep's arms (see flyspec.bench.sweep for the rule)."""
    return plan_arms(
        methods=settings.methods,
        batch_sizes=settings.batch_sizes,
        ks=settings.ks,
        headline_k=settings.headline_k,
        extra_windows=settings.fly_windows,
        drafters=settings.drafters,
        peer=settings.peer,
        fly_threshold=settings.fly_threshold,
        quantizations=settings.quantizations,
        lossless_prefixes=settings.lossless_prefixes,
    )


def _check_output(path: Path | None, option: str) -> None:
    # Fail before a long run, not after it.
    if path is not None and not path.resolve().parent.is_dir():
        raise ValueError(f"{option} {path}: folder {path.resolve().parent} does not exist")


def _command_line() -> str:
    if Path(sys.argv[0]).name == "flyspec":
        return shlex.join(["flyspec", *sys.argv[1:]])
    return shlex.join(["flyspec", "bench", *sys.argv[1:]])


def bench(
    preset: Annotated[
        str, typer.Option(help="Starting settings: quick (default) or reference (BENCHMARKS.md).")
    ] = "quick",
    model: Annotated[
        str | None, typer.Option(help=f"Target: HF folder, .gguf or zoo name (default: {DEFAULT_MODEL}).")
    ] = None,
    draft: Annotated[
        list[str] | None,
        typer.Option(help=f"Drafter (repeatable): draft model or 'ngram' (default: {DEFAULT_DRAFT})."),
    ] = None,
    methods: Annotated[
        str | None,
        typer.Option(
            help="Comma list of target, standard and lossy verification policies (fly, typical) "
            "(default: target,standard,fly)."
        ),
    ] = None,
    batch_sizes: Annotated[
        str | None, typer.Option(help="Comma list of batch sizes (default: 1; reference 1,4,8,16,32).")
    ] = None,
    k: Annotated[
        str | None, typer.Option(help="Comma list of K swept at batch 1 (default: 4; reference 2..6).")
    ] = None,
    headline_k: Annotated[
        int | None,
        typer.Option(
            help="K of the lossy arms, FLy's window sweep and batch sizes > 1 (default: 4, or the first --k "
            "without 4)."
        ),
    ] = None,
    fly_windows: Annotated[
        str | None, typer.Option(help="Extra FLy windows at the headline K, batch 1 ('none' or e.g. 1,2).")
    ] = None,
    fly_threshold: Annotated[
        float | None, typer.Option(help="FLy entropy threshold theta (default: 0.3).")
    ] = None,
    lossless_prefix: Annotated[
        str | None,
        typer.Option(
            help="Comma list of lossless_prefix_tokens for every lossy arm, e.g. 0,16 (default: 0)."
        ),
    ] = None,
    peer: Annotated[str | None, typer.Option(help="Also run a peer in this process: hf, or none.")] = None,
    dataset: Annotated[
        str | None, typer.Option(help="Prompt set: a gate dataset name or path (default: gsm8k).")
    ] = None,
    num_prompts: Annotated[
        int | None, typer.Option(help="Requests per arm and run, rounded up to full batches (default: 4).")
    ] = None,
    max_tokens: Annotated[int | None, typer.Option(help="New tokens per request (default: 128).")] = None,
    repeats: Annotated[int | None, typer.Option(help="Interleaved timed repetitions (default: 1).")] = None,
    warmup_tokens: Annotated[
        int | None, typer.Option(help="Tokens of each arm's untimed warm-up run (default: 16).")
    ] = None,
    breakdown: Annotated[
        bool | None,
        typer.Option("--breakdown/--no-breakdown", help="Time the parts of a batch-1 decode step."),
    ] = None,
    stop_at_eos: Annotated[
        bool,
        typer.Option(
            "--stop-at-eos", help="Stop requests at end-of-sequence (default: generate max-tokens)."
        ),
    ] = False,
    dtype: Annotated[
        str, typer.Option(help="auto, float32, bfloat16 or float16 (the peer uses the same).")
    ] = "auto",
    device: Annotated[str, typer.Option(help="cpu, cuda or cuda:N.")] = "cpu",
    seed: Annotated[int, typer.Option(help="Engine seed.")] = 0,
    threads: Annotated[
        int | None,
        typer.Option(help="torch CPU threads for every arm (default: torch's choice, one per core)."),
    ] = None,
    quantization: Annotated[
        str | None,
        typer.Option(
            help="Comma list of weight formats, each with every flyspec arm: none, int8, int4, or "
            "TARGET/DRAFT to quantize the draft differently (e.g. int8/int4) (default: none; reference "
            "none,int8)."
        ),
    ] = None,
    json_path: Annotated[
        Path | None,
        typer.Option("--json", help="Write the full report as JSON here (also printed as the last line)."),
    ] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Write a PNG: throughput vs batch size, speed-up vs acceptance.")
    ] = None,
    markdown: Annotated[
        Path | None, typer.Option(help="Write the report as Markdown (e.g. BENCHMARKS.md).")
    ] = None,
    from_json: Annotated[
        Path | None,
        typer.Option(
            help="Measure nothing: render the table, --plot and --markdown from a saved --json report."
        ),
    ] = None,
    analysis: Annotated[
        Path | None,
        typer.Option(help="A Markdown file of analysis written after the run, included in --markdown."),
    ] = None,
) -> None:
    """Measure output tokens/s (excluding load), acceptance length, acceptance rate, forgiven share and peak
    RSS for target-only, standard and lossy (FLy, typical acceptance; --lossless-prefix) decoding across
    batch sizes, K and drafters, interleaved with a warm-up; with --peer hf, also transformers' generate
    and assisted generation, reported as ratios."""
    if from_json is not None:
        _check_output(plot, "--plot")
        _check_output(markdown, "--markdown")
        _emit(load_report(from_json), None, plot, markdown, _read_analysis(analysis))
        return
    settings = _settings_from_options(
        preset,
        {
            "model": model,
            "drafters": tuple(draft) if draft else None,
            "methods": _names(methods),
            "batch_sizes": _ints("batch_sizes", batch_sizes),
            "ks": _ints("k", k),
            "headline_k": headline_k,
            "fly_windows": _windows(fly_windows),
            "fly_threshold": fly_threshold,
            "lossless_prefixes": _ints("lossless_prefix", lossless_prefix, minimum=0),
            "dataset": dataset,
            "num_prompts": num_prompts,
            "max_tokens": max_tokens,
            "repeats": repeats,
            "warmup_tokens": warmup_tokens,
            "breakdown": breakdown,
            "dtype": dtype,
            "device": device,
            "seed": seed,
            "threads": threads,
            "quantizations": _formats(quantization),
            "ignore_eos": not stop_at_eos,
        },
        peer,
    )
    arms = plan(settings)
    for path, option in ((json_path, "--json"), (plot, "--plot"), (markdown, "--markdown")):
        _check_output(path, option)
    analysis_text = _read_analysis(analysis)  # read before the sweep: a missing file fails now
    report = run_bench(settings, arms, _command_line())
    _emit(report, json_path, plot, markdown, analysis_text)


def _names(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(m.strip() for m in text.split(",") if m.strip())


def _ints(option: str, text: str | None, minimum: int = 1) -> tuple[int, ...] | None:
    return None if text is None else tuple(parse_int_list(option, text, minimum))


def _formats(text: str | None) -> tuple[str | None, ...] | None:
    """--quantization: None when absent, else the listed formats with 'none' as None."""
    if text is None:
        return None
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    return tuple(None if name == "none" else name for name in names)


def _windows(text: str | None) -> tuple[int, ...] | None:
    """--fly-windows: None when absent, () for 'none', else the listed windows."""
    if text is None:
        return None
    return () if text.strip().lower() in ("", "none") else tuple(parse_int_list("fly_windows", text))


def _settings_from_options(preset: str, overrides: dict[str, Any], peer: str | None) -> Settings:
    """The preset with the given options applied; a --k list without the headline K moves the headline
    to its first value."""
    settings = resolve_settings(preset, overrides)
    if peer is not None:
        settings = replace(settings, peer=None if peer.lower() == "none" else peer)
    if (
        overrides["ks"] is not None
        and overrides["headline_k"] is None
        and settings.headline_k not in settings.ks
    ):
        settings = replace(settings, headline_k=settings.ks[0])
    return settings


def run_bench(settings: Settings, arms: list[Arm], command: str) -> dict[str, Any]:
    """Run the planned sweep and return the report object (layout in flyspec.bench.report)."""
    from flyspec.bench import report as rep
    from flyspec.bench.machine import describe_machine
    from flyspec.bench.prompts import load_prompts, waves
    from flyspec.bench.runner import BenchRunner, run_interleaved

    if settings.threads is not None:
        import torch

        torch.set_num_threads(settings.threads)
    machine = describe_machine(settings.device)
    runner = BenchRunner(
        settings.model,
        arms,
        dtype=settings.dtype,
        device=settings.device,
        ignore_eos=settings.ignore_eos,
        seed=settings.seed,
    )
    largest = max(a.batch_size for a in arms)
    prompts = load_prompts(settings.dataset, max(settings.num_prompts, largest), runner.tokenizer)
    arm_waves = {a.label: waves(prompts, settings.num_prompts, a.batch_size) for a in arms}
    profiled = _breakdown_arms(settings, arms) if settings.breakdown else []

    with _progress(len(arms) * (1 + settings.repeats) + len(profiled)) as advance:
        results = run_interleaved(
            runner,
            arms,
            arm_waves,
            max_tokens=settings.max_tokens,
            repeats=settings.repeats,
            warmup_tokens=settings.warmup_tokens,
            on_progress=advance,
        )
        breakdowns = _breakdowns(runner, profiled, prompts[0].token_ids, settings, advance)

    reference_label = next(
        (a.label for a in arms if a.backend == "flyspec" and a.method == "target" and a.batch_size == 1), None
    )
    reference = results[reference_label][0].outputs if reference_label and results[reference_label] else None
    rows = [
        rep.summarise(a, results[a.label], sum(len(w) for w in arm_waves[a.label]), reference) for a in arms
    ]
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    headline_drafter = settings.drafters[0] if settings.drafters else None
    return {
        "schema": rep.SCHEMA,
        "command": command,
        "finished_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine,
        "settings": _settings_json(settings, prompts, runner),
        "results": rows,
        "ratios": rep.ratios(rows),
        "batch_scaling": rep.batch_scaling(rows, drafter=headline_drafter, headline_k=settings.headline_k),
        "breakdown": breakdowns,
        # ru_maxrss is in KiB on Linux.
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "load_s": runner.load_seconds,
    }


@contextmanager
def _progress(total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr (stdout carries the table and the JSON line); yields `advance(label)`."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    started = time.monotonic()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("bench", total=total)
        done = 0

        def advance(label: str) -> None:
            nonlocal done
            progress.update(task, description=label, completed=done)
            done += 1
            if not console.is_terminal:  # a log file gets one line per step instead of a live bar
                console.print(
                    f"[{time.monotonic() - started:7.0f} s] {done}/{total} {label}", highlight=False
                )

        yield advance


def _breakdowns(
    runner: Any, arms: list[Arm], prompt_ids: list[int], settings: Settings, advance: Callable[[str], None]
) -> dict[str, dict[str, Any]]:
    """label -> step breakdown of each profiled arm (flyspec.bench.breakdown)."""
    from flyspec.bench.breakdown import step_breakdown

    out = {}
    for arm in arms:
        advance(f"breakdown: {arm.label}")
        params = runner.sampling_params(arm, settings.max_tokens)
        out[arm.label] = step_breakdown(runner.engine_for(arm), prompt_ids, params, settings.device)
    return out


def _settings_json(settings: Settings, prompts: list[Any], runner: Any) -> dict[str, Any]:
    """The report's `settings` object: the resolved sweep plus the prompts and weight dtype it used."""
    from flyspec.bench.prompts import prompts_sha256

    return {
        "model": settings.model,
        "drafters": list(settings.drafters),
        "methods": list(settings.methods),
        "batch_sizes": list(settings.batch_sizes),
        "ks": list(settings.ks),
        "headline_k": settings.headline_k,
        "fly_windows": list(settings.fly_windows),
        "fly_threshold": settings.fly_threshold,
        "lossless_prefixes": list(settings.lossless_prefixes),
        "peer": settings.peer,
        "dataset": settings.dataset,
        "num_prompts": settings.num_prompts,
        "prompt_ids": [p.id for p in prompts],
        "prompts_sha256": prompts_sha256(prompts),
        "max_tokens": settings.max_tokens,
        "repeats": settings.repeats,
        "warmup_tokens": settings.warmup_tokens,
        "ignore_eos": settings.ignore_eos,
        "dtype": settings.dtype,
        "weight_dtype": str(runner.target_dtype).removeprefix("torch."),
        "device": settings.device,
        "seed": settings.seed,
        "threads": settings.threads,
        "quantizations": list(settings.quantizations),
    }


def _breakdown_arms(settings: Settings, arms: list[Arm]) -> list[Arm]:
    """Batch-1 flyspec arms to profile: target-only, and standard and each lossy policy at its defaults
    (FLy: default window; no prefix) at the headline K with the first drafter."""
    drafter = settings.drafters[0] if settings.drafters else None
    picked = []
    for arm in arms:
        if arm.backend != "flyspec" or arm.batch_size != 1:
            continue
        default = arm.method == "standard" or (
            arm.lossy and not arm.lossless_prefix and (arm.fly_window is None or arm.default_window)
        )
        if arm.method == "target" or (arm.k == settings.headline_k and arm.drafter == drafter and default):
            picked.append(arm)
    return picked


def load_report(path: Path) -> dict[str, Any]:
    """A report saved by `--json`; ValueError when the file is not one."""
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--from-json {path}: not valid JSON ({exc})") from exc
    from flyspec.bench.report import READABLE_SCHEMAS

    if not isinstance(report, dict) or report.get("schema") not in READABLE_SCHEMAS:
        schemas = " or ".join(repr(schema) for schema in READABLE_SCHEMAS)
        raise ValueError(f"--from-json {path}: not a flyspec bench report (schema {schemas})")
    return report


def _read_analysis(path: Path | None) -> str | None:
    if path is None:
        return None
    if not path.is_file():
        raise ValueError(f"--analysis {path}: no such file")
    return path.read_text()


def _emit(
    report: dict[str, Any],
    json_path: Path | None,
    plot: Path | None,
    markdown: Path | None,
    analysis: str | None = None,
) -> None:
    from flyspec.bench.markdown import print_table, render_markdown

    if json_path is not None:  # first: the measurements are the expensive part
        json_path.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    if plot is not None:
        from flyspec.bench.plot import write_plot

        write_plot(report, plot)
    if markdown is not None:
        markdown.write_text(render_markdown(report, plot, markdown, analysis))
    if json_path is not None:
        print(json.dumps(report, separators=(",", ":")))
