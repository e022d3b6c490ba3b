"""Renders a bench report: the terminal table and BENCHMARKS.md.

Everything in the Markdown comes from the report object of one run; nothing is typed in by hand, so the
file is regenerated, never edited.
"""

from __future__ import annotations

import contextlib
import json
import shlex
from pathlib import Path
from typing import Any

from flyspec.bench.machine import cpu_label
from flyspec.bench.report import BenchReport, BenchRow, Ratio, Scaling


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def baseline_ratio(report: BenchReport, row: BenchRow) -> float | None:
    """tokens/s relative to target-only of the same backend and weight format at the same batch size."""
    for other in report.results:
        if (
            other.backend == row.backend
            and other.quantization == row.quantization
            and other.method == "target"
            and other.batch_size == row.batch_size
            and other.tokens_per_s
            and row.tokens_per_s
        ):
            return row.tokens_per_s / other.tokens_per_s
    return None


RESULT_COLUMNS = (
    "arm",
    "tokens/s",
    "per run",
    "decode tokens/s",
    "vs target-only",
    "mean acc. length",
    "acc. rate",
    "forgiven",
    "peak RSS (GB)",
    "same as target-only",
)


def result_cells(report: BenchReport, row: BenchRow) -> list[str]:
    """One results-table row as strings (shared by the terminal table and the Markdown)."""
    runs = ", ".join(_num(v, "{:.1f}") for v in row.tokens_per_s_runs)
    return [
        row.label,
        _num(row.tokens_per_s),
        runs,
        _num(row.decode_tokens_per_s),
        _num(baseline_ratio(report, row), "{:.2f}x"),
        _num(row.mean_acceptance_length),
        _pct(row.acceptance_rate),
        _pct(row.forgiven_share),
        _num(None if row.peak_rss_mb is None else row.peak_rss_mb / 1024, "{:.2f}"),
        _pct(row.prefix_match),
    ]


def print_table(report: BenchReport) -> None:
    """The results on the terminal (a rich table on stdout)."""
    from rich.console import Console
    from rich.table import Table

    # Wide enough for every column even when stdout is a pipe (rich would assume 80 columns).
    console = Console(width=max(Console().width, 160))
    table = Table(title="flyspec bench", title_justify="left")
    for i, name in enumerate(RESULT_COLUMNS):
        table.add_column(name, justify="left" if i == 0 else "right")
    for row in report.results:
        table.add_row(*result_cells(report, row))
    console.print(table)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def arm_command(report: BenchReport, row: BenchRow) -> str:
    """A `flyspec bench` command whose sweep includes this arm with the run's settings: a lossy arm at
    its policy's defaults by `--methods`, one with other settings by a one-setting `--policies` grid."""
    s = report.settings
    args = [
        "flyspec",
        "bench",
        "--model",
        s["model"],
        "--dtype",
        s["dtype"],
        "--device",
        s["device"],
        "--dataset",
        s["dataset"],
        "--num-prompts",
        str(s["num_prompts"]),
        "--max-tokens",
        str(s["max_tokens"]),
        "--repeats",
        str(s["repeats"]),
        "--batch-sizes",
        str(row.batch_size),
    ]
    if not s["ignore_eos"]:
        args.append("--stop-at-eos")
    if s.get("threads") is not None:
        args += ["--threads", str(s["threads"])]
    if row.quantization:
        args += ["--quantization", row.quantization]
    if row.lossy and not row.at_defaults:
        grid = {"rejection_sample_method": row.method, **row.settings}
        args += ["--methods", "none", "--policies", json.dumps(grid, separators=(",", ":"))]
    else:
        args += ["--methods", row.method]
    if row.drafter is not None:
        args += ["--draft", row.drafter, "--k", str(row.k), "--headline-k", str(row.k)]
    if row.lossless_prefix:
        args += ["--lossless-prefix", str(row.lossless_prefix)]
    if row.backend == "hf":
        args += ["--peer", "hf"]
    return shlex.join(args)


def render_markdown(
    report: BenchReport, plot_path: Path | None, markdown_path: Path, analysis: str | None = None
) -> str:
    """BENCHMARKS.md for one bench report (plot linked relative to the Markdown file).

    `analysis`: Markdown written by a person after the run (what the numbers mean, what was profiled),
    placed first under its own heading and kept apart from the generated tables.
    """
    out = _header(report)
    if analysis:
        out += ["## Analysis (written after the run)", "", analysis.strip(), ""]
    out += _machine(report.machine)
    out += _setup(report.settings, report.results)
    out += ["## Results", ""]
    out += _table(list(RESULT_COLUMNS), [result_cells(report, r) for r in report.results])
    out += _ratios(report.ratios)
    out += _batch_scaling(report.batch_scaling)
    out += _breakdown(report.breakdown)
    if plot_path is not None:
        out += _plot(plot_path, markdown_path)
    out += _commands(report)
    return "\n".join(out)


