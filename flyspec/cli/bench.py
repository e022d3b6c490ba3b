"""`flyspec bench`: throughput sweep of target-only, standard and lossy decoding (any registered policy, at
its defaults or over a `--policies` grid, with or without a lossless prefix), optionally against a peer
(the sweep itself: flyspec/bench/throughput.py).

Settings come from a preset ("quick", the default: batch 1, K=4, 4 prompts x 128 tokens, one
repetition; "reference": the sweep behind BENCHMARKS.md, batch sizes 1 to 32, unquantized and int8) and
any option given explicitly overrides it. Options are validated and the arm list is planned before torch
is imported or any weights load. This module only parses the options and prints and writes the results.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from flyspec.bench.sweep import parse_int_list
from flyspec.bench.throughput import (
    DEFAULT_DRAFT,
    DEFAULT_MODEL,
    OnProgress,
    load_report,
    plan,
    read_analysis,
    resolve_settings,
    run_bench,
)
from flyspec.cli.options import opt
from flyspec.policy_grid import expand_grid

if TYPE_CHECKING:
    from flyspec.bench.report import BenchReport

Preset = Annotated[str, opt("Starting settings: quick (default) or reference (BENCHMARKS.md).")]
Model = Annotated[str | None, opt(f"Target: HF folder, .gguf or zoo name (default: {DEFAULT_MODEL}).")]
Drafts = Annotated[
    list[str] | None, opt(f"Drafter (repeatable): draft model or 'ngram' (default: {DEFAULT_DRAFT}).")
]
Methods = Annotated[
    str | None,
    opt(
        "Comma list of target, standard and lossy verification policies (fly, typical, any registered one) "
        "at their defaults, or none (default: target,standard,fly; with --policies: target,standard)."
    ),
]
Policies = Annotated[
    str | None,
    opt(
        "More lossy settings, as gate tune's grid: a JSON object or list (or a file) whose list values "
        'are expanded, e.g. \'{"rejection_sample_method": "fly", "fly_window_size": [1, 2]}\' (at the '
        "headline K)."
    ),
]
BatchSizes = Annotated[str | None, opt("Comma list of batch sizes (default: 1; reference 1,4,8,16,32).")]
Ks = Annotated[str | None, opt("Comma list of K swept at batch 1 (default: 4; reference 2..6).")]
HeadlineK = Annotated[
    int | None,
    opt("K of the lossy arms and of batch sizes > 1 (default: 4, or the first --k without 4)."),
]
LosslessPrefix = Annotated[
    str | None, opt("Comma list of lossless_prefix_tokens for every lossy arm, e.g. 0,16 (default: 0).")
]
Peer = Annotated[
    str | None,
    opt(
        "Also run a peer: hf (in this process), llama.cpp (its own llama-bench and llama-batched-bench "
        "beside flyspec target-only and SD at 1, 16 and 32 sequences, and its own speculative decoding "
        "with the same draft and K beside flyspec's SD at 1; flyspec/bench/llama_cpp.py), or none."
    ),
]
Dataset = Annotated[str | None, opt("Prompt set: a gate dataset name or path (default: gsm8k).")]
NumPrompts = Annotated[int | None, opt("Requests per arm and run, rounded up to full batches (default: 4).")]
MaxTokens = Annotated[int | None, opt("New tokens per request (default: 128).")]
Repeats = Annotated[int | None, opt("Interleaved timed repetitions (default: 1).")]
WarmupTokens = Annotated[int | None, opt("Tokens of each arm's untimed warm-up run (default: 16).")]
Breakdown = Annotated[
    bool | None, typer.Option("--breakdown/--no-breakdown", help="Time the parts of a batch-1 decode step.")
]
StopAtEos = Annotated[
    bool,
    typer.Option("--stop-at-eos", help="Stop requests at end-of-sequence (default: generate max-tokens)."),
]
Dtype = Annotated[str, opt("auto, float32, bfloat16 or float16 (the peer uses the same).")]
Device = Annotated[str, opt("cpu, cuda or cuda:N.")]
Seed = Annotated[int, opt("Engine seed.")]
Threads = Annotated[
    int | None, opt("torch CPU threads for every arm (default: torch's choice, one per core).")
]
Quantization = Annotated[
    str | None,
    opt(
        "Comma list of weight formats, each with every flyspec arm: none, int8, int4, or TARGET/DRAFT to "
        "quantize the draft differently (e.g. int8/int4) (default: none; reference none,int8)."
    ),
]
JsonPath = Annotated[
    Path | None,
    typer.Option("--json", help="Write the full report as JSON here (also printed as the last line)."),
]
Plot = Annotated[Path | None, opt("Write a PNG: throughput vs batch size, speed-up vs acceptance.")]
Markdown = Annotated[Path | None, opt("Write the report as Markdown (e.g. BENCHMARKS.md).")]
FromJson = Annotated[
    Path | None, opt("Measure nothing: render the table, --plot and --markdown from a saved --json report.")
]
Analysis = Annotated[
    Path | None, opt("A Markdown file of analysis written after the run, included in --markdown.")
]


def bench(
    preset: Preset = "quick",
    model: Model = None,
    draft: Drafts = None,
    methods: Methods = None,
    policies: Policies = None,
    batch_sizes: BatchSizes = None,
    k: Ks = None,
    headline_k: HeadlineK = None,
    lossless_prefix: LosslessPrefix = None,
    peer: Peer = None,
    dataset: Dataset = None,
    num_prompts: NumPrompts = None,
    max_tokens: MaxTokens = None,
    repeats: Repeats = None,
    warmup_tokens: WarmupTokens = None,
    breakdown: Breakdown = None,
    stop_at_eos: StopAtEos = False,
    dtype: Dtype = "auto",
    device: Device = "cpu",
    seed: Seed = 0,
    threads: Threads = None,
    quantization: Quantization = None,
    json_path: JsonPath = None,
    plot: Plot = None,
    markdown: Markdown = None,
    from_json: FromJson = None,
    analysis: Analysis = None,
) -> None:
    """Measure output tokens/s (excluding load), acceptance length, acceptance rate, forgiven share and peak
    RSS for target-only, standard and lossy (any registered policy, --policies grids, --lossless-prefix)
    decoding across batch sizes, K and drafters, interleaved with a warm-up; with --peer hf, also
    transformers' generate and assisted generation, reported as ratios."""
    if peer is not None and peer.strip().lower() == "llama.cpp":
        from flyspec.cli.bench_llama_cpp import bench_llama_cpp

        options = dict(model=model, draft=draft, batch_sizes=batch_sizes, k=k, quantization=quantization)
        options |= dict(max_tokens=max_tokens, repeats=repeats, threads=threads, dtype=dtype, seed=seed)
        bench_llama_cpp(options | {"dataset": dataset, "json_path": json_path, "markdown": markdown})
        return
    if from_json is not None:
        _check_output(plot, "--plot")
        _check_output(markdown, "--markdown")
        _emit(load_report(from_json), None, plot, markdown, read_analysis(analysis))
        return
    overrides = {
        "model": model, "drafters": tuple(draft) if draft else None, "methods": _names(methods),
        "batch_sizes": _ints("batch_sizes", batch_sizes), "ks": _ints("k", k), "headline_k": headline_k,
        "policies": None if policies is None else tuple(expand_grid(policies)),
        "lossless_prefixes": _ints("lossless_prefix", lossless_prefix, minimum=0), "peer": peer,
        "dataset": dataset, "num_prompts": num_prompts, "max_tokens": max_tokens, "repeats": repeats,
        "warmup_tokens": warmup_tokens, "breakdown": breakdown, "dtype": dtype, "device": device,
        "seed": seed, "threads": threads, "quantizations": _formats(quantization),
        "ignore_eos": not stop_at_eos,
    }  # fmt: skip
    settings = resolve_settings(preset, overrides)
    arms = plan(settings)
    for path, option in ((json_path, "--json"), (plot, "--plot"), (markdown, "--markdown")):
        _check_output(path, option)
    analysis_text = read_analysis(analysis)  # read before the sweep: a missing file fails now
    with _progress() as advance:
        report = run_bench(settings, arms, _command_line(), advance)
    _emit(report, json_path, plot, markdown, analysis_text)


