"""`flyspec bench-serve` as functions: the serving benchmark, flyspec against vLLM and llama.cpp behind one
client (docs/performance.md).

``plan_serving`` resolves the models and plans each server start (never two at once: on a small machine
they would share the cores); a peer that is not installed is skipped with one line saying how to install
it, and a server given by URL is added as it is (its start time and memory are then not known).
``run_serving_bench`` starts each server in turn, waits until it is healthy, drives it with the same
token-id prompts at each concurrency level, and stops it. Settings are checked before anything heavy is
imported or started; their errors name the command-line options.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from flyspec.bench.peers import (
    DEFAULT_METHODS,
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
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEMA = "flyspec-bench-serve/1"
Say = Callable[[str], None]


@dataclass(frozen=True)
class ServeSettings:
    """One serving benchmark: which servers (``peers`` to start, ``urls`` already running) with which
    ``methods``, the concurrency ``levels``, the models, and the requests (``max_tokens`` new tokens each;
    per level ``waves`` times the concurrency and at least ``min_requests``, ``repeats`` times per arm after
    an unmeasured warm-up of ``warmup_tokens``)."""

    peers: tuple[str, ...] = PEERS
    urls: tuple[str, ...] = ()
    methods: tuple[str, ...] = DEFAULT_METHODS
    levels: tuple[int, ...] = (1, 16, 32)
    model: str = DEFAULT_MODEL
    draft: str = DEFAULT_DRAFT
    gguf: Path | None = None
    gguf_draft: Path | None = None
    k: int = 4
    max_tokens: int = 128
    dataset: str = "gsm8k"
    waves: int = 2
    min_requests: int = 8
    repeats: int = 1
    warmup_tokens: int = 16
    max_model_len: int = 1024
    dtype: str = "bfloat16"
    threads: int | None = None
    start_timeout: float = 900.0
    api_key: str | None = None
    log_dir: Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name, value in (
            ("--k", self.k),
            ("--max-tokens", self.max_tokens),
            ("--waves", self.waves),
            ("--repeats", self.repeats),
            ("--min-requests", self.min_requests),
            ("--warmup-tokens", self.warmup_tokens),
        ):
            if value < 1:
                raise ValueError(f"{name}={value}: must be >= 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype={self.dtype!r}: must be one of {', '.join(DTYPES)}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads={self.threads}: must be >= 1")
        if self.max_model_len <= self.max_tokens:
            raise ValueError(
                f"--max-model-len={self.max_model_len}: must exceed --max-tokens ({self.max_tokens})"
            )

    def requests(self, concurrency: int) -> int:
        """Requests at one level: ``waves`` full waves of ``concurrency``, never fewer than
        ``min_requests``."""
        return requests_for(concurrency, self.waves, self.min_requests)

    @property
    def needs_draft(self) -> bool:
        return any(m not in ("target", "ngram") for m in self.methods)


def requests_for(concurrency: int, waves: int, min_requests: int) -> int:
    """Requests per level: `waves` full waves of `concurrency`, and never fewer than `min_requests`."""
    return max(min_requests, waves * concurrency)


@dataclass
class ServingPlan:
    """The server starts of a benchmark, the lines saying what was skipped and why, and what the plans
    were made from."""

    servers: list[ServerPlan]
    skipped: list[str]
    inputs: PlanInputs


def plan_serving(settings: ServeSettings) -> ServingPlan:
    """Every server start (``plan_servers``), then the given URLs; peers that cannot run are skipped."""
    from flyspec.assets import resolve_model

    root = peers_dir()
    skipped: list[str] = []
    runnable = []
    for name in settings.peers:
        reason = missing_peer(name, root)
        if reason:
            skipped.append(reason)
        else:
            runnable.append(name)
    target_dir = resolve_model(settings.model)
    draft_dir = resolve_model(settings.draft) if settings.needs_draft else None
    target_gguf = draft_gguf = None
    if "llama.cpp" in runnable:
        target_gguf = _gguf(settings.model, settings.gguf, root, skipped)
        draft_gguf = (
            _gguf(settings.draft, settings.gguf_draft, root, skipped) if settings.needs_draft else None
        )
        if target_gguf is None:
            runnable.remove("llama.cpp")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    inputs = PlanInputs(
        target_dir=target_dir,
        draft_dir=draft_dir,
        target_gguf=target_gguf,
        draft_gguf=draft_gguf,
        k=settings.k,
        max_concurrency=max(settings.levels),
        max_model_len=settings.max_model_len,
        threads=settings.threads or usable,
        root=root,
        dtype=settings.dtype,
    )
    servers = plan_servers(tuple(runnable), settings.methods, inputs)
    servers += [
        ServerPlan("url", u, "as served", (ArmSpec("target"),), url=u.rstrip("/")) for u in settings.urls
    ]
    return ServingPlan(servers, skipped, inputs)


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


@dataclass
class _Level:
    """What every request of one level on one server needs."""

    url: str
    model: str
    settings: ServeSettings
    prompts: list[list[int]]
    warmup: list[list[int]]


def run_serving_bench(
    settings: ServeSettings,
    plan: ServingPlan,
    command: list[str],
    say: Say,
    on_report: Callable[[dict[str, Any]], None] = lambda report: None,
) -> dict[str, Any]:
    """Run every planned server in turn and return the report (``command`` recorded in it); ``on_report``
    gets the report so far after each server, so a long run that breaks later keeps what it measured."""
    from flyspec.bench.machine import describe_machine
    from flyspec.bench.prompts import load_prompts, prompts_sha256
    from flyspec.models.tokenizer import load_tokenizer

    largest = max(settings.requests(c) for c in settings.levels)
    warm_n = min(max(settings.levels), 4)
    loaded = load_prompts(settings.dataset, largest + warm_n, load_tokenizer(plan.inputs.target_dir))
    measured, warm = loaded[:largest], loaded[largest:]
    too_long = [p.id for p in loaded if len(p.token_ids) + settings.max_tokens > settings.max_model_len]
    if too_long:
        raise ValueError(
            f"--max-model-len={settings.max_model_len}: prompts {too_long[:3]} need more than that with "
            f"{settings.max_tokens} new tokens; raise it"
        )
    machine = describe_machine("cpu")
    logs = settings.log_dir or plan.inputs.root / "logs" / "serving"
    started = time.monotonic()
    header = {"schema": SCHEMA, "command": command}
    described = _settings_json(settings, plan, len(measured), prompts_sha256(measured))
    servers: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    report: dict[str, Any] = {}
    prompts, warmup = [p.token_ids for p in measured], [p.token_ids for p in warm]
    for server_plan in plan.servers:
        server, server_rows = _run_server(server_plan, settings, prompts, warmup, logs, say)
        servers.append(server)
        rows += server_rows
        machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        report = {
            **header,
            "finished_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "elapsed_s": time.monotonic() - started,
            "complete": len(servers) == len(plan.servers),
            "machine": machine,
            "settings": described,
            "servers": servers,
            "skipped": plan.skipped,
            "results": median_rows(rows),
            "runs": rows,
        }
        on_report(report)
    return report


def _settings_json(settings: ServeSettings, plan: ServingPlan, prompts: int, sha256: str) -> dict[str, Any]:
    """The report's ``settings`` object."""
    return {
        "model": settings.model,
        "draft": settings.draft,
        "k": settings.k,
        "peers": list(settings.peers),
        "methods": list(settings.methods),
        "concurrency": list(settings.levels),
        "requests_per_level": {str(c): settings.requests(c) for c in settings.levels},
        "max_tokens": settings.max_tokens,
        "dataset": settings.dataset,
        "num_prompts": prompts,
        "prompts_sha256": sha256,
        "repeats": settings.repeats,
        "warmup_tokens": settings.warmup_tokens,
        "max_model_len": settings.max_model_len,
        "dtype": settings.dtype,
        "threads": plan.inputs.threads,
    }


