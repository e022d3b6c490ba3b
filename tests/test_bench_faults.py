"""`python -m flyspec.bench.faults` (flyspec/bench/faults.py) end to end on the zoo's smallest model, its
own draft: the counted wave's settings, a positive token count, fault counts for all steps and for the
steps that prefilled nothing, and peak resident sizes, as the JSON line BENCHMARKS.md's counts come from.
What it proves is the command and its accounting, not a number."""

from __future__ import annotations

import json
import subprocess
import sys


def test_the_fault_count_runs_and_reports_per_1000_tokens() -> None:
    argv = [sys.executable, "-m", "flyspec.bench.faults", "--model", "smollm2-135m-instruct"]
    argv += ["--draft", "smollm2-135m-instruct", "--batch", "2", "--k", "2", "--max-tokens", "8"]
    argv += ["--threads", "2", "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["model"] == "smollm2-135m-instruct" and result["batch"] == 2
    assert result["tokens"] == 2 * 8 and 0 < result["decode_tokens"] <= result["tokens"]
    assert result["minor_faults_per_1k_tokens"] == 1000 * result["minor_faults"] / result["tokens"]
    assert result["decode_minor_faults_per_1k_tokens"] >= 0
    assert 0 < result["peak_rss_gb"] <= result["process_peak_rss_gb"]
