"""`flyspec demo` end to end on tiny models: the main job's plumbing, not its numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_llm import save_tiny

from flyspec.demo import design
from flyspec.demo.design import demo_arms


def test_demo_arms_share_one_engine_and_differ_only_in_who_decodes() -> None:
    """The three arms are one engine configuration (same models, K, dtype, weights): the baseline's requests
    are verified losslessly (standard), the control's decoded by the draft model alone, FLy's by the
    engine's lossy verifier. Arms that differ in anything else could not share the engine's batches."""
    from flyspec.gate.arms import parse_arm
    from flyspec.gate.arms.engine import engine_groups

    arms = demo_arms("t", "d", 4, "bfloat16", 8)
    assert [arms[n].get("verification") for n in ("baseline", "control", "candidate")] == [
        None,
        "draft_only",
        None,
    ]
    specs = {n: dict(a["speculative_config"]) for n, a in arms.items()}
    assert specs["candidate"].pop("rejection_sample_method") == "fly"
    for key in ("fly_window_size", "fly_entropy_threshold"):
        specs["candidate"].pop(key, None)
    assert (
        specs["baseline"].pop("rejection_sample_method")
        == "standard"
        == specs["control"].pop("rejection_sample_method")
    )
    assert specs["baseline"] == specs["control"] == specs["candidate"]
    parsed = [parse_arm(n, a) for n, a in arms.items()]
    (group,) = engine_groups(parsed)
    assert group[0].name == "candidate" and len(group) == 3
    assert [a.config["quantization"] for a in parsed] == ["auto"] * 3
    with pytest.raises(ValueError, match="verification='draft_only' needs a speculative_config with a draft"):
        parse_arm(
            "x", {**arms["control"], "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}
        )


def test_the_margin_is_the_narrowest_the_pool_can_decide() -> None:
    """Before the first answer the demo registers the narrowest margin whose design decides in 9 of 10
    simulated runs within GSM8K and MATH-500 at FLy's usual flip rate and no true loss: 2 points needs a
    median of thousands of questions more than the 1,819 the two sets hold, so it is not that one."""
    choice = design.choose_margin(1819, 0.16)
    assert 0.02 < choice.margin <= 0.06
    assert 1 - choice.outcome.undecided >= design.DECIDE_SHARE
    narrower = design.choose_margin(1819, 0.16, margin=choice.margin - 0.01)
    assert 1 - narrower.outcome.undecided < design.DECIDE_SHARE
    assert choice.two_points.median is not None and choice.two_points.median > 1819
    lines = design.opening_lines(choice, design.control_outlook(1819))
    text = " ".join(lines)
    assert f"FLy's margin {100 * choice.margin:g} points" in text and "1,819 questions" in text
    assert "A 2-point margin is out of reach here" in text and "GPU endpoint" in text
    timing = design.timing_line(choice, design.control_outlook(1819), 2.5)
    assert "2.5 questions a minute" in timing and "hours" in timing


def test_every_registered_setting_names_its_own_run_and_old_runs_keep_their_names() -> None:
    """The run id carries every registered setting, so the same command resumes and another starts a new
    run: the earlier demo's setting (K=4, vLLM's default window, threshold 0.3, both datasets) keeps its
    old name; the window, the threshold and a GSM8K-only pool each change it."""
    choice = design.choose_margin([(design.DATASETS, 1819)], 0.16)
    old = design.DemoSettings(fly=design.FlySetting(4, None, 0.3, 0.16))
    assert old.run_id(choice) == "demo-3arm-seq-nall-k4-t512-m0.05-s0-auto-qwen2.5-coder-1.5b-instruct"
    gsm8k = design.choose_margin([(design.DATASETS[:1], 1319)], design.PRIOR_FLIP_RATE)
    new = design.DemoSettings()
    assert new.run_id(gsm8k) == (
        "demo-3arm-seq-nall-k8-t512-m0.05-s0-w6-th0.6-auto-gsm8k-qwen2.5-coder-1.5b-instruct"
    )
    assert len({new.run_id(c) for c in (choice, gsm8k)} | {old.run_id(choice)}) == 3


def _exact_dataset(target: Path, path: Path, questions: int) -> Path:
    """Questions whose reference answer is the target's own greedy output (float32, 8 tokens): the
    baseline (standard speculative decoding, greedy: the target's own tokens) is right on every one, the
    control (an unrelated random draft model alone) almost never, and FLy as often as it keeps the
    target's tokens."""
    from flyspec import LLM, SamplingParams

    prompts = [
        f"question {i} " + " ".join(f"w{(7 * i + k) % 50}" for k in range(6)) for i in range(questions)
    ]
    llm = LLM(str(target), dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    rows = [
        {"id": f"q{i}", "prompt": p, "answer": o.outputs[0].text, "grader": "exact"}
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _demo_command(tmp_path: Path, *extra: str) -> list[str]:
    target = save_tiny(tmp_path / "target", seed=0, std=0.4)
    draft = save_tiny(tmp_path / "draft", seed=1, std=0.4)
    data = tmp_path / "own.jsonl"
    if not data.exists():
        _exact_dataset(target, data, 60)
    main = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from flyspec.cli import main; main()"
    )
    return [
        sys.executable, "-c", main, "demo", "--dataset", str(data), "--target", str(target),
        "--draft", str(draft), "--max-tokens", "8", "--dtype", "float32", "--quantization", "none",
        "--margin", "0.3", "--store", str(tmp_path / "demo.db"), "--no-progress", "--json", *extra,
    ]  # fmt: skip


def _wait_for_answers(proc: subprocess.Popen, store: Path, at_least: int) -> int:
    """Wait (at most 300 s) until the running demo has stored ``at_least`` answers; return how many."""
    import time

    from flyspec.gate.data.store import GateStore

    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, f"the demo ended before the signal: {proc.communicate()}"
        assert time.monotonic() < deadline, "no answers stored within 300 s"
        if store.exists():
            with GateStore(store) as opened:
                runs = opened.runs()
                stored = len(opened.answers(runs[0].run_id)) if runs else 0
            if stored >= at_least:
                return stored
        time.sleep(0.05)


@pytest.mark.slow
def test_the_demo_catches_its_control_first_and_resumes_to_a_decision(tmp_path: Path) -> None:
    """`flyspec demo --until-decided` end to end on tiny models and a dataset whose references are the
    target's own answers: its first lines state FLy's registered margin, the pool and the simulated
    questions and time to each decision on this machine; the control (the draft model alone) FAILs first
    and the report says "the gate caught a harmful setting" before it speaks of FLy; killed (SIGKILL)
    once answers are stored, the same command resumes from the store to the same decisions as a run
    that was never killed, with one stored row per question and arm."""
    import signal

    from flyspec.gate.data.store import GateStore

    command = _demo_command(tmp_path, "--until-decided")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    store = tmp_path / "demo.db"
    try:
        _wait_for_answers(proc, store, 12)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr
    said = done.stderr.splitlines()
    opening = len(design.opening_lines(*_opening_args()))
    text = "\n".join(said[:opening])
    assert "FLy's margin 30 points" in text and "60 questions in one seeded random order" in text
    assert "Control: the gate must FAIL it" in text and "FAILs after" in text
    timing = next(i for i, line in enumerate(said) if line.startswith("On this machine: about"))
    assert "questions a minute" in said[timing] and not any("gate:" in line for line in said[:timing])
    report = json.loads(done.stdout.strip().splitlines()[-1])
    (control,) = report["family"]
    assert control["role"] == "control" and control["decision"]["decision"] == "FAIL"
    assert report["decision"]["decision"] == "PASS"
    assert done.stdout.index("The gate caught a harmful setting") < done.stdout.index("FLy: PASS")
    with GateStore(store) as opened:
        run_id = opened.runs()[0].run_id
        keys = [(a.arm, a.question_id) for a in opened.answers(run_id)]
    assert len(keys) == len(set(keys))

    reference = tmp_path / "reference"
    reference.mkdir()
    for name in ("target", "draft", "own.jsonl"):
        (reference / name).symlink_to(tmp_path / name)
    # The reference is the same run repeated to compare decisions, not a second look a user takes: it
    # gets a ledger of its own (in one ledger the default claim would count it as a second look, refused).
    alone = {**env, "FLYSPEC_GATE_LEDGER": str(reference / "ledger.sqlite")}
    clean = subprocess.run(_demo_command(reference, "--until-decided"), capture_output=True, text=True,
                           timeout=900, env=alone)  # fmt: skip
    assert clean.returncode == 0, clean.stderr
    expected = json.loads(clean.stdout.strip().splitlines()[-1])
    for got, want in ((report, expected), (control, expected["family"][0])):
        for key in ("decision", "n", "lost", "gained", "low", "high"):
            assert got["decision"][key] == want["decision"][key], key


def test_the_first_screen_says_both_verdicts_fly_against_standard_sd_and_what_deciding_takes(
    tmp_path: Path,
) -> None:
    """`flyspec demo` on tiny models with a margin its 40 questions cannot decide for FLy: the report opens
    with at most 12 lines that give the control's FAIL, FLy's verdict with its pairs in order and its
    interval, FLy's speed against standard speculative decoding (the registered baseline) and the forecast
    (here beyond the used-up pool, so no command to continue). The three lanes advance side by side: when
    the control stopped, FLy had at least as many pairs in order as the control's stop, and the control's
    requests still in flight were cancelled (at most one that finished in the same engine step is stored
    beyond its stop)."""
    from flyspec.demo.report import FIRST_SCREEN_LINES
    from flyspec.gate.data.store import GateStore

    command = _demo_command(tmp_path, "--margin", "0.02", "--max-questions", "40", "--max-num-seqs", "6")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    head = done.stdout[: done.stdout.index("# flyspec quality gate")].strip().splitlines()
    assert len(head) <= FIRST_SCREEN_LINES, head
    text = "\n".join(head)
    assert "Control (the draft model alone): FAIL after" in text
    assert "FLy (K=8, W=6, theta 0.6): INCONCLUSIVE after" in text and "FLy minus lossless in [" in text
    assert "as fast as a standard speculative decoding request in the same batches" in text
    # The pool is used up: the forecast says what more questions would give, and no rerun is offered.
    assert "Forecast: " in text and "more questions (simulated median, beyond the pool's 40" in text
    assert "Continue:" not in text
    report = json.loads(done.stdout.strip().splitlines()[-1])
    (control,) = report["family"]
    control_stop = control["sequential"]["stopped_at"]
    assert report["sequential"]["stopped_at"] >= control_stop
    with GateStore(tmp_path / "demo.db") as opened:
        run_id = opened.runs()[0].run_id
        order = {q.question_id: q.position for q in opened.questions(run_id)}
        late = [
            a for a in opened.answers(run_id) if a.arm == "control" and order[a.question_id] >= control_stop
        ]
    assert len(late) <= 1


def _opening_args() -> tuple:
    choice = design.choose_margin(60, margin=0.3)
    return choice, design.control_outlook(60), ("own",)


def _interrupt(proc: subprocess.Popen) -> tuple[str, float]:
    """Send SIGINT (Ctrl-C); return the rest of stderr and the seconds until the process ended."""
    import signal
    import time

    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=60)
    return rest, time.monotonic() - sent


@pytest.mark.slow
def test_ctrl_c_during_the_warm_up_stops_the_demo_within_2_s(tmp_path: Path) -> None:
    """SIGINT the moment `flyspec demo` (SmolLM2 as target and draft) says its warm-up started ends the
    process within 2 s with exit code 130 and an 'interrupted' line, after phase lines that each carry
    their time; nothing was stored, so a rerun starts the same run afresh."""

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
        rest, took = _interrupt(proc)
    finally:
        proc.kill()
    err = "".join(said) + rest
    assert proc.returncode == 130, err
    assert took <= 2.0, f"exited {took:.2f} s after SIGINT"
    assert "interrupted" in rest and "Traceback" not in err
    assert any(line.startswith("[") and "load " in line and " s" in line for line in said), err


@pytest.mark.slow
def test_ctrl_c_while_answers_are_in_flight_exits_130_and_keeps_them(tmp_path: Path) -> None:
    """SIGINT once answers are being stored (the engine thread busy with 32 requests in flight, the phase
    in which an earlier build aborted through "terminate called without an active exception") ends the
    demo with exit code 130 within 5 s, without a C++ abort or a traceback, and every answer stored
    before the signal is still in the store."""

    from flyspec.gate.data.store import GateStore

    command = _demo_command(tmp_path, "--max-tokens", "512")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    store = tmp_path / "demo.db"
    try:
        stored = _wait_for_answers(proc, store, 3)
        err, took = _interrupt(proc)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert took <= 5.0, f"exited {took:.2f} s after SIGINT"
    assert "terminate called" not in err and "Traceback" not in err, err
    with GateStore(store) as opened:
        assert len(opened.answers(opened.runs()[0].run_id)) >= stored