def _names(text: str | None) -> tuple[str, ...] | None:
    """--methods: None when absent, () for 'none', else the listed names."""
    if text is None:
        return None
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    return () if names == ("none",) else names


def _ints(option: str, text: str | None, minimum: int = 1) -> tuple[int, ...] | None:
    return None if text is None else tuple(parse_int_list(option, text, minimum))


def _formats(text: str | None) -> tuple[str | None, ...] | None:
    """--quantization: None when absent, else the listed formats with 'none' as None."""
    if text is None:
        return None
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    return tuple(None if name == "none" else name for name in names)


def _check_output(path: Path | None, option: str) -> None:
    # Fail before a long run, not after it.
    if path is not None and not path.resolve().parent.is_dir():
        raise ValueError(f"{option} {path}: folder {path.resolve().parent} does not exist")


def _command_line() -> str:
    if Path(sys.argv[0]).name == "flyspec":
        return shlex.join(["flyspec", *sys.argv[1:]])
    return shlex.join(["flyspec", "bench", *sys.argv[1:]])


@contextmanager
def _progress() -> Iterator[OnProgress]:
    """A progress bar on stderr (stdout carries the table and the JSON line); yields the sweep's
    ``on_progress(label, total)``."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    started = time.monotonic()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("bench", total=None)
        done = 0

        def advance(label: str, total: int) -> None:
            nonlocal done
            progress.update(task, description=label, completed=done, total=total)
            done += 1
            if not console.is_terminal:  # a log file gets one line per step instead of a live bar
                console.print(
                    f"[{time.monotonic() - started:7.0f} s] {done}/{total} {label}", highlight=False
                )

        yield advance


def _emit(
    report: BenchReport,
    json_path: Path | None,
    plot: Path | None,
    markdown: Path | None,
    analysis: str | None = None,
) -> None:
    from flyspec.bench.markdown import print_table, render_markdown

    data = report.to_dict()
    if json_path is not None:  # first: the measurements are the expensive part
        json_path.write_text(json.dumps(data, indent=2) + "\n")
    print_table(report)
    if plot is not None:
        from flyspec.bench.plot import write_plot

        write_plot(report, plot)
    if markdown is not None:
        markdown.write_text(render_markdown(report, plot, markdown, analysis))
    if json_path is not None:
        print(json.dumps(data, separators=(",", ":")))
