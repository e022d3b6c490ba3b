"""`flyspec bench-serve`: the serving benchmark, flyspec against vLLM and llama.cpp behind one client.

It starts each server in turn (never two at once: on a small machine they would share the cores),
waits until it is healthy, drives it with the same token-id prompts at each concurrency level, and
stops it. Peers come from `make peers`; a peer that is not installed is skipped with one line saying
how to install it. `--url` adds a server that is already running (its start time and memory are then
not known). Options are checked before anything heavy is imported or started.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from flyspec.bench.peers import (
    METHODS,
    PEERS,
    ArmSpec,
    PlanInputs,
    ServerPlan,
    missing_peer,
    peers_dir,
    plan_servers,
)

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


def parse_names(option: str, text: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """A comma list of names from `allowed`, in the given order; ValueError naming the option."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise ValueError(f"{option} is empty: give one or more of {', '.join(allowed)}")
    for name in names:
        if name not in allowed:
            raise ValueError(f"{option}: {name!r} is not one of {', '.join(allowed)}")
    return tuple(dict.fromkeys(names))


def parse_levels(text: str) -> tuple[int, ...]:
    """--concurrency as positive integers, e.g. "1,16,32"."""
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--concurrency={text!r}: must be a comma list of integers, e.g. 1,16,32") from None
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"--concurrency={text!r}: every level must be >= 1")
    return tuple(dict.fromkeys(levels))


def requests_for(concurrency: int, waves: int, min_requests: int) -> int:
    """Requests per level: `waves` full waves of `concurrency`, and never fewer than `min_requests`."""
    return max(min_requests, waves * concurrency)


def _tokenizer(folder: Path) -> Any:
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    # As the model loader does: the Mistral regex fix concerns Mistral tokenizers only.
    extra = {} if config.model_type == "mistral" else {"fix_mistral_regex": False}
    return transformers.AutoTokenizer.from_pretrained(folder, **extra)


def _gguf(name: str | None, given: Path | None, root: Path, skipped: list[str]) -> Path | None:
    """The GGUF llama.cpp serves: the given file, or the zoo model's assembled file."""
    from flyspec.assets import ZOO
    from flyspec.bench.peers import assembled_gguf

    if given is not None:
        if not given.is_file():
            raise ValueError(f"--gguf {given}: no such file")
        return given
    if name not in ZOO:
        skipped.append(
            f"llama.cpp: skipped for {name}: not a zoo model; pass its GGUF file with --gguf/--gguf-draft"
        )
        return None
    try:
        return assembled_gguf(name, root)
    except ValueError as exc:
        skipped.append(f"llama.cpp: skipped, no GGUF for {name}: {exc}")
        return None