def _header(report: BenchReport) -> list[str]:
    return [
        "# Benchmarks",
        "",
        f"Generated on {report.finished_at} by one command (the reference sweep is what `make bench` runs):",
        "",
        f"    {report.command}",
        "",
        "Do not edit by hand: every number below comes from that one run, and the commands at the end "
        "re-measure any single row.",
        "",
    ]


def _machine(m: dict[str, Any]) -> list[str]:
    load = f"{m['load_average_start']} at start, {m.get('load_average_end')} at end"
    out = ["## Machine", ""]
    out += _table(
        ["", ""],
        [
            ["CPU", f"{cpu_label(m)}, {m['logical_cores']} logical"],
            ["memory", f"{m['memory_gb']} GB"],
            ["device", m["device"] + (f" ({m['gpu']})" if m.get("gpu") else "")],
            [
                "software",
                f"Python {m['python']}, torch {m['torch']} ({m['torch_threads']} thread(s)), "
                f"transformers {m['transformers']}, {m['os']}",
            ],
            ["flyspec commit", str(m.get("flyspec_commit"))],
            ["load average (1, 5, 15 min)", load],
        ],
    )
    cores = m["usable_cores"] or 1
    # The load at the end includes the sweep's own threads; only what is left over is other work.
    others_end = (m.get("load_average_end") or [0])[0] - min(m.get("torch_threads") or 0, cores)
    if max(m["load_average_start"][0], others_end) > cores / 2:
        out += [
            "",
            "The load average beyond the sweep's own threads exceeded half the cores: other jobs shared the "
            "CPU during the run. "
            "Absolute tokens/s are therefore low; the ratios come from interleaved runs, so noise hits "
            "all arms alike.",
        ]
    return out


def _lossy_settings(rows: list[BenchRow]) -> list[str]:
    """Each lossy arm's settings as the run recorded them (one line per policy and setting)."""
    seen: dict[str, str] = {}
    for row in rows:
        if row.lossy and row.settings:
            name = " ".join(p for p in (row.method, f"K={row.k}", row.tag) if p)
            values = ", ".join(f"{k} {v}" for k, v in row.settings.items())
            seen.setdefault(name, f"`{name}`: {values}")
    if not seen:
        return []
    return ["- lossy settings (resolved; a label names only those that differ from the policy's defaults): "
            + "; ".join(seen.values())]  # fmt: skip


def _setup(s: dict[str, Any], rows: list[BenchRow]) -> list[str]:
    return [
        "",
        "## Setup",
        "",
        f"- target `{s['model']}`, drafter(s) {', '.join(f'`{d}`' for d in s['drafters']) or 'none'}, "
        f"dtype `{s['dtype']}` (loaded as {s['weight_dtype']}), device `{s['device']}`",
        f"- prompts: the first {len(s['prompt_ids'])} questions of `{s['dataset']}` with the chat template "
        f"(prompt sha256 `{s['prompts_sha256'][:16]}`), {s['num_prompts']} requests per arm and run, "
        f"greedy, {s['max_tokens']} new tokens per request"
        + (
            " (end-of-sequence ignored, so every request generates exactly that many)"
            if s["ignore_eos"]
            else ""
        ),
        "- tokens/s = generated tokens / wall time of `generate` (prompt processing included), model "
        "loading excluded; decode tokens/s leaves prompt processing out (tokens after each request's first, "
        "over the time from a wave's first first-token to its last finish); every arm ran a "
        f"{s['warmup_tokens']}-token warm-up first, then {s['repeats']} interleaved repetition(s) "
        "(every arm once per repetition, order reversed on alternate ones); tokens/s sums tokens and time "
        "over the repetitions, 'per run' lists each",
        "- batch size b = b concurrent requests (waves of b); `prefix=L` = lossless_prefix_tokens L (the "
        "first L tokens of each response verified losslessly); standard arms run on a lossy engine of the "
        'same K with `verification="standard"` requests',
        *_lossy_settings(rows),
        "- mean acc. length = tokens per verification step (1 + accepted / drafts); for hf assisted, "
        "tokens per target forward (prefill included). Forgiven = share of accepted draft tokens only "
        "the lossy policy's rule kept. "
        "'same as target-only' = mean share of each output identical to flyspec target-only batch-1 output "
        "before the first difference (bf16 verify passes may round differently; lossy policies differ by "
        "design)",
        *(
            [
                "- weight formats: "
                + ", ".join(q or "as loaded" for q in s["quantizations"])
                + "; an `int8` (or `int4`) arm quantizes the target and the draft, a `T/D` arm the target "
                "as T and the draft as D (docs/performance.md); each is compared with target-only of its "
                "target's format, and its 'same as target-only' is against the unquantized output, so it "
                "also shows how far quantized answers drift"
            ]
            if any(s.get("quantizations") or [])
            else []
        ),
        "",
    ]


