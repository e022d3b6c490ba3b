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


def test_demo_arms_quantize_both_arms_alike_and_share_one_engine() -> None:
    """ "auto" (the demo's default) and an explicit format reach both arms' engine config, arms that differ
    only in the verifier still share one engine, and an arm with other weights does not join it; an
    explicit "none" (None) stays out of the settings, so runs registered before quantization existed keep
    theirs."""
    from flyspec.gate.arms.engine import engine_groups
    from flyspec.gate.arms.registry import parse_arm

    names = ("baseline", "candidate")
    auto = [parse_arm(n, a) for n, a in zip(names, demo_arms("t", "d", 4, "bfloat16", 8), strict=True)]
    assert [a.config["quantization"] for a in auto] == ["auto", "auto"]
    assert len(engine_groups(auto)) == 1
    base, cand = demo_arms("t", "d", 4, "bfloat16", 8, "int8")
    arms = [parse_arm("baseline", base), parse_arm("candidate", cand)]
    assert [a.engine_config.quantization for a in arms] == ["int8", "int8"]
    assert [a.config["quantization"] for a in arms] == ["int8", "int8"]
    assert len(engine_groups(arms)) == 1
    plain = parse_arm("plain", demo_arms("t", "d", 4, "bfloat16", 8, None)[1])
    assert "quantization" not in plain.config
    assert len(engine_groups([*arms, plain])) == 2


def test_demo_runs_on_tiny_models_and_resumes(tmp_path: Path) -> None:
    """`flyspec demo --questions 2` on tiny models runs the sequential gate: it registers a sequential run
    of at most 2 GSM8K questions in a seeded order, stores both arms' answers, prints the report with a
    decision, the newcomer's explanation and the speed of both arms, ends with the JSON report (decision
    object last, `sequential` object beside it), and a second run answers nothing again (the stopped run
    is recomputed from the store). The report says which weights ran and how much prefill the two arms'
    shared prompts saved."""
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
    report = json.loads(first.stdout.strip().splitlines()[-1])
    decision = report["decision"]
    assert decision["n"] == 2 and decision["design"] == "sequential"
    assert decision["decision"] == "INCONCLUSIVE"  # 2 questions cannot clear a 2-point margin
    assert (report["sequential"]["max_questions"], report["sequential"]["stopped_at"]) == (2, 2)
    assert report["sequential"]["reason"] == "max_questions"
    assert report["registration"]["sequential"]["margin"] == 0.02
    assert "What this means" in first.stdout
    assert f"Decision: {decision['decision']}. The run stopped after 2 of at most 2 questions" in first.stdout
    assert "Standard speculative decoding: " in first.stdout and "FLy: " in first.stdout
    # Both arms send the same prompts (and every prompt starts with the chat template), so blocks are shared.
    cache = report["run_notes"]["prefix_cache"]
    assert 0 < cache["hits"] < cache["queries"]
    assert "Prefix sharing: both arms send every question's prompt" in first.stdout
    assert "Weights: target float32, draft float32" in first.stdout

    second = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0, second.stderr
    assert "already stopped after 2 questions" in second.stderr
    assert json.loads(second.stdout.strip().splitlines()[-1])["decision"] == decision


@pytest.mark.slow
def test_ctrl_c_during_the_warm_up_stops_the_demo_within_2_s(tmp_path: Path) -> None:
    """SIGINT the moment `flyspec demo` (SmolLM2 as target and draft) says its warm-up started ends the
    process within 2 s with exit code 130 and an 'interrupted' line, after phase lines that each carry
    their time; nothing was stored, so a rerun starts the same run afresh."""
    import signal
    import time

    from zoo import SMOLLM2, zoo_model

    folder = str(zoo_model(SMOLLM2))
    main = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from flyspec.cli import main; main()"
    )  # a test run in the background inherits SIGINT ignored; the child installs Python's handler
    command = [
        sys.executable, "-c", main, "demo", "--target", folder, "--draft", folder, "--questions", "4",
        "--quantization", "none", "--store", str(tmp_path / "demo.db"), "--no-progress",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    said = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            said.append(line)
            if "warm-up:" in line:
                break
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    err = "".join(said) + rest
    assert proc.returncode == 130, err
    assert took <= 2.0, f"exited {took:.2f} s after SIGINT"
    assert "interrupted" in rest and "Traceback" not in err
    assert any(line.startswith("[") and "load " in line and " s" in line for line in said), err
