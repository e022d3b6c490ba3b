"""`flyspec bench-serve`: the serving benchmark, flyspec against vLLM and llama.cpp behind one client
(flyspec/bench/serving_bench.py runs it; this module parses the options and prints and writes the
results). Peers come from `make peers`; `--url` adds a server that is already running. Options are checked
before anything heavy is imported or started.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from flyspec.bench.peers import DEFAULT_METHODS, PEERS, method_names
from flyspec.bench.serving_bench import (
    DEFAULT_DRAFT,
    DEFAULT_MODEL,
    ServeSettings,
    ServingPlan,
    plan_serving,
    run_serving_bench,
)
from flyspec.cli.options import opt


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


Peers = Annotated[
    str, opt(f"Servers to start, comma list of {', '.join(PEERS)}; an uninstalled peer is skipped.")
]
Urls = Annotated[list[str] | None, opt("An OpenAI-compatible server already running (root URL); repeatable.")]
Methods = Annotated[
    str,
    opt(
        "Comma list of target, draft_model, ngram and lossy verification policies (fly, typical, any "
        "registered one; flyspec only, on the draft model); each peer runs those it supports."
    ),
]
Concurrency = Annotated[str, opt("Concurrent requests per level, e.g. 1,16,32.")]
Model = Annotated[str, opt("Target: zoo name or HF folder (bf16 safetensors).")]
Draft = Annotated[str, opt("Draft model for draft_model and lossy policies: zoo name or folder.")]
Gguf = Annotated[Path | None, opt("Target GGUF for llama.cpp (default: the zoo file).")]
GgufDraft = Annotated[Path | None, opt("Draft GGUF for llama.cpp (default: the zoo file).")]
K = Annotated[int, opt("Speculative tokens per step (num_speculative_tokens).")]
MaxTokens = Annotated[int, opt("New tokens per request.")]
Dataset = Annotated[str, opt("Prompt set: gate dataset name or path.")]
Waves = Annotated[int, opt("Requests per level: this many times the concurrency...")]
MinRequests = Annotated[int, opt("...and at least this many.")]
Repeats = Annotated[int, opt("Runs of each level per arm (arms interleaved; median kept).")]
WarmupTokens = Annotated[int, opt("max_tokens of the unmeasured warm-up requests.")]
MaxModelLen = Annotated[int, opt("Context per sequence given to every server.")]
Dtype = Annotated[str, opt("Weight dtype for flyspec and vLLM.")]
Threads = Annotated[int | None, opt("CPU threads for vLLM and llama.cpp (default: usable cores).")]
StartTimeout = Annotated[float, opt("Seconds a server may take to become healthy.")]
ApiKey = Annotated[str | None, opt("Bearer key for --url servers.")]
JsonPath = Annotated[Path | None, typer.Option("--json", help="Write the full report (every request) here.")]
Markdown = Annotated[Path | None, opt("Write the Markdown section for BENCHMARKS.md here.")]
LogDir = Annotated[Path | None, opt("Server logs (default: PEERS_DIR/logs/serving).")]
DryRun = Annotated[bool, opt("Print the planned server starts and exit.")]


def bench_serve(
    peer: Peers = ",".join(PEERS),
    url: Urls = None,
    methods: Methods = ",".join(DEFAULT_METHODS),
    concurrency: Concurrency = "1,16,32",
    model: Model = DEFAULT_MODEL,
    draft: Draft = DEFAULT_DRAFT,
    gguf: Gguf = None,
    gguf_draft: GgufDraft = None,
    k: K = 4,
    max_tokens: MaxTokens = 128,
    dataset: Dataset = "gsm8k",
    waves: Waves = 2,
    min_requests: MinRequests = 8,
    repeats: Repeats = 1,
    warmup_tokens: WarmupTokens = 16,
    max_model_len: MaxModelLen = 1024,
    dtype: Dtype = "bfloat16",
    threads: Threads = None,
    start_timeout: StartTimeout = 900.0,
    api_key: ApiKey = None,
    json_path: JsonPath = None,
    markdown: Markdown = None,
    log_dir: LogDir = None,
    dry_run: DryRun = False,
) -> None:
    """Serving throughput and latency of flyspec, vLLM and llama.cpp on the same prompts and client.

    Every request: the prompt as token ids on /v1/completions, streamed, greedy, max_tokens new tokens
    with ignore_eos. Reports aggregate and per-request tokens/s, TTFT, ITL, TPOT, end-to-end latency,
    and each server's start time and peak memory.
    """
    settings = ServeSettings(
        peers=parse_names("--peer", peer, PEERS), urls=tuple(url or ()),
        methods=parse_names("--methods", methods, method_names()), levels=parse_levels(concurrency),
        model=model, draft=draft, gguf=gguf, gguf_draft=gguf_draft, k=k, max_tokens=max_tokens,
        dataset=dataset, waves=waves, min_requests=min_requests, repeats=repeats,
        warmup_tokens=warmup_tokens, max_model_len=max_model_len, dtype=dtype, threads=threads,
        start_timeout=start_timeout, api_key=api_key, log_dir=log_dir,
    )  # fmt: skip
    plan = plan_serving(settings)
    for line in plan.skipped:
        print(line, file=sys.stderr)
    if dry_run:
        _print_plan(plan)
        return
    if not plan.servers:
        raise ValueError("nothing to run: every requested peer was skipped (see above)")
    from flyspec.bench.serving_report import print_table, render_markdown

    started = time.monotonic()

    def say(text: str) -> None:
        print(f"[{time.monotonic() - started:7.0f} s] {text}", file=sys.stderr, flush=True)

    def save(report: dict[str, Any]) -> None:
        if json_path is not None:  # after every server: a long run that breaks later keeps what it measured
            json_path.write_text(json.dumps(report, indent=2) + "\n")

    report = run_serving_bench(settings, plan, ["flyspec", *sys.argv[1:]], say, save)
    print_table(report)
    if markdown is not None:
        markdown.write_text(render_markdown(report))


def _print_plan(plan: ServingPlan) -> None:
    """--dry-run: each planned server start, one line each."""
    for server in plan.servers:
        arms = ", ".join(a.name for a in server.arms)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in server.env.items())
        where = f"{env} {shlex.join(server.argv)}".strip() if server.argv else server.url
        print(f"{server.label} [{arms}] ({server.weights}): {where}")