def _run_server(
    plan: ServerPlan,
    settings: ServeSettings,
    prompts: list[list[int]],
    warmup: list[list[int]],
    log_dir: Path,
    say: Say,
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
        with start_server(plan, log_path, timeout_s=settings.start_timeout) as running:
            server["start_s"] = running.start_s
            say(f"{plan.label}: ready" + (f" in {running.start_s:.0f} s" if running.start_s else ""))
            model = serving.served_model(running.url, settings.api_key)
            level = _Level(running.url, model, settings, prompts, warmup)
            for concurrency in settings.levels:
                rows += _run_level(plan, level, concurrency, say)
            if running.memory is not None:
                running.memory.sample()
                server["peak_rss_bytes"] = running.memory.peak_rss
                server["peak_pss_bytes"] = running.memory.peak_pss
    except (RuntimeError, httpx.HTTPError) as exc:  # failed to start or died: reported, and the run goes on
        server["error"] = str(exc)
        say(f"{plan.label}: FAILED: {str(exc).splitlines()[0]}")
    return server, rows


def _run_level(plan: ServerPlan, level: _Level, concurrency: int, say: Say) -> list[dict[str, Any]]:
    """One concurrency level on a running server: each arm warmed up, then ``repeats`` measured runs of
    every arm, the order rotating."""
    from flyspec.bench import serving

    s = level.settings
    chosen = [level.prompts[i % len(level.prompts)] for i in range(s.requests(concurrency))]
    for arm in plan.arms:  # warm-up: batched paths and caches, not measured
        warm = level.warmup[: min(concurrency, len(level.warmup))]
        serving.run_level_sync(
            level.url, level.model, warm, concurrency, s.warmup_tokens, arm.extra_body, s.api_key
        )
    rows = []
    for rep in range(s.repeats):
        shift = rep % len(plan.arms)
        for arm in plan.arms[shift:] + plan.arms[:shift]:
            before = serving.spec_counters(level.url)
            result = serving.run_level_sync(
                level.url, level.model, chosen, concurrency, s.max_tokens, arm.extra_body, s.api_key
            )
            after = serving.spec_counters(level.url)
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
                f"{plan.label} {arm.name} c={concurrency} run {rep + 1}: "
                f"{row['tokens_per_s']:.2f} tok/s, TTFT {row['ttft_mean_s'] or 0:.2f} s, "
                f"{row['short_requests']} short, {row['errors']} errors"
            )
    return rows


def median_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
