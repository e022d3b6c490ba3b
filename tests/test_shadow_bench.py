"""`flyspec bench-shadow` runs end to end: its three processes start, every level is measured, the mirror
stores pairs, and the table names the CPU. Nothing is timed here (the benchmark's numbers live in
BENCHMARKS.md); only counts and the shape of the result are checked."""

from __future__ import annotations

from flyspec.bench.scripted_openai import ANSWER, PIECES
from flyspec.bench.shadow_proxy import run_shadow_bench, to_markdown


def test_the_shadow_benchmark_measures_every_level() -> None:
    result = run_shadow_bench(levels=(1, 2), requests=10, rounds=2, sample=0.5)
    assert [r["concurrency"] for r in result["levels"]] == [1, 2]
    for level in result["levels"]:
        assert level["direct_rps"] > 0 and level["proxy_rps"] > 0
        assert level["direct_p50_ms"] <= level["direct_p99_ms"]
    # Warm-ups (10 requests per level) and rounds (2 x 10 per level) through the proxy, half drawn.
    assert 0 < result["settings"]["pairs_stored"] < 60
    table = to_markdown(result)
    assert result["machine"]["cpu"] in table and table.count("\n| ") == 3


def test_the_scripted_servers_answer_at_the_pace_asked() -> None:
    """``--first-ms`` and ``--gap-ms`` reach both scripted servers: no request, direct or through the proxy,
    can finish sooner than the first event's wait plus the gap after each content event (a lower bound
    that sleeps guarantee, not a timing of the machine), and the table says the pace."""
    words = len(f"base: {ANSWER}".split())
    events = len(range(0, words, -(-words // PIECES)))
    result = run_shadow_bench(levels=(1,), requests=4, rounds=1, sample=0.5, pace=(40.0, 5.0))
    (level,) = result["levels"]
    assert level["direct_p50_ms"] >= 40 + events * 5 and level["proxy_p50_ms"] >= 40 + events * 5
    assert result["settings"]["pace_ms"] == [40.0, 5.0]
    assert "first event after 40 ms, then every 5 ms" in to_markdown(result)
