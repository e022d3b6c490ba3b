"""Open-ended questions graded by a judge model that compares both arms' answers in both orders.

The fast tests run the gate against a scripted OpenAI-compatible server on loopback (FastAPI + uvicorn in
this process) that serves the two arms and a rule-following judge, so every count is known: the judge
prefers the answer that says "good", always says "Verdict: A" on questions marked "position" (a judge
that follows the position: the two orders disagree), and never states a verdict on questions marked
"mumble". The slow test uses a real small model, SmolLM2-135M-Instruct, as the judge through a real
`flyspec serve` process, with two tiny engine arms answering open-ended chat prompts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from flyspec.bench.peers import free_port, wait_ready
from flyspec.gate.endpoint_executor import EndpointError
from flyspec.gate.judge import outcome, parse_verdict, preferred
from flyspec.gate.report import build_report
from flyspec.gate.runner import run_gate
from flyspec.gate.store import GateStore

# Base answers "good" except on q3; the candidate answers "bad" on q0-q2: 3 lost, 1 gained.
QUESTIONS = 12
BASE_BAD = {3}
CAND_BAD = {0, 1, 2}
MARKS = {8: "position", 9: "position", 10: "mumble", 11: "mumble"}


@dataclass
class Scripted:
    """What the scripted server saw, and judge calls to fail (answered with HTTP 503)."""

    judge_prompts: list[str] = field(default_factory=list)
    arm_calls: Counter = field(default_factory=Counter)
    fail: set[str] = field(default_factory=set)


def _question(text: str) -> int:
    return int(re.search(r"Question (\d+)", text).group(1))  # type: ignore[union-attr]


def _position(prompt: str) -> str:
    """AB when the baseline's answer is shown as A."""
    return "BA" if "[Response A]\ncand" in prompt else "AB"


def _judge_reply(prompt: str) -> str:
    a = re.search(r"\[Response A\]\n(.*?)\n\n\[Response B\]", prompt, re.S).group(1)  # type: ignore[union-attr]
    b = re.search(r"\[Response B\]\n(.*?)\n\nExplain", prompt, re.S).group(1)  # type: ignore[union-attr]
    if "position" in prompt:
        return "Both look fine; the first reads better.\nVerdict: A"
    if "mumble" in prompt:
        return "Hard to say."
    good_a, good_b = "good" in a, "good" in b
    verdict = "A" if good_a and not good_b else "B" if good_b and not good_a else "tie"
    return f"One of them is better.\n**Verdict: {verdict}**"


def _app(state: Scripted) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"data": [{"id": m, "root": f"/w/{m}"} for m in ("base", "cand", "judge")]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        text = body["messages"][-1]["content"]
        if body["model"] == "judge":
            assert body["temperature"] == 0.0 and body["seed"] == 7 and body["max_tokens"] == 64
            if f"{_question(text)}:{_position(text)}" in state.fail:
                return JSONResponse({"error": "down"}, status_code=503)
            state.judge_prompts.append(text)
            content = _judge_reply(text)
        else:
            i = _question(text)
            state.arm_calls[(body["model"], i)] += 1
            bad = BASE_BAD if body["model"] == "base" else CAND_BAD
            content = f"{body['model']}: {'bad' if i in bad else 'good'} answer to question {i}"
        return JSONResponse(
            {
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 6},
            }
        )

    return app


