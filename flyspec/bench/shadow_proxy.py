"""The shadow proxy's cost (`flyspec bench-shadow`): added latency (p50, p99) and throughput of streamed
chat requests through `flyspec gate shadow` against the same requests sent to the baseline directly, at
each concurrency, on loopback.

Three processes: a scripted baseline and a scripted candidate (flyspec/bench/scripted_openai.py: fixed
streamed answers, by default with no generation time, so the proxy's own cost is all that differs; or at a
model's pace, a first event after ``first_ms`` and the next ones ``gap_ms`` apart, where the client, the
servers and the proxy no longer queue on the same cores as they do against answers that take nothing)
and the shadow process, mirroring a share of the requests. The client runs in this process. Direct and
proxied rounds alternate, so drift in the machine's load falls on both.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from flyspec.bench.machine import cpu_label, describe_machine
from flyspec.bench.peers import free_port, wait_ready
from flyspec.gate.data.ledger import LEDGER_ENV

BODY = {"model": "base", "messages": [{"role": "user", "content": "What is 6 x 7?"}], "stream": True}
CLI = [sys.executable, "-c", "from flyspec.cli import main; main()"]


@contextlib.contextmanager
def _process(argv: list[str], url: str, log: Path, env: dict[str, str] | None = None) -> Iterator[None]:
    with open(log, "w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_ready(url, process, 60, log)
        yield
    finally:
        process.terminate()
        process.wait(timeout=30)


def _scripted(name: str, first_ms: float, gap_ms: float) -> tuple[list[str], str]:
    port = free_port()
    argv = [sys.executable, "-m", "flyspec.bench.scripted_openai", name, str(port), str(first_ms)]
    argv.append(str(gap_ms))
    return argv, f"http://127.0.0.1:{port}"


async def _drive(url: str, concurrency: int, requests: int) -> tuple[list[float], float]:
    """Send ``requests`` streamed chat requests with ``concurrency`` in flight; (latencies, wall seconds)."""
    latencies: list[float] = []
    remaining = iter(range(requests))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:

        async def worker() -> None:
            for i in remaining:
                start = time.perf_counter()
                body = {**BODY, "seed": i}  # distinct bodies, as real traffic: the share drawn is --sample
                async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
                    async for _chunk in response.aiter_raw():
                        pass
                    assert response.status_code == 200, response.status_code
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - start


def _quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def _summary(direct: dict[str, Any], proxy: dict[str, Any], concurrency: int) -> dict[str, Any]:
    out: dict[str, Any] = {"concurrency": concurrency}
    for name, runs in (("direct", direct), ("proxy", proxy)):
        out[f"{name}_p50_ms"] = 1000 * _quantile(runs["latencies"], 0.50)
        out[f"{name}_p99_ms"] = 1000 * _quantile(runs["latencies"], 0.99)
        out[f"{name}_rps"] = len(runs["latencies"]) / runs["wall"]
    out["added_p50_ms"] = out["proxy_p50_ms"] - out["direct_p50_ms"]
    out["added_p99_ms"] = out["proxy_p99_ms"] - out["direct_p99_ms"]
    out["throughput_ratio"] = out["proxy_rps"] / out["direct_rps"]
    return out


def run_shadow_bench(
    levels: tuple[int, ...] = (1, 8, 32),
    requests: int = 400,
    rounds: int = 3,
    sample: float = 1.0,
    pace: tuple[float, float] = (0.0, 0.0),
) -> dict[str, Any]:
    """Measure the proxy at each concurrency of ``levels``: ``rounds`` alternating direct and proxied
    rounds of ``requests`` requests each, after a warm-up; the shadow mirrors ``sample`` of them. The
    scripted servers answer at ``pace`` (milliseconds to the first event, between events)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        base_argv, base = _scripted("base", *pace)
        cand_argv, cand = _scripted("cand", *pace)
        port = free_port()
        proxy = f"http://127.0.0.1:{port}"
        shadow_argv = [*CLI, "gate", "shadow", "--baseline", f'{{"base_urls": ["{base}"], "model": "base"}}']
        shadow_argv += ["--candidate", f'{{"base_urls": ["{cand}"], "model": "cand"}}', "--port", str(port)]
        shadow_argv += ["--store", str(folder / "pairs.db"), "--sample", str(sample)]
        # Both scripted answers end in the number 42, so every pair is graded equal, and a run at this
        # margin needs far more pairs than a benchmark sends to PASS: every sampled request is mirrored
        # throughout, as while a real run has not decided.
        shadow_argv += ["--margin", "0.0001", "--grader", "equivalent_to_baseline:last_number"]
        # The benchmark's runs are not looks at a comparison anyone decides on: a ledger of their own.
        env = {**os.environ, LEDGER_ENV: str(folder / "ledger.sqlite")}
        with (
            _process(base_argv, base, folder / "base.log"),
            _process(cand_argv, cand, folder / "cand.log"),
            _process(shadow_argv, proxy, folder / "shadow.log", env),
        ):
            machine = describe_machine("cpu")
            results = []
            for concurrency in levels:
                asyncio.run(_drive(proxy, concurrency, min(requests, 50)))  # warm-up: pools, caches
                asyncio.run(_drive(base, concurrency, min(requests, 50)))
                runs: dict[str, dict[str, Any]] = {
                    t: {"latencies": [], "wall": 0.0} for t in ("direct", "proxy")
                }
                for turn in range(rounds):
                    order = (("direct", base), ("proxy", proxy))
                    for target, url in order if turn % 2 == 0 else order[::-1]:
                        latencies, wall = asyncio.run(_drive(url, concurrency, requests))
                        runs[target]["latencies"] += latencies
                        runs[target]["wall"] += wall
                results.append(_summary(runs["direct"], runs["proxy"], concurrency))
            pairs = httpx.get(proxy + "/metrics").text
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    stored = next(
        (line.split()[-1] for line in pairs.splitlines() if line.startswith("flyspec_shadow_pairs_total")),
        "0",
    )
    settings = {"requests": requests, "rounds": rounds, "sample": sample, "pace_ms": list(pace)}
    settings["pairs_stored"] = float(stored)
    return {"machine": machine, "settings": settings, "levels": results}


def to_markdown(result: dict[str, Any]) -> str:
    """The result as a BENCHMARKS.md table, the CPU named."""
    lines = [
        f"Shadow proxy on loopback, {cpu_label(result['machine'])}; streamed chat requests, "
        f"{result['settings']['requests']} x {result['settings']['rounds']} per level and target, "
        f"share mirrored {result['settings']['sample']:g}; " + _pace_words(result["settings"]["pace_ms"]),
        "",
        "| concurrency | direct p50 ms | proxy p50 ms | added p50 ms | direct p99 ms | proxy p99 ms "
        "| added p99 ms | direct req/s | proxy req/s | throughput ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = ("direct_p50_ms", "proxy_p50_ms", "added_p50_ms", "direct_p99_ms", "proxy_p99_ms", "added_p99_ms")
    for r in result["levels"]:
        cells = [str(r["concurrency"]), *(f"{r[k]:.2f}" for k in keys)]
        cells += [f"{r['direct_rps']:.0f}", f"{r['proxy_rps']:.0f}", f"{r['throughput_ratio']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pace_words(pace_ms: list[float]) -> str:
    if not any(pace_ms):
        return "scripted answers with no generation time."
    first, gap = pace_ms
    return f"scripted answers at a model's pace: first event after {first:g} ms, then every {gap:g} ms."
