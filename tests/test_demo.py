"""`flyspec demo` end to end on tiny models: the main job's plumbing, not its numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_llm import save_perturbed, save_tiny

from flyspec.cli.demo import demo_arms


def test_demo_arms_differ_only_in_the_verifier() -> None:
    """The two arms must be the same configuration but for rejection_sample_method, or the gate would
    compare more than the verifier (and could not share one engine)."""
    base, cand = demo_arms("t", "d", 4, "bfloat16", 8)
    assert base["speculative_config"].pop("rejection_sample_method") == "standard"
    assert cand["speculative_config"].pop("rejection_sample_method") == "fly"
    assert base == cand


@pytest.mark.slow
def test_demo_runs_on_tiny_models_and_resumes(tmp_path: Path) -> None:
    """`flyspec demo --questions 2` on tiny models stores both arms' answers, prints the report with a
    decision and the newcomer's explanation, ends with the JSON decision object, and a second run
    answers nothing again (it resumes from the store)."""
    target = save_tiny(tmp_path / "target", seed=0)
    draft = save_perturbed(target, tmp_path / "draft", seed=1, noise=0.05)
    store = tmp_path / "demo.db"
    command = [
        sys.executable, "-c", "from flyspec.cli import main; main()", "demo",
        "--questions", "2", "--target", str(target), "--draft", str(draft), "--max-tokens", "8",
        "--dtype", "float32", "--store", str(store), "--json",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert first.returncode == 0, first.stderr
    decision = json.loads(first.stdout.strip().splitlines()[-1])["decision"]
    assert decision["n"] == 2
    assert decision["decision"] in {"PASS", "FAIL", "INCONCLUSIVE"}
    assert "What this means" in first.stdout
    assert f"Decision: {decision['decision']}" in first.stdout

    second = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0, second.stderr
    assert json.loads(second.stdout.strip().splitlines()[-1])["decision"] == decision