@pytest.fixture()
def server() -> Iterator[tuple[Scripted, str]]:
    state = Scripted()
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(_app(state), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    yield state, f"http://127.0.0.1:{port}/v1"
    srv.should_exit = True
    thread.join(timeout=10)


def _dataset(tmp_path: Path) -> Path:
    path = tmp_path / "open.jsonl"
    rows = [
        {
            "id": f"q{i}",
            "messages": [{"role": "user", "content": f"Question {i} {MARKS.get(i, '')}: write a line."}],
            "grader": "judge",
        }
        for i in range(QUESTIONS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(url: str, tmp_path: Path, **settings: Any) -> str:
    judge = {
        "base_url": url,
        "model": "judge",
        "max_tokens": 64,
        "seed": 7,
        "max_retries": 0,
        "backoff": 0.01,
    }
    return run_gate(
        tmp_path / "judge.db",
        str(_dataset(tmp_path)),
        {"base_url": url, "model": "base", "max_retries": 0},
        {"base_url": url, "model": "cand", "max_retries": 0},
        0.5,
        judge=judge,
        max_tokens=16,
        progress=False,
        **settings,
    )


def test_verdicts_are_read_and_mapped_to_lost_gained_and_ties() -> None:
    """The last 'Verdict: X' counts (emphasis and brackets allowed), then '[[X]]', then a last line that
    is only the choice; anything else is unreadable. A verdict's preference depends on the position, and
    the two orders agree (lost, gained), disagree, or tie."""
    assert parse_verdict("A is shorter.\nVerdict: A\n... no wait.\n**Verdict:** B") == "B"
    assert parse_verdict("[[tie]]") == "tie" and parse_verdict("The answer is: B") == "B"
    assert parse_verdict("Response A is better.") is None and parse_verdict("") is None
    assert (preferred("AB", "A"), preferred("BA", "A"), preferred("BA", "B")) == ("first", "second", "first")
    assert preferred("AB", None) == preferred("AB", "tie") == "tie"
    assert outcome("first", "first") == "first" and outcome("second", "second") == "second"
    assert outcome("first", "second") == "disagree" and outcome("first", "tie") == "tie"


def test_judge_run_counts_position_swaps_and_registers_the_judge(
    server: tuple[Scripted, str], tmp_path: Path
) -> None:
    """Each question is judged twice with the answers swapped; the judge saw the request and both answers;
    agreement gives lost (3) and gained (1), the position-following questions are ties counted as
    disagreements (2), unreadable verdicts are ties and counted (4); the report's pooled counts are the
    judge's, it says what lost means and shows the position bias; the registration holds the judge's
    model, served model, template text and sha256 and sampling; a rerun asks nothing again."""
    state, url = server
    run_id = _run(url, tmp_path)
    assert len(state.judge_prompts) == 2 * QUESTIONS
    first = next(p for p in state.judge_prompts if "Question 0 " in p and "[Response A]\nbase" in p)
    assert "base: good answer to question 0" in first and "cand: bad answer to question 0" in first
    report = build_report(tmp_path / "judge.db", run_id)
    pooled = report.pooled
    assert pooled is not None and (pooled.n, pooled.lost, pooled.gained) == (QUESTIONS, 3, 1)
    j = report.judge
    assert j is not None
    assert (j.questions, j.baseline_better, j.candidate_better, j.disagree, j.ties) == (12, 3, 1, 2, 6)
    assert (j.verdicts, j.unreadable, j.chose_a, j.chose_b) == (24, 4, 8, 4)
    markdown = report.to_markdown()
    assert "## Judge" in markdown and "**lost** means the judge preferred the baseline's answer" in markdown
    assert "| 12 | 3 | 1 | 2 | 6 | 4 of 24 |" in markdown and "Position bias: of 12 decisive" in markdown
    registered = report.run.registration["judge"]
    assert registered["model"] == "judge" and registered["served_model"] == {
        "id": "judge",
        "root": "/w/judge",
    }
    assert registered["sampling"] == {"temperature": 0.0, "max_tokens": 64, "seed": 7}
    assert "Verdict: tie" in registered["template_text"] and len(registered["template_sha256"]) == 64
    with GateStore(tmp_path / "judge.db") as store:
        stored = store.judgements(run_id)
    assert len(stored) == 24 and sum(r.verdict is None for r in stored) == 4
    assert json.loads(json.dumps(report.to_dict()))["judge"]["disagree"] == 2
    _run(url, tmp_path)
    assert len(state.judge_prompts) == 2 * QUESTIONS


def test_judge_failure_stops_and_a_rerun_asks_only_what_is_missing(
    server: tuple[Scripted, str], tmp_path: Path
) -> None:
    """The judge failing on one position of one question stops the run with a clear error; the verdicts
    that arrived are stored; the rerun answers that question again (its pair was not stored without its
    grade) and asks the judge only for the missing position (the stored one is reused for the same
    answers), so every (question, position) is asked exactly once in the end."""
    state, url = server
    state.fail.add("5:BA")
    with pytest.raises(EndpointError, match="judge: no verdict for question open/q5 \\(BA\\)"):
        _run(url, tmp_path)
    with GateStore(tmp_path / "judge.db") as store:
        keys = {(r.question_id, r.position) for r in store.judgements("gate")}
        answered = {a.question_id for a in store.answers("gate")}
    assert ("q5", "AB") in keys and ("q5", "BA") not in keys and "q5" not in answered
    state.fail.clear()
    run_id = _run(url, tmp_path)
    asked = Counter((_question(p), _position(p)) for p in state.judge_prompts)
    assert set(asked.values()) == {1} and len(asked) == 2 * QUESTIONS
    assert state.arm_calls[("base", 5)] == 2 and state.arm_calls[("base", 4)] == 1
    assert build_report(tmp_path / "judge.db", run_id).pooled.n == QUESTIONS  # type: ignore[union-attr]


def test_judge_settings_are_checked(server: tuple[Scripted, str], tmp_path: Path) -> None:
    """Judge questions without a judge, a judge without judge questions, unknown judge keys and a model
    the judge server does not serve are refused with messages naming them."""
    _, url = server
    arm = {"base_url": url, "model": "base"}
    with pytest.raises(ValueError, match="grader 'judge': give the judge endpoint with --judge"):
        run_gate(tmp_path / "a.db", str(_dataset(tmp_path)), arm, arm, 0.5, progress=False)
    exact = tmp_path / "exact.jsonl"
    exact.write_text(json.dumps({"prompt": "Question 1", "answer": "x", "grader": "exact"}) + "\n")
    judge = {"base_url": url, "model": "judge"}
    with pytest.raises(ValueError, match="no question of the run has grader 'judge'"):
        run_gate(tmp_path / "b.db", str(exact), arm, arm, 0.5, judge=judge, progress=False)
    with pytest.raises(ValueError, match="judge: unknown key\\(s\\) temperature"):
        run_gate(tmp_path / "c.db", str(_dataset(tmp_path)), arm, arm, 0.5, judge={**judge, "temperature": 1})
    with pytest.raises(ValueError, match="serves model\\(s\\) base, cand, judge, not 'big'"):
        run_gate(tmp_path / "d.db", str(_dataset(tmp_path)), arm, arm, 0.5, judge={**judge, "model": "big"})


BIN = Path(sys.executable).parent
OPEN_PROMPTS = [
    "Describe a quiet morning.",
    "Give one tip for learning to cook.",
    "What makes a good friend?",
]


@pytest.mark.slow  # a real flyspec serve with SmolLM2-135M-Instruct as the judge: about half a minute
def test_smollm2_judge_through_flyspec_serve(tmp_path: Path) -> None:
    """SmolLM2-135M-Instruct, prepared in the model zoo, judges two tiny engine arms (standard vs FLy) on
    open-ended chat prompts through a real `flyspec serve` on loopback: every question is judged in both
    orders, every verdict is stored, the pooled counts are the judge's outcomes, and the report shows the
    position-swap counts (a 135M judge is weak; the point is that the whole path is real)."""
    from flyspec import assets

    if "smollm2-135m-instruct" not in assets.ZOO or not assets.is_prepared("smollm2-135m-instruct"):
        pytest.skip("smollm2-135m-instruct is not prepared (flyspec models prepare smollm2-135m-instruct)")
    from tiny_llm import save_perturbed, save_tiny

    target = save_tiny(tmp_path / "target", seed=3, std=0.25)
    draft = save_perturbed(target, tmp_path / "draft", seed=5, noise=0.003)
    spec = {"model": str(draft), "num_speculative_tokens": 3}
    base = {"kind": "engine", "model": str(target), "dtype": "float32", "max_num_seqs": 4}
    baseline = {**base, "speculative_config": {**spec, "rejection_sample_method": "standard"}}
    candidate = {
        **base,
        "speculative_config": {**spec, "rejection_sample_method": "fly", "fly_entropy_threshold": 0.0},
    }
    dataset = tmp_path / "open.jsonl"
    dataset.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": p}], "grader": "judge"})
            + "\n"
            for i, p in enumerate(OPEN_PROMPTS)
        )
    )
    port = free_port()
    log = open(tmp_path / "judge.log", "w")  # noqa: SIM115 - closed with the process below
    cmd = [str(BIN / "flyspec"), "serve", "smollm2-135m-instruct", "--port", str(port), "--served-model-name"]
    proc = subprocess.Popen(
        [*cmd, "smollm2", "--dtype", "float32", "--max-num-seqs", "2"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, 180, tmp_path / "judge.log")
        store = tmp_path / "smol.db"
        judge = {
            "base_url": f"http://127.0.0.1:{port}",
            "model": "smollm2",
            "max_tokens": 48,
            "concurrency": 2,
        }
        run_id = run_gate(
            store, str(dataset), baseline, candidate, 0.5, judge=judge, max_tokens=12, progress=False
        )
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    report = build_report(store, run_id)
    j, pooled = report.judge, report.pooled
    assert j is not None and pooled is not None
    assert j.questions == len(OPEN_PROMPTS) and j.verdicts == 2 * len(OPEN_PROMPTS)
    assert j.baseline_better + j.candidate_better + j.disagree + j.ties == len(OPEN_PROMPTS)
    assert (pooled.lost, pooled.gained) == (j.baseline_better, j.candidate_better)
    with GateStore(store) as opened:
        outputs = [r.output for r in opened.judgements(run_id)]
    assert len(outputs) == 2 * len(OPEN_PROMPTS) and all(isinstance(o, str) for o in outputs)
    markdown = report.to_markdown()
    print(markdown[markdown.index("## Judge") : markdown.index("**Rule.**")])
    assert "| judged questions | both orders: baseline better (lost) |" in markdown
    assert report.run.registration["judge"]["served_model"]["id"] == "smollm2"
