"""`flyspec bench-shadow`: what `flyspec gate shadow` adds to production's latency and takes from its
throughput (flyspec/bench/shadow_proxy.py runs it; this module parses the options, prints and writes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

from flyspec.cli.bench_serve import parse_levels
from flyspec.cli.options import opt

Levels = Annotated[str, opt("Concurrent streams, comma list, e.g. 1,8,32.")]
Requests = Annotated[int, opt("Requests per round, for each target (direct and through the proxy).")]
Rounds = Annotated[int, opt("Alternating rounds per concurrency level.")]
Sample = Annotated[float, opt("Share of requests the shadow mirrors to the candidate, in (0, 1].")]
FirstMs = Annotated[
    float, opt("Milliseconds the scripted servers wait before a stream's first event (0: answers at once).")
]
GapMs = Annotated[float, opt("Milliseconds between a stream's events (a model's pace; 0: all at once).")]
Output = Annotated[Path | None, opt("Write the result (machine, settings, levels) as JSON here.")]


def bench_shadow(
    concurrency: Levels = "1,8,32",
    requests: Requests = 400,
    rounds: Rounds = 3,
    sample: Sample = 1.0,
    first_ms: FirstMs = 0.0,
    gap_ms: GapMs = 0.0,
    output: Output = None,
) -> None:
    """Added latency (p50, p99) and throughput of streamed requests through `flyspec gate shadow`, against
    the same requests sent to the baseline directly, on loopback with scripted servers (no generation
    time, so the proxy's own cost is all that differs; --first-ms and --gap-ms give them a model's pace, so
    that the client, the servers and the proxy do not all queue on the same cores). Run it on an otherwise
    idle machine."""
    from flyspec.bench.shadow_proxy import run_shadow_bench, to_markdown

    levels = parse_levels(concurrency)
    for option, value in (("--requests", requests), ("--rounds", rounds)):
        if value < 1:
            raise ValueError(f"{option}={value}: must be at least 1")
    if not 0 < sample <= 1:
        raise ValueError(f"--sample={sample}: must be in (0, 1]")
    for option, ms in (("--first-ms", first_ms), ("--gap-ms", gap_ms)):
        if not 0 <= ms <= 60_000:
            raise ValueError(f"{option}={ms}: must be in [0, 60000] milliseconds")
    result = run_shadow_bench(levels, requests, rounds, sample, (first_ms, gap_ms))
    print(to_markdown(result))
    if output is not None:
        output.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {output}", file=sys.stderr)