def _ratios(ratios: list[Ratio]) -> list[str]:
    if not ratios:
        return []
    return [
        "",
        "## Ratios (tokens/s, same run)",
        "",
        *_table(
            ["comparison", "ratio", "acceptance-length gain"],
            [[r.name, f"{r.value:.3f}x", _pct(r.acceptance_gain)] for r in ratios],
        ),
    ]


def _batch_scaling(scaling: list[Scaling]) -> list[str]:
    if not scaling:
        return []
    batches = sorted({p.batch_size for b in scaling for p in b.points})
    rows = []
    for b in scaling:
        by_batch = {p.batch_size: p.speedup for p in b.points}
        stop = b.stops_paying_at
        fmt = f"{b.quantization} " if b.quantization else ""
        prefix = f" prefix={b.lossless_prefix}" if b.lossless_prefix else ""
        rows.append(
            [
                f"{fmt}{b.method} K={b.k}{prefix}",
                *(_num(by_batch.get(x), "{:.2f}x") for x in batches),
                "pays at every measured batch size" if stop is None else f"batch {stop}",
            ]
        )
    return [
        "",
        "## Where speculation stops paying",
        "",
        "Tokens/s of speculative decoding over target-only at the same batch size:",
        "",
        *_table(["method", *(f"b={x}" for x in batches), "stops paying at"], rows),
    ]


_BREAKDOWN_PARTS = ("target_forward", "draft_forward", "verify", "engine_other", "outside_step")
_BREAKDOWN_COLUMNS = (
    "arm",
    "steps",
    "tokens/step",
    "target forward",
    "draft forward",
    "verify()",
    "engine other",
    "outside step",
    "verify + engine overhead",
    "x target-only",
)


def _breakdown(breakdown: dict[str, dict[str, Any]]) -> list[str]:
    if not breakdown:
        return []
    base = next((b for label, b in breakdown.items() if label.startswith("flyspec target-only")), None)
    rows = []
    for label, b in breakdown.items():
        ms = b["ms_per_step"]
        overhead = b["verify_share"] + b["engine_other_share"] + b["outside_step_share"]
        per_token = b["decode_s"] / b["decode_tokens"] if b["decode_tokens"] else None
        allowed = base["decode_s"] / base["decode_tokens"] / per_token if base and per_token else None
        rows.append(
            [
                label,
                str(b["decode_steps"]),
                f"{b['decode_tokens'] / b['decode_steps']:.2f}",
                *(f"{ms[p]:.1f} ({_pct(b[p + '_share'])})" for p in _BREAKDOWN_PARTS),
                _pct(overhead),
                _num(allowed, "{:.2f}x"),
            ]
        )
    return [
        "",
        "## Where a decode step's time goes (batch 1)",
        "",
        "One extra generation per arm with the engine's step timings on (see "
        "`flyspec/bench/breakdown.py`); milliseconds per decode step, then the share of decode time. "
        "'x target-only' = tokens per step x target-only step time / this step time: the speed-up these "
        "parts allow.",
        "",
        *_table(list(_BREAKDOWN_COLUMNS), rows),
    ]


def _plot(plot_path: Path, markdown_path: Path) -> list[str]:
    rel = Path(plot_path).resolve()
    with contextlib.suppress(ValueError):
        rel = rel.relative_to(markdown_path.resolve().parent)
    return ["", "## Plot", "", f"![throughput vs batch size; speed-up vs acceptance gain]({rel.as_posix()})"]


def _commands(report: BenchReport) -> list[str]:
    out = ["", "## Re-measure one row", "", "<details><summary>commands</summary>", "", "```"]
    out += [f"# {r.label}\n{arm_command(report, r)}" for r in report.results]
    out += [
        "```",
        "",
        "</details>",
        "",
        "The full JSON of this run (layout in `flyspec/bench/report.py`) is written by `--json FILE`.",
        "",
    ]
    return out
