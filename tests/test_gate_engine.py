"""End to end: `flyspec gate run` with two in-process engine arms on a tiny random-weight model.

The dataset's answers are built from the target model's own greedy outputs: odd questions get the number
the target ends with, even ones an impossible number. Greedy standard speculative decoding is
token-identical to target-only greedy decoding, so the baseline (standard SD) must be right on exactly
the odd questions; the candidate (FLy, lossy) may differ. The run is killed with SIGKILL mid-way and
resumed with the same command. The sequential runs use a second dataset whose reference answers are the
target's whole greedy outputs (exact match), so the baseline is always right and every question FLy
changes is a lost one.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from gate_answers import stored_answers, wait_for_answers
from tiny_llm import save_perturbed, save_tiny

from flyspec.gate.data.store import GateStore
from flyspec.gate.grading.graders import extract_gsm8k
from flyspec.gate.report.build import build_report
from flyspec.gate.runs.run import run_gate

NUM_QUESTIONS = 12
MAX_TOKENS = 12


@dataclass(frozen=True)
class Setup:
    """Tiny target + draft, the JSONL dataset, target-only greedy texts, and who must be right."""

    target: Path
    draft: Path
    dataset: Path
    reference: dict[str, str]
    expected_right: set[str]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    """Write the models and the dataset whose answers come from the target's own greedy outputs."""

    from flyspec import LLM, SamplingParams

    root = tmp_path_factory.mktemp("gate_models")
    target = save_tiny(root / "target", seed=0)
    draft = save_perturbed(target, root / "draft", seed=1, noise=0.03)
    conversations = [
        [{"role": "user", "content": f"w{3 * i + 7} w{5 * i + 11} w{i + 40}"}] for i in range(NUM_QUESTIONS)
    ]
    llm = LLM(str(target), dtype="float32", max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.chat(conversations, params, use_tqdm=False)
    reference: dict[str, str] = {}
    expected_right: set[str] = set()
    rows = []
    for i, (conv, out) in enumerate(zip(conversations, outs, strict=True)):
        reference[f"q{i}"] = out.outputs[0].text
        number = extract_gsm8k(out.outputs[0].text)
        if i % 2 == 1 and number is not None:
            answer = str(number)
            expected_right.add(f"q{i}")
        else:
            answer = "987654321"  # no word of the tiny vocabulary ends in this number
        rows.append({"id": f"q{i}", "messages": conv, "answer": answer, "grader": "gsm8k"})
    dataset = root / "tiny.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert expected_right, "the tiny target never ended with a number; change the prompts"
    return Setup(target, draft, dataset, reference, expected_right)


def _arms(setup: Setup) -> tuple[dict, dict]:
    spec = {"model": str(setup.draft), "num_speculative_tokens": 3}
    base = {"kind": "engine", "model": str(setup.target), "dtype": "float32", "max_num_seqs": 2,
            "speculative_config": {**spec, "rejection_sample_method": "standard"}}  # fmt: skip
    fly = {**spec, "rejection_sample_method": "fly", "fly_entropy_threshold": 0.0}
    return base, {**base, "speculative_config": fly}


def _outputs(store: Path, run_id: str) -> dict[tuple[str, str], str]:
    with GateStore(store) as s:
        return {(a.arm, a.question_id): a.output for a in s.answers(run_id)}


def test_in_process_gate_shares_one_engine_and_matches_target_greedy(setup: Setup, tmp_path: Path) -> None:
    """Greedy gate with standard-SD vs FLy arms: one FLy engine serves both (recorded in the run), the
    baseline's stored outputs are exactly the target-only greedy texts (lossless verification per
    request), the baseline is right on exactly the predicted questions, and the report counts equal
    those recomputed from the stored rows."""
    base, cand = _arms(setup)
    store = tmp_path / "gate.sqlite"
    run_id = run_gate(store, str(setup.dataset), base, cand, 0.1, max_tokens=MAX_TOKENS, progress=False)
    outputs = _outputs(store, run_id)
    assert {q: outputs[("baseline", q)] for q in setup.reference} == setup.reference
    with GateStore(store) as s:
        answers = s.answers(run_id)
        notes = s.get_run(run_id).notes  # type: ignore[union-attr]
    assert notes["shared_engine"] == [["baseline", "candidate"]]
    right = {(a.arm, a.question_id) for a in answers if a.correct}
    assert {q for arm, q in right if arm == "baseline"} == setup.expected_right
    lost = sum(("baseline", q) in right and ("candidate", q) not in right for q in setup.reference)
    gained = sum(("candidate", q) in right and ("baseline", q) not in right for q in setup.reference)
    pooled = build_report(store, run_id).pooled
    assert pooled is not None and (pooled.n, pooled.lost, pooled.gained) == (NUM_QUESTIONS, lost, gained)
    assert all(a.num_forgiven_tokens == 0 for a in answers if a.arm == "baseline")


def test_sampled_arms_are_paired_by_seed_not_by_engine(setup: Setup, tmp_path: Path, own_ledger) -> None:  # noqa: ANN001
    """At temperature 1, per-question seeds make outputs reproducible and independent of engine sharing:
    the standard arm gives identical texts whether it rides in the shared FLy engine or runs alone in
    its own engine (paired with a target-only candidate), and a repeated run reproduces them (in another
    store with a ledger of its own: the user's ledger refuses a second look at the same arms)."""
    base, cand = _arms(setup)
    target_only = {"kind": "engine", "model": str(setup.target), "dtype": "float32", "max_num_seqs": 2}
    store = tmp_path / "gate.sqlite"
    common = {"max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 11, "progress": False}
    shared = run_gate(store, str(setup.dataset), base, cand, 0.1, run_id="shared", **common)
    alone = run_gate(store, str(setup.dataset), base, target_only, 0.1, run_id="alone", **common)
    repeat = tmp_path / "repeat.sqlite"
    with own_ledger():
        again = run_gate(repeat, str(setup.dataset), base, cand, 0.1, run_id="again", **common)
    with GateStore(store) as s:
        assert "shared_engine" not in s.get_run("alone").notes  # type: ignore[union-attr]
    a, b, c = _outputs(store, shared), _outputs(store, alone), _outputs(repeat, again)
    assert {q: a[("baseline", q)] for q in setup.reference} == {
        q: b[("baseline", q)] for q in setup.reference
    }
    assert a == c
    assert any(a[("baseline", q)] != setup.reference[q] for q in setup.reference)  # it really sampled


@pytest.mark.slow
def test_gate_run_killed_and_resumed_with_in_process_arms(setup: Setup, tmp_path: Path) -> None:
    """A gate run over standard-SD vs FLy arms (one shared engine), killed with SIGKILL after a few
    answers, resumes with the same command and ends with exactly one stored answer per question and arm;
    the baseline is right on exactly the questions target-only greedy decoding predicts; the report's
    counts equal those recomputed from the stored rows."""
    dataset, expected_right = setup.dataset, setup.expected_right
    store = tmp_path / "gate.sqlite"
    base, cand = _arms(setup)
    command = [
        sys.executable, "-c", "from flyspec.cli import main; main()", "gate", "run",
        "--store", str(store), "--dataset", str(dataset), "--baseline", json.dumps(base),
        "--candidate", json.dumps(cand), "--margin", "0.1", "--max-tokens", str(MAX_TOKENS),
        "--seed", "5", "--no-progress", "--json",
    ]  # fmt: skip
    total = 2 * NUM_QUESTIONS
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_for_answers(proc, store, 3)
    proc.kill()
    proc.wait(timeout=30)
    stored_at_kill = stored_answers(store)
    assert 3 <= stored_at_kill < total, stored_at_kill

    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    log = " ".join(done.stderr.split())
    assert "resumed" in log and f"{stored_at_kill} of {total} answers stored" in log
    report = json.loads(done.stdout.strip().splitlines()[-1])

    with sqlite3.connect(store) as db:
        rows = db.execute("SELECT arm, question_id, correct, seed FROM answers").fetchall()
        notes = json.loads(db.execute("SELECT notes FROM runs").fetchone()[0])
    assert len(rows) == total and len({(arm, qid) for arm, qid, _, _ in rows}) == total
    correct = {(arm, qid): bool(c) for arm, qid, c, _ in rows}
    assert {qid for (arm, qid), c in correct.items() if arm == "baseline" and c} == expected_right
    assert {q: t for (arm, q), t in _outputs(store, "gate").items() if arm == "baseline"} == setup.reference
    seeds = {(arm, qid): seed for arm, qid, _, seed in rows}
    assert all(seeds[("baseline", f"q{i}")] == seeds[("candidate", f"q{i}")] for i in range(NUM_QUESTIONS))
    lost = sum(
        correct[("baseline", f"q{i}")] and not correct[("candidate", f"q{i}")] for i in range(NUM_QUESTIONS)
    )
    gained = sum(
        correct[("candidate", f"q{i}")] and not correct[("baseline", f"q{i}")] for i in range(NUM_QUESTIONS)
    )
    decision = report["decision"]
    assert (decision["n"], decision["lost"], decision["gained"]) == (NUM_QUESTIONS, lost, gained)
    pooled = report["comparisons"][-1]
    assert pooled["baseline_accuracy"] == pytest.approx(len(expected_right) / NUM_QUESTIONS)
    assert notes["shared_engine"] == [["baseline", "candidate"]]
    speeds = {s["arm"]: s for s in report["speeds"]}
    assert speeds["baseline"]["forgiven_share"] in (None, 0.0)  # standard verification never forgives
    assert speeds["candidate"]["mean_acceptance_length"] >= 1.0


def test_shared_engine_keeps_pairs_together_at_the_admission_cap(setup: Setup, tmp_path: Path) -> None:
    """The shared engine is fed both arms' requests for one question side by side, as many in flight as
    the engine admits (recorded in the notes): replaying the stored answers in commit order, never more
    questions have only one of their two answers than there are slots. (Chunk-by-chunk feeding, one arm
    after the other, leaves a whole chunk half-answered.)"""
    from flyspec.engine.scheduler import capacity

    base, cand = _arms(setup)
    base = {**base, "max_num_seqs": 3}
    cand = {**cand, "max_num_seqs": 3}
    store = tmp_path / "gate.sqlite"
    run_id = run_gate(store, str(setup.dataset), base, cand, 0.1, max_tokens=MAX_TOKENS, progress=False)
    with GateStore(store) as s:
        (facts,) = s.get_run(run_id).notes["executors"]  # type: ignore[union-attr]
    assert facts["arms"] == ["baseline", "candidate"]
    assert facts["max_in_flight"] == capacity(2048, 3, 1 + 3).max_running == 3
    with sqlite3.connect(store) as db:
        rows = db.execute("SELECT question_id FROM answers ORDER BY rowid").fetchall()
    half: set[str] = set()
    widest = 0
    for (qid,) in rows:
        half ^= {qid}
        widest = max(widest, len(half))
    assert len(rows) == 2 * NUM_QUESTIONS and widest <= 3


# ------------------------------------------------------------------------------------ sequential runs

SEQ_QUESTIONS = 40
SEQ_TOKENS = 16
SEQ_MARGIN = 0.3


@pytest.fixture(scope="module")
def exact_dataset(setup: Setup, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 chat questions whose reference answer is the target's whole greedy output (exact grader);
    prompts whose greedy output is empty (an immediate end of sequence) are skipped."""
    from flyspec import LLM, SamplingParams

    conversations = [
        [{"role": "user", "content": f"w{3 * i + 7} w{5 * i + 11} w{i + 40}"}] for i in range(80)
    ]
    llm = LLM(str(setup.target), dtype="float32", max_num_seqs=8)
    outs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=SEQ_TOKENS), use_tqdm=False)
    answered = [(c, o.outputs[0].text) for c, o in zip(conversations, outs, strict=True) if o.outputs[0].text]
    rows = [
        {"id": f"s{i}", "messages": c, "answer": text, "grader": "exact"}
        for i, (c, text) in enumerate(answered[:SEQ_QUESTIONS])
    ]
    assert len(rows) == SEQ_QUESTIONS
    path = tmp_path_factory.mktemp("seq") / "exact.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _seq_arms(setup: Setup) -> tuple[dict, dict]:
    spec = {"model": str(setup.draft), "num_speculative_tokens": 3}
    base = {"kind": "engine", "model": str(setup.target), "dtype": "float32", "max_num_seqs": 4,
            "speculative_config": {**spec, "rejection_sample_method": "standard"}}  # fmt: skip
    return base, {**base, "speculative_config": {**spec, "rejection_sample_method": "fly"}}


def _stored(store: Path, run_id: str) -> tuple[list[tuple[str, str]], dict]:
    with GateStore(store) as s:
        order = [(q.dataset, q.question_id) for q in s.questions(run_id)]
        correct = {(a.arm, a.repeat, a.dataset, a.question_id): a.correct for a in s.answers(run_id)}
    return order, correct


def test_sequential_run_stops_at_the_first_crossing_in_registered_order(
    setup: Setup, exact_dataset: Path, tmp_path: Path
) -> None:
    """A sequential run registers its method, alpha, margin, N and order seed, answers in the seeded order
    (not file order), stops where `sequential_decision` over the stored pairs in registered order first
    crosses, stores the answers that were in flight at the stop without changing the decision, and a
    second call answers nothing and reports the same stop."""
    from flyspec.gate.stats.decide import sequential_decision
    from flyspec.gate.stats.monitor import in_order_diffs

    base, cand = _seq_arms(setup)
    store = tmp_path / "seq.sqlite"
    common = SEQ_SETTINGS
    run_id = run_gate(store, str(exact_dataset), base, cand, SEQ_MARGIN, **common)
    with GateStore(store) as s:
        reg = s.get_run(run_id).registration  # type: ignore[union-attr]
        answered = len(s.answers(run_id))
    seq = reg["sequential"]
    assert (seq["margin"], seq["alpha"], seq["max_questions"], seq["order_seed"]) == (
        SEQ_MARGIN,
        0.025,
        40,
        3,
    )
    assert "confidence sequence" in seq["method"] and seq["population_size"] == SEQ_QUESTIONS
    order, correct = _stored(store, run_id)
    assert order != [("exact", f"s{i}") for i in range(SEQ_QUESTIONS)]  # seeded order, not the file's
    diffs = in_order_diffs(order, correct)
    walk = sequential_decision(diffs, SEQ_MARGIN, 0.025, population_size=SEQ_QUESTIONS)
    assert walk.decision == "PASS" and walk.stopped_at < SEQ_QUESTIONS
    report = build_report(store, run_id).to_dict()
    assert report["sequential"]["stopped_at"] == walk.stopped_at
    assert report["sequential"]["max_questions"] == SEQ_QUESTIONS
    assert (report["sequential"]["low"], report["sequential"]["high"]) == (walk.low, walk.high)
    decision = report["decision"]
    assert (decision["decision"], decision["n"]) == ("PASS", walk.stopped_at)
    assert (decision["low"], decision["high"]) == (walk.low, walk.high)
    assert decision["lost"] == diffs[: walk.stopped_at].count(-1) and decision["gained"] == 0
    assert answered < 2 * SEQ_QUESTIONS  # it stopped early

    again = run_gate(store, str(exact_dataset), base, cand, SEQ_MARGIN, **common)
    with GateStore(store) as s:
        assert len(s.answers(again)) == answered
    assert build_report(store, run_id).to_dict()["sequential"] == report["sequential"]


# A claim about these 40 questions (--population finite): the small pool decides within it.
SEQ_SETTINGS = {
    "max_tokens": SEQ_TOKENS,
    "sequential": True,
    "seed": 3,
    "progress": False,
    "population": "finite",
}


def _seq_command(store: Path, dataset: Path, base: dict, cand: dict) -> list[str]:
    return [
        sys.executable, "-c", "from flyspec.cli import main; main()", "gate", "run", "--sequential",
        "--max-questions", str(SEQ_QUESTIONS), "--store", str(store), "--dataset", str(dataset),
        "--baseline", json.dumps(base), "--candidate", json.dumps(cand), "--margin", str(SEQ_MARGIN),
        "--max-tokens", str(SEQ_TOKENS), "--seed", "3", "--no-progress", "--json", "--population", "finite",
    ]  # fmt: skip


def test_sequential_run_killed_and_resumed_reaches_the_same_stop(
    setup: Setup,
    exact_dataset: Path,
    tmp_path: Path,
    own_ledger,  # noqa: ANN001
) -> None:
    """`flyspec gate run --sequential` (a real subprocess) killed with SIGKILL after a few answers and then
    resumed with the same settings ends with exactly one row per (question, arm) and the same decision,
    stopped_at and bounds as an uninterrupted run with the same seed in another store."""
    base, cand = _seq_arms(setup)
    settings = {
        "max_tokens": SEQ_TOKENS,
        "sequential": True,
        "max_questions": SEQ_QUESTIONS,
        "seed": 3,
        "population": "finite",
    }
    reference = tmp_path / "reference.sqlite"
    with own_ledger():  # the run to compare with, not a look
        run_gate(reference, str(exact_dataset), base, cand, SEQ_MARGIN, progress=False, **settings)
    expected = build_report(reference, "gate").to_dict()

    store = tmp_path / "killed.sqlite"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = _seq_command(store, exact_dataset, base, cand)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    wait_for_answers(proc, store, 4)
    proc.kill()
    proc.wait(timeout=30)
    stored_at_kill = stored_answers(store)
    assert stored_at_kill < 2 * expected["sequential"]["stopped_at"], "killed too late to test a resume"

    run_gate(
        store, str(exact_dataset), json.dumps(base), json.dumps(cand), SEQ_MARGIN, progress=False, **settings
    )
    report = build_report(store, "gate").to_dict()
    with sqlite3.connect(store) as db:
        keys = db.execute("SELECT arm, question_id FROM answers").fetchall()
        starts = db.execute("SELECT COUNT(*) FROM events WHERE event = 'start'").fetchone()[0]
    assert starts == 2  # the killed session and the resumed one
    assert len(keys) == len(set(keys)) >= stored_at_kill
    for key in ("decision", "reason", "stopped_at", "low", "high", "lost", "gained"):
        assert report["sequential"][key] == expected["sequential"][key], key
    assert report["decision"]["decision"] == expected["decision"]["decision"]


def test_a_time_budget_pauses_a_sequential_run_and_a_rerun_continues(
    setup: Setup,
    exact_dataset: Path,
    tmp_path: Path,
    own_ledger,  # noqa: ANN001
) -> None:
    """`max_minutes` stops a sequential run as INCONCLUSIVE at the in-order prefix it had reached (the
    report decides there even though answers in flight completed later, and says a rerun continues);
    rerunning without the budget continues along the same order to the same stop as a run that was
    never paused."""
    base, cand = _seq_arms(setup)
    common = SEQ_SETTINGS
    reference = tmp_path / "reference.sqlite"
    with own_ledger():  # the run to compare with, not a look
        run_gate(reference, str(exact_dataset), base, cand, SEQ_MARGIN, **common)
    expected = build_report(reference, "gate").to_dict()["sequential"]

    store = tmp_path / "paused.sqlite"
    run_gate(store, str(exact_dataset), base, cand, SEQ_MARGIN, max_minutes=1e-4, **common)
    paused = build_report(store, "gate")
    seq = paused.to_dict()["sequential"]
    assert (seq["reason"], seq["decision"]) == ("time_budget", "INCONCLUSIVE")
    assert seq["stopped_at"] < expected["stopped_at"]
    assert paused.to_dict()["decision"]["n"] == seq["stopped_at"]
    assert "its time budget ran out" in paused.to_markdown()
    assert paused.advice == ["Rerun the same command to continue this run."]

    run_gate(store, str(exact_dataset), base, cand, SEQ_MARGIN, **common)
    final = build_report(store, "gate").to_dict()["sequential"]
    for key in ("decision", "reason", "stopped_at", "low", "high"):
        assert final[key] == expected[key], key


def test_a_noise_pilot_at_temperature_zero_runs_for_an_engine_arm(setup: Setup, tmp_path: Path) -> None:
    """Without batch invariance the requests sharing a batch can flip a greedy token, so `gate pilot` of
    an engine baseline at temperature 0 is not refused: it answers every question twice (two repeats of
    the baseline in one engine) and reports the flips between the passes, whatever their number."""
    from flyspec.gate.runs.run import run_pilot

    base, _ = _arms(setup)
    store = tmp_path / "pilot.sqlite"
    run_id = run_pilot(store, str(setup.dataset), base, 0.05, max_tokens=MAX_TOKENS, progress=False)
    with GateStore(store) as s:
        repeats = sorted((a.repeat, a.question_id) for a in s.answers(run_id))
    assert repeats == sorted((r, f"q{i}") for r in (0, 1) for i in range(NUM_QUESTIONS))
    pilot = build_report(store, run_id).to_dict()["pilot"]
    assert pilot["n"] == NUM_QUESTIONS and 0 <= pilot["flips"] <= NUM_QUESTIONS


def test_cancelling_an_arm_in_a_shared_engine_frees_its_slots(setup: Setup) -> None:
    """EngineExecutor.cancel (what the session asks once a control has decided) aborts that arm's requests
    in flight: none of them is answered afterwards, the slots they held take the other arm's next jobs at
    once, and every job of the arm still deciding is answered with its full greedy output."""
    from flyspec.gate.arms import parse_arm
    from flyspec.gate.arms.base import Job, Sampling
    from flyspec.gate.arms.engine import EngineExecutor
    from flyspec.gate.data.questions import Question

    spec = {"kind": "engine", "model": str(setup.target), "dtype": "float32", "max_num_seqs": 4}
    arms = [parse_arm(name, spec) for name in ("baseline", "control")]
    executor = EngineExecutor(arms)
    questions = [Question(f"q{i}", "", "exact", "own", prompt=f"w{i + 5} w7") for i in range(6)]
    jobs = [Job(arm, 0, q, 0, p) for p, q in enumerate(questions) for arm in ("baseline", "control")]
    answered, cancelled = [], []
    for job, completion in executor.answers(iter(jobs), Sampling(0.0, 1.0, MAX_TOKENS)):
        answered.append((job, completion))
        if len(answered) == 1:
            cancelled = executor.cancel(lambda j: j.arm == "control")
    assert cancelled and all(j.arm == "control" for j in cancelled)
    after = [j for j, _ in answered[1:]]
    assert not set(j.request_id for j in after) & set(j.request_id for j in cancelled)
    baseline = [j.question.id for j in after + [answered[0][0]] if j.arm == "baseline"]
    assert sorted(baseline) == sorted(q.id for q in questions)


def test_an_engine_arm_sizes_its_kv_cache_for_the_run(setup: Setup) -> None:
    """Given the run's questions and registered max_tokens (``size_for_work``), an engine arm's KV cache
    holds max_running requests of the longest prompt plus max_tokens (in the tokens the model sees
    through its chat template), not max_running requests of max_model_len; the run's notes record the
    size. An arm that sets kv_cache_request_len itself keeps it."""
    from flyspec.gate.arms.engine import executors, parse, size_for_work
    from flyspec.gate.data.questions import Question
    from flyspec.llm import GenerationRequest, prompt_lengths

    settings = {"kind": "engine", "model": str(setup.target), "dtype": "float32", "max_num_seqs": 16}
    questions = [
        Question(
            id=str(i), answer="1", grader="gsm8k", dataset="d", messages=[{"role": "user", "content": c}]
        )
        for i, c in enumerate(["w1 w2", "w3 " * 30, "w4"])
    ]
    longest = max(
        prompt_lengths(str(setup.target), [GenerationRequest(messages=q.messages) for q in questions])
    )
    (default,) = executors([parse("default", settings)])
    (sized,) = executors([parse("sized", settings)])
    (own,) = executors([parse("own", {**settings, "kv_cache_request_len": 100})])
    size_for_work([sized, own], questions, MAX_TOKENS)
    assert sized.request_len == longest + MAX_TOKENS
    for ex in (default, sized, own):
        ex.start()
    per_request = -(-(512 + 1) // 16)  # max_model_len: the tiny model's max_position_embeddings
    block_bytes = default.facts()["kv_cache_bytes"] // (16 * per_request)
    assert sized.facts()["kv_cache_bytes"] == 16 * -(-(longest + MAX_TOKENS + 1) // 16) * block_bytes
    assert own.facts()["kv_cache_bytes"] == 16 * -(-(100 + 1) // 16) * block_bytes
