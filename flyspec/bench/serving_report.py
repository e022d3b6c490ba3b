"""Renders a serving-benchmark report: the terminal table and a Markdown section for BENCHMARKS.md.

Everything comes from the report object of one `flyspec bench-serve` run; nothing is typed in by hand.
Ratios are flyspec's figure over the peer's for the same method, arm and concurrency, so "> 1.00x"
always means flyspec is faster (or, for time to first token, that the peer waits longer).
"""

from __future__ import annotations

import shlex
from typing import Any

from flyspec.bench.machine import cpu_label
from flyspec.bench.peers import FLYSPEC_PEERS

# Which flyspec arm a peer's arm is compared with (same method, same lossless verification).
_SAME_ARM = {"target": "target", "standard": "standard", "ngram": "ngram"}


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def _find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def flyspec_ratio(
    rows: list[dict[str, Any]], row: dict[str, Any], key: str, ours_peer: str = "flyspec"
) -> float | None:
    """`ours_peer`'s `key` (flyspec, flyspec-int8 or flyspec-int4) over this peer row's, same
    method/arm/concurrency; None for flyspec's own rows."""
    if row["peer"].startswith("flyspec") or row["arm"] not in _SAME_ARM:
        return None
    ours = _find(rows, peer=ours_peer, method=row["method"], arm=row["arm"], concurrency=row["concurrency"])
    if ours is None or not ours.get(key) or not row.get(key):
        return None
    return ours[key] / row[key]


def target_ratio(rows: list[dict[str, Any]], row: dict[str, Any]) -> float | None:
    """tokens/s over the same peer's target-only tokens/s at the same concurrency."""
    if row["method"] == "target":
        return None
    base = _find(rows, peer=row["peer"], method="target", concurrency=row["concurrency"])
    if base is None or not base.get("tokens_per_s") or not row.get("tokens_per_s"):
        return None
    return row["tokens_per_s"] / base["tokens_per_s"]


RESULT_COLUMNS = (
    "server",
    "arm",
    "conc.",
    "tokens/s",
    *(f"{peer} / this" for peer in FLYSPEC_PEERS),
    "vs own target",
    "per request tok/s",
    "TTFT mean (s)",
    "TTFT p99 (s)",
    "ITL mean (ms)",
    "TPOT (ms)",
    "e2e mean (s)",
    "mean acc. length",
    "short / errors",
)


def result_cells(rows: list[dict[str, Any]], row: dict[str, Any]) -> list[str]:
    """One results row as strings (shared by the terminal table and the Markdown)."""
    ms = "{:.0f}"
    return [
        f"{row['peer']} ({row['weights']})",
        row["arm"],
        str(row["concurrency"]),
        _num(row["tokens_per_s"]),
        *(_num(flyspec_ratio(rows, row, "tokens_per_s", peer), "{:.2f}x") for peer in FLYSPEC_PEERS),
        _num(target_ratio(rows, row), "{:.2f}x"),
        _num(row["per_request_tokens_per_s"]),
        _num(row["ttft_mean_s"]),
        _num(row["ttft_p99_s"]),
        _num(None if row["itl_mean_s"] is None else 1000 * row["itl_mean_s"], ms),
        _num(None if row["tpot_mean_s"] is None else 1000 * row["tpot_mean_s"], ms),
        _num(row["e2e_mean_s"]),
        _num(row.get("mean_acceptance_length")),
        f"{row['short_requests']} / {row['errors']}",
    ]


SERVER_COLUMNS = ("server", "weights", "start (s)", "peak RSS (GB)", "peak PSS (GB)", "status")


def server_cells(server: dict[str, Any]) -> list[str]:
    """One server-start row: how long it took to be ready, its peak memory, and whether it ran."""

    def gb(value: int | None) -> str:
        return "-" if value is None else f"{value / 1e9:.1f}"

    status = server.get("error") or "ok"
    return [
        server["label"],
        server["weights"],
        _num(server.get("start_s"), "{:.0f}"),
        gb(server.get("peak_rss_bytes")),
        gb(server.get("peak_pss_bytes")),
        status.splitlines()[0][:80],
    ]


def print_table(report: dict[str, Any]) -> None:
    """The results and server tables on the terminal (rich), then the skipped peers."""
    from rich.console import Console
    from rich.table import Table

    # Wide enough for every column even when stdout is a pipe (rich would assume 80 columns).
    console = Console(width=max(Console().width, 200))
    rows = report["results"]
    table = Table(title="flyspec bench-serve", title_justify="left")
    for col in RESULT_COLUMNS:
        table.add_column(col, justify="left" if col in ("server", "arm") else "right")
    for row in rows:
        table.add_row(*result_cells(rows, row))
    console.print(table)
    servers = Table(title="server starts", title_justify="left")
    for col in SERVER_COLUMNS:
        servers.add_column(col)
    for server in report["servers"]:
        servers.add_row(*server_cells(server))
    console.print(servers)
    for line in report["skipped"]:
        console.print(line, highlight=False)


def _md_table(header: tuple[str, ...], body: list[list[str]]) -> list[str]:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|",
    ]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return lines


def render_markdown(report: dict[str, Any]) -> str:
    """The serving comparison as a Markdown section (## heading) to paste into BENCHMARKS.md."""
    s = report["settings"]
    m = report["machine"]
    rows = report["results"]
    out = [
        "## Serving: flyspec, vLLM and llama.cpp behind the same client",
        "",
        f"Run {report['finished_at']} on {cpu_label(m)}, {m['memory_gb']} GB, "
        f"load average {m['load_average_start']} at the start and {m.get('load_average_end')} at the end.",
        f"Model {s['model']} (draft {s['draft']}, K={s['k']}); {s['num_prompts']} {s['dataset']} chat "
        f"prompts as token ids (sha256 {s['prompts_sha256'][:12]}), {s['max_tokens']} new tokens, greedy, "
        f"ignore_eos, streamed /v1/completions, concurrency {', '.join(map(str, s['concurrency']))}, "
        f"{s['repeats']} repeat(s) per level, servers started one after the other.",
        "",
        "Command: `" + shlex.join(report["command"]) + "`",
        "",
    ]
    out += _md_table(RESULT_COLUMNS, [result_cells(rows, r) for r in rows])
    out += [
        "",
        "tokens/s: output tokens of all requests of a level over its wall time. flyspec / this: flyspec's "
        "tokens/s on the same method and arm at the same concurrency over this server's (llama.cpp runs "
        "its own Q4_K_M quantization, not the same weights); flyspec-int8 / this, flyspec-int4 / this: "
        "the same for flyspec with int8 or int4 weights quantized at load; flyspec-auto / this: with the "
        "format the load-time kernel check chose on this CPU (named in that server's log). TTFT, ITL (gap "
        "between streamed chunks), TPOT and e2e as `vllm bench serve` defines them. short: requests that "
        "stopped before max_tokens.",
        "",
    ]
    out += _md_table(SERVER_COLUMNS, [server_cells(sv) for sv in report["servers"]])
    out += [
        "",
        "start: seconds from spawn to the first healthy /health. Memory: the peak over the server's whole "
        "process tree while it ran (PSS splits pages the processes share).",
    ]
    if report["skipped"]:
        out += ["", *(f"- {line}" for line in report["skipped"])]
    return "\n".join(out) + "\n"