def _run_server(
    plan: ServerPlan,
    levels: tuple[int, ...],
    prompts: list[list[int]],
    warmup: list[list[int]],
    opts: dict[str, Any],
    log_dir: Path,
    say: Any,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Start one server, run every level (arms interleaved, rotating which goes first), stop it."""
    import httpx

    from flyspec.bench import serving
    from flyspec.bench.peers import start_server

    slug = plan.label.replace(" ", "-").replace(".", "")
    log_path = log_dir / f"{slug}.log"
    server: dict[str, Any] = {
        "peer": plan.peer,
        "method": plan.method,
        "label": plan.label,
        "weights": plan.weights,
        "argv": list(plan.argv) if plan.argv else None,
        "env": plan.env,
        "url": plan.url,
        "log": str(log_path) if plan.argv else None,
    }
    rows: list[dict[str, Any]] = []
    say(f"{plan.label}: starting" + (f" (log {log_path})" if plan.argv else f" at {plan.url}"))
    try:
        with start_server(plan, log_path, timeout_s=opts["start_timeout"]) as running:
            server["start_s"] = running.start_s
            say(f"{plan.label}: ready" + (f" in {running.start_s:.0f} s" if running.start_s else ""))
            model = serving.served_model(running.url, opts["api_key"])
            for level in levels:
                n = requests_for(level, opts["waves"], opts["min_requests"])
                chosen = [prompts[i % len(prompts)] for i in range(n)]
                for arm in plan.arms:  # warm-up: batched paths and caches, not measured
                    serving.run_level_sync(
                        running.url,
                        model,
                        warmup[: min(level, len(warmup))],
                        level,
                        opts["warmup_tokens"],
                        arm.extra_body,
                        opts["api_key"],
                    )
                for rep in range(opts["repeats"]):
                    shift = rep % len(plan.arms)
                    for arm in plan.arms[shift:] + plan.arms[:shift]:
                        before = serving.spec_counters(running.url)
                        result = serving.run_level_sync(
                            running.url,
                            model,
                            chosen,
                            level,
                            opts["max_tokens"],
                            arm.extra_body,
                            opts["api_key"],
                        )
                        after = serving.spec_counters(running.url)
                        row = {
                            "peer": plan.peer,
                            "method": plan.method,
                            "arm": arm.name,
                            "weights": plan.weights,
                            "repeat": rep,
                            **serving.level_json(result),
                            **serving.acceptance(before, after),
                        }
                        rows.append(row)
                        say(
                            f"{plan.label} {arm.name} c={level} run {rep + 1}: "
                            f"{row['tokens_per_s']:.2f} tok/s, TTFT {row['ttft_mean_s'] or 0:.2f} s, "
                            f"{row['short_requests']} short, {row['errors']} errors"
                        )
            if running.memory is not None:
                running.memory.sample()
                server["peak_rss_bytes"] = running.memory.peak_rss
                server["peak_pss_bytes"] = running.memory.peak_pss
    except (RuntimeError, httpx.HTTPError) as exc:  # failed to start or died: reported, and the run goes on
        server["error"] = str(exc)
        say(f"{plan.label}: FAILED: {str(exc).splitlines()[0]}")
    return server, rows


def _median_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (peer, method, arm, concurrency): the repeat with the median tokens/s."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["peer"], row["method"], row["arm"], row["concurrency"]), []).append(row)
    out = []
    for runs in groups.values():
        ordered = sorted(runs, key=lambda r: r["tokens_per_s"] or 0.0)
        pick = {k: v for k, v in ordered[len(ordered) // 2].items() if k != "per_request"}
        pick["tokens_per_s_runs"] = [r["tokens_per_s"] for r in runs]
        out.append(pick)
    return out


def bench_serve(
    peer: Annotated[
        str,
        typer.Option(
            help=f"Servers to start, comma list of {', '.join(PEERS)}; an uninstalled peer is skipped."
        ),
    ] = ",".join(PEERS),
    url: Annotated[
        list[str] | None,
        typer.Option(help="An OpenAI-compatible server already running (root URL); repeatable."),
    ] = None,
    methods: Annotated[
        str, typer.Option(help=f"Comma list of {', '.join(METHODS)}; each peer runs those it supports.")
    ] = ",".join(METHODS),
    concurrency: Annotated[
        str, typer.Option(help="Concurrent requests per level, e.g. 1,16,32.")
    ] = "1,16,32",
    model: Annotated[
        str, typer.Option(help="Target: zoo name or HF folder (bf16 safetensors).")
    ] = DEFAULT_MODEL,
    draft: Annotated[
        str, typer.Option(help="Draft model for draft_model and fly: zoo name or folder.")
    ] = DEFAULT_DRAFT,
    gguf: Annotated[
        Path | None, typer.Option(help="Target GGUF for llama.cpp (default: the zoo file).")
    ] = None,
    gguf_draft: Annotated[
        Path | None, typer.Option(help="Draft GGUF for llama.cpp (default: the zoo file).")
    ] = None,
    k: Annotated[int, typer.Option(help="Speculative tokens per step (num_speculative_tokens).")] = 4,
    max_tokens: Annotated[int, typer.Option(help="New tokens per request.")] = 128,
    dataset: Annotated[str, typer.Option(help="Prompt set: gate dataset name or path.")] = "gsm8k",
    waves: Annotated[int, typer.Option(help="Requests per level: this many times the concurrency...")] = 2,
    min_requests: Annotated[int, typer.Option(help="...and at least this many.")] = 8,
    repeats: Annotated[
        int, typer.Option(help="Runs of each level per arm (arms interleaved; median kept).")
    ] = 1,
    warmup_tokens: Annotated[int, typer.Option(help="max_tokens of the unmeasured warm-up requests.")] = 16,
    max_model_len: Annotated[int, typer.Option(help="Context per sequence given to every server.")] = 1024,
    dtype: Annotated[str, typer.Option(help="Weight dtype for flyspec and vLLM.")] = "bfloat16",
    threads: Annotated[
        int | None, typer.Option(help="CPU threads for vLLM and llama.cpp (default: usable cores).")
    ] = None,
    start_timeout: Annotated[
        float, typer.Option(help="Seconds a server may take to become healthy.")
    ] = 900.0,
    api_key: Annotated[str | None, typer.Option(help="Bearer key for --url servers.")] = None,
    json_path: Annotated[
        Path | None, typer.Option("--json", help="Write the full report (every request) here.")
    ] = None,
    markdown: Annotated[
        Path | None, typer.Option(help="Write the Markdown section for BENCHMARKS.md here.")
    ] = None,
    log_dir: Annotated[
        Path | None, typer.Option(help="Server logs (default: PEERS_DIR/logs/serving).")
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="Print the planned server starts and exit.")] = False,
) -> None:
    """Serving throughput and latency of flyspec, vLLM and llama.cpp on the same prompts and client.

    Every request: the prompt as token ids on /v1/completions, streamed, greedy, max_tokens new tokens
    with ignore_eos. Reports aggregate and per-request tokens/s, TTFT, ITL, TPOT, end-to-end latency,
    and each server's start time and peak memory.
    """
    peers = parse_names("--peer", peer, PEERS)
    method_names = parse_names("--methods", methods, METHODS)
    levels = parse_levels(concurrency)
    for name, value in (
        ("--k", k),
        ("--max-tokens", max_tokens),
        ("--waves", waves),
        ("--repeats", repeats),
        ("--min-requests", min_requests),
        ("--warmup-tokens", warmup_tokens),
    ):
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype={dtype!r}: must be one of auto, float32, bfloat16, float16")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads={threads}: must be >= 1")
    if max_model_len <= max_tokens:
        raise ValueError(f"--max-model-len={max_model_len}: must exceed --max-tokens ({max_tokens})")

    from flyspec.assets import resolve_model

    root = peers_dir()
    skipped: list[str] = []
    runnable = []
    for name in peers:
        reason = missing_peer(name, root)
        if reason:
            skipped.append(reason)
        else:
            runnable.append(name)
    target_dir = resolve_model(model)
    needs_draft = "draft_model" in method_names or "fly" in method_names
    draft_dir = resolve_model(draft) if needs_draft else None
    target_gguf = draft_gguf = None
    if "llama.cpp" in runnable:
        target_gguf = _gguf(model, gguf, root, skipped)
        draft_gguf = _gguf(draft, gguf_draft, root, skipped) if needs_draft else None
        if target_gguf is None:
            runnable.remove("llama.cpp")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    inputs = PlanInputs(
        target_dir=target_dir,
        draft_dir=draft_dir,
        target_gguf=target_gguf,
        draft_gguf=draft_gguf,
        k=k,
        max_concurrency=max(levels),
        max_model_len=max_model_len,
        threads=threads or usable,
        root=root,
        dtype=dtype,
    )
    plans = plan_servers(tuple(runnable), method_names, inputs)
    plans += [ServerPlan("url", u, "as served", (ArmSpec("target"),), url=u.rstrip("/")) for u in url or []]
    for line in skipped:
        print(line, file=sys.stderr)
    if dry_run:
        for plan in plans:
            arms = ", ".join(a.name for a in plan.arms)
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env.items())
            where = f"{env} {shlex.join(plan.argv)}".strip() if plan.argv else plan.url
            print(f"{plan.label} [{arms}] ({plan.weights}): {where}")
        return
    if not plans:
        raise ValueError("nothing to run: every requested peer was skipped (see above)")

    from flyspec.bench.machine import describe_machine
    from flyspec.bench.prompts import load_prompts, prompts_sha256
    from flyspec.bench.serving_report import print_table, render_markdown

    largest = max(requests_for(c, waves, min_requests) for c in levels)
    warm_n = min(max(levels), 4)
    loaded = load_prompts(dataset, largest + warm_n, _tokenizer(target_dir))
    measured, warm = loaded[:largest], loaded[largest:]
    too_long = [p.id for p in loaded if len(p.token_ids) + max_tokens > max_model_len]
    if too_long:
        raise ValueError(
            f"--max-model-len={max_model_len}: prompts {too_long[:3]} need more than that with "
            f"{max_tokens} new tokens; raise it"
        )
    machine = describe_machine("cpu")
    logs = log_dir or root / "logs" / "serving"
    started = time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - started:7.0f} s] {text}", file=sys.stderr, flush=True)

    opts = {
        "max_tokens": max_tokens,
        "waves": waves,
        "min_requests": min_requests,
        "repeats": repeats,
        "warmup_tokens": warmup_tokens,
        "start_timeout": start_timeout,
        "api_key": api_key,
    }
    settings = {
        "model": model,
        "draft": draft,
        "k": k,
        "peers": list(peers),
        "methods": list(method_names),
        "concurrency": list(levels),
        "requests_per_level": {str(c): requests_for(c, waves, min_requests) for c in levels},
        "max_tokens": max_tokens,
        "dataset": dataset,
        "num_prompts": len(measured),
        "prompts_sha256": prompts_sha256(measured),
        "repeats": repeats,
        "warmup_tokens": warmup_tokens,
        "max_model_len": max_model_len,
        "dtype": dtype,
        "threads": inputs.threads,
    }
    servers: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {}
    for plan in plans:
        server, plan_rows = _run_server(
            plan, levels, [p.token_ids for p in measured], [p.token_ids for p in warm], opts, logs, say
        )
        servers.append(server)
        rows += plan_rows
        machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        report = {
            "schema": "flyspec-bench-serve/1",
            "command": ["flyspec", *sys.argv[1:]],
            "finished_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "elapsed_s": time.monotonic() - started,
            "complete": len(servers) == len(plans),
            "machine": machine,
            "settings": settings,
            "servers": servers,
            "skipped": skipped,
            "results": _median_rows(rows),
            "runs": rows,
        }
        if json_path is not None:  # after every server: a long run that breaks later keeps what it measured
            json_path.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    if markdown is not None:
        markdown.write_text(render_markdown(report))
