"""`flyspec bench-shadow` runs end to end: its three processes start, every level is measured, the mirror
stores pairs, and the table names the CPU. Nothing is timed here (the benchmark's numbers live in
BENCHMARKS.md); only counts and the shape of the result are checked."""

from __future__ import annotations

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
