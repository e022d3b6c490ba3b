"""Open-ended questions graded by a judge model that compares both arms' answers in both orders.

The fast tests run the gate against a scripted OpenAI-compatible server on loopback (FastAPI + uvicorn in
this process) that serves the two arms and a rule-following judge, so every count is known: the judge
prefers the answer that says "good", always says "Verdict: A" on questions marked "position" (a judge
that follows the position: the two orders disagree), and never states a verdict on questions marked
"mumble"; on questions marked "same" both arms give the same answer, which is a tie without asking. The
slow test uses a real small model, SmolLM2-135M-Instruct, as the judge through a real `flyspec serve`
process, with two tiny engine arms answering open-ended chat prompts.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from loopback import serve_app
from registrations import as_registered_before_bet_versions, assert_registrations_round_trip
from serve_process import flyspec_serve
from tiny_llm import TinyModels

from flyspec.gate.arms.endpoint import EndpointError
from flyspec.gate.data.store import GateStore
from flyspec.gate.grading.graders import UNDECIDED, outcome, parse_verdict, preferred
from flyspec.gate.report.build import build_report
from flyspec.gate.runs.run import run_gate

# Base answers "good" except on q3; the candidate answers "bad" on q0-q2: 3 lost, 1 gained.
QUESTIONS = 13
BASE_BAD = {3}
CAND_BAD = {0, 1, 2}
MARKS = {8: "position", 9: "position", 10: "mumble", 11: "mumble", 12: "same"}
JUDGED = QUESTIONS - 1  # the "same" question is never sent to the judge


@dataclass
class Scripted:
    """What the scripted server saw, and judge calls to fail (answered with HTTP 503)."""

    judge_prompts: list[str] = field(default_factory=list)
    judge_ports: set[int] = field(default_factory=set)
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
            state.judge_ports.add(request.client.port)  # type: ignore[union-attr]
            content = _judge_reply(text)
        else:
            i = _question(text)
            state.arm_calls[(body["model"], i)] += 1
            bad = BASE_BAD if body["model"] == "base" else CAND_BAD
            content = f"{body['model']}: {'bad' if i in bad else 'good'} answer to question {i}"
            if MARKS.get(i) == "same":
                content = f"the same answer to question {i}"
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
    with serve_app(_app(state)) as url:
        yield state, url


def _dataset(tmp_path: Path, grader: str = "judge", answer: str | None = None) -> Path:
    path = tmp_path / "open.jsonl"
    rows = [
        {
            "id": f"q{i}",
            "messages": [{"role": "user", "content": f"Question {i} {MARKS.get(i, '')}: write a line."}],
            "grader": grader,
            **({"answer": answer} if answer is not None else {}),
        }
        for i in range(QUESTIONS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(url: str, tmp_path: Path, margin: float = 0.5, dataset: Path | None = None, **settings: Any) -> str:
    """The scripted run (settings: GateOptions' fields) on ``dataset`` (default: the judge questions)."""
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
        str(dataset or _dataset(tmp_path)),
        {"base_url": url, "model": "base", "max_retries": 0},
        {"base_url": url, "model": "cand", "max_retries": 0},
        margin,
        judge=judge,
        max_tokens=16,
        progress=False,
        **settings,
    )


def test_verdicts_are_read_and_mapped_to_lost_gained_ties_and_undecided() -> None:
    """The last 'Verdict: X' counts (emphasis and brackets allowed), then '[[X]]', then a last line that
    is only the choice; anything else is unreadable. A verdict's preference depends on the position; the
    two orders agree (lost, gained, tie) or not: a disagreement, including a tie against a preference, and
    an unreadable verdict are undecided."""
    assert parse_verdict("A is shorter.\nVerdict: A\n... no wait.\n**Verdict:** B") == "B"
    assert parse_verdict("[[tie]]") == "tie" and parse_verdict("The answer is: B") == "B"
    assert parse_verdict("Response A is better.") is None and parse_verdict("") is None
    assert (preferred("AB", "A"), preferred("BA", "A"), preferred("BA", "B")) == ("first", "second", "first")
    assert preferred("AB", None) == "unreadable" and preferred("BA", "tie") == "tie"
    assert outcome("first", "first") == "first" and outcome("second", "second") == "second"
    assert outcome("tie", "tie") == "tie"
    assert outcome("first", "second") == "disagree" and outcome("first", "tie") == "disagree"
    assert outcome("unreadable", "first") == outcome("tie", "unreadable") == "unreadable"
    assert set(UNDECIDED) == {"disagree", "unreadable"}


def _person(question: int) -> int:
    """A careful person's label of question i's pair: +1 when only the candidate's answer is good, -1 when
    only the baseline's is, 0 when both are equally good (or bad)."""
    return int(question not in CAND_BAD) - int(question not in BASE_BAD)


def test_a_judged_run_decides_only_on_gold_labels_and_registers_the_judge(
    server: tuple[Scripted, str], tmp_path: Path
) -> None:
    """Each question is judged twice with the answers swapped, except the one whose two answers are
    identical (a tie, never sent); the judge saw the request and both answers. The run registers the
    judge (model, served model, template text and sha256, sampling) and the gold-label rule before the
    first answer. Before any label the run decides nothing, whatever the verdicts say: the report says so
    beside the decision, with the judge's counts and how many labels would decide. Once a person has
    labelled the drawn pairs (here every differing pair: rate 1), the decision is the prediction-powered
    interval on them, the report shows the judge's agreement with gold, and a rerun asks nothing again."""
    from flyspec.gate.data.results import gold_rule, pending, record

    state, url = server
    run_id = _run(url, tmp_path, gold_rate=1.0)
    assert len(state.judge_prompts) == 2 * JUDGED
    assert not any("Question 12 " in p for p in state.judge_prompts)
    first = next(p for p in state.judge_prompts if "Question 0 " in p and "[Response A]\nbase" in p)
    assert "base: good answer to question 0" in first and "cand: bad answer to question 0" in first
    report = build_report(tmp_path / "judge.db", run_id)
    assert report.decision == "INCONCLUSIVE" and report.gold is not None
    g = report.gold
    assert (g.pairs, g.identical, g.lost, g.gained, g.selected, g.labelled) == (13, 1, 3, 1, 12, 0)
    markdown = report.to_markdown()
    assert "No pair has a gold label yet, so the run decides nothing" in markdown
    assert "gold labels (a label rate of" in markdown or "No label rate lets" in markdown
    assert "flyspec gate label --store" in markdown and "## Judge and gold labels" in markdown
    assert "interval bets version 2 (at most 0.99 of the largest safe bet)" in markdown
    # Every answer is in: the report says the labels are missing, not that the run is incomplete.
    assert "incomplete" not in markdown and "all 13 registered questions have both answers" in markdown
    registered = report.run.registration
    assert registered["gold"] == {
        "rate": 1.0,
        "seed": 0,
        "source": "human",
        "all": False,
        "draw": 2,
        "bet": 2,
    }
    judge = registered["judge"]
    assert judge["model"] == "judge" and judge["served_model"] == {"id": "judge", "root": "/w/judge"}
    assert judge["sampling"] == {"temperature": 0.0, "max_tokens": 64, "seed": 7}
    assert "Verdict: tie" in judge["template_text"] and len(judge["template_sha256"]) == 64
    assert assert_registrations_round_trip(tmp_path / "judge.db") == ["gate"]

    with GateStore(tmp_path / "judge.db") as store:
        run, gold = gold_rule(store, run_id)
        todo = pending(store, run, gold, {})
        assert len(todo) == 12
        for pair in todo:
            truth = _person(int(pair.question.question_id[1:]))
            a_better = truth == (1 if pair.a_is_candidate else -1)
            record(store, run, pair, "t" if truth == 0 else "a" if a_better else "b")
        assert pending(store, run, gold, {}) == []
    report = build_report(tmp_path / "judge.db", run_id)
    g = report.gold
    assert g is not None and g.labelled == 12 and g.awaiting == 0
    # The judge's verdicts have the sign of every label: 3 lost and 1 gained where the person saw a loss
    # and a gain, prediction 0 (ties, orders that disagree, unreadable verdicts) where both answers were
    # equally good.
    assert g.agreement == 1.0
    pooled = report.pooled
    assert pooled is not None and pooled.ci_low is not None and pooled.ci_high is not None
    truth = sum(_person(i) for i in range(QUESTIONS)) / QUESTIONS
    assert pooled.ci_low <= truth <= pooled.ci_high
    markdown = report.to_markdown()
    assert "The judge agreed with gold on" in markdown
    # The decision is the prediction-powered interval's, described as such, with the gold labels counted;
    # no accuracy is built from the judge's verdicts and Tango's interval is not named.
    assert "prediction-powered" in report.rule() and "Tango" not in markdown and " acc " not in markdown
    assert report.decision_object()["method"].startswith("prediction-powered betting interval")
    assert "## Judged pairs and gold labels" in markdown and "What is proven, for this run's draw" in markdown
    assert all(c.baseline_accuracy is None for c in report.comparisons) and "<img" in report.to_html()
    pooled_row = report.gold.rows[-1]  # type: ignore[union-attr]
    assert (pooled_row.gold_baseline, pooled_row.gold_equal, pooled_row.gold_candidate) == (3, 8, 1)
    _run(url, tmp_path, gold_rate=1.0)
    assert len(state.judge_prompts) == 2 * JUDGED


RUBRIC = "A good line says good; a bad one says bad."


def _check_rubric(answer: str) -> None:
    if "good" not in answer:
        raise ValueError("a rubric says what a good answer does")


def test_a_second_model_graded_grader_runs_through_a_judged_run_with_no_edit_elsewhere(
    server: tuple[Scripted, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rubric judge registered from outside (a model-graded grader whose reference, the rubric, is
    required and shown to the judge) is one ``register_grader`` call: its rows load and a row without its
    rubric, or with one its check refuses, is refused; a run of its questions without --judge is refused
    naming it; with the loopback judge every differing pair is judged in both orders with the rubric in the
    prompt, the gold rule is registered, the report counts the judge's rulings and waits for labels, and
    once a person labelled the drawn pairs it decides on them. Nothing in runs/, report/ or data/ names
    the grader (tests/test_code_rules.py checks that no code outside grading/ compares a grader's name)."""
    from flyspec.gate.data.questions import load_dataset
    from flyspec.gate.data.results import gold_rule, pending, record
    from flyspec.gate.grading import graders

    monkeypatch.setattr(graders, "_REGISTRY", dict(graders._REGISTRY))  # registered for this test only
    graders.register_grader(graders.Grader("rubric", check=_check_rubric, model_graded=True))
    state, url = server
    assert len(load_dataset(str(_dataset(tmp_path, "rubric", RUBRIC)))) == QUESTIONS
    with pytest.raises(ValueError, match="row is missing its answer"):
        load_dataset(str(_dataset(tmp_path, "rubric")))
    with pytest.raises(ValueError, match="a rubric says what a good answer does"):
        load_dataset(str(_dataset(tmp_path, "rubric", "be nice")))
    dataset = _dataset(tmp_path, "rubric", RUBRIC)
    arm = {"base_url": url, "model": "base"}
    with pytest.raises(ValueError, match="grader 'rubric': give the judge endpoint with --judge"):
        run_gate(tmp_path / "none.db", str(dataset), arm, arm, 0.5, progress=False)

    run_id = _run(url, tmp_path, dataset=dataset, gold_rate=1.0)
    assert len(state.judge_prompts) == 2 * JUDGED
    assert all(f"[Reference answer, which may be incomplete]\n{RUBRIC}" in p for p in state.judge_prompts)
    report = build_report(tmp_path / "judge.db", run_id)
    assert report.judge is not None and report.judge.questions == QUESTIONS
    assert (report.judge.baseline_better, report.judge.candidate_better) == (3, 1)
    assert report.decision == "INCONCLUSIVE" and report.gold is not None and report.gold.selected == JUDGED
    with GateStore(tmp_path / "judge.db") as store:
        run, gold = gold_rule(store, run_id)
        for pair in pending(store, run, gold, {}):
            truth = _person(int(pair.question.question_id[1:]))
            a_better = truth == (1 if pair.a_is_candidate else -1)
            record(store, run, pair, "t" if truth == 0 else "a" if a_better else "b")
    report = build_report(tmp_path / "judge.db", run_id)
    assert report.gold is not None and report.gold.labelled == JUDGED and report.gold.agreement == 1.0
    pooled = report.pooled
    assert pooled is not None and pooled.ci_low is not None and pooled.ci_high is not None
    truth = sum(_person(i) for i in range(QUESTIONS)) / QUESTIONS
    assert pooled.ci_low <= truth <= pooled.ci_high and pooled.decision in ("PASS", "INCONCLUSIVE")


def test_the_judge_is_asked_over_kept_alive_connections(server: tuple[Scripted, str], tmp_path: Path) -> None:
    """The judge's 24 calls (12 questions, both orders) at concurrency 2 travel over at most 2 connections,
    kept alive between calls, not one connection (and one TLS handshake, for a remote judge) per call."""
    state, url = server
    judge = {"base_url": url, "model": "judge", "max_tokens": 64, "seed": 7, "concurrency": 2}
    arm = {"base_url": url, "max_retries": 0}
    run_gate(
        tmp_path / "judge.db", str(_dataset(tmp_path)), {**arm, "model": "base"}, {**arm, "model": "cand"},
        0.5, judge=judge, max_tokens=16, progress=False,
    )  # fmt: skip
    assert len(state.judge_prompts) == 2 * JUDGED
    assert 1 <= len(state.judge_ports) <= 2, state.judge_ports


def test_a_sequential_judged_run_waits_for_its_labels(server: tuple[Scripted, str], tmp_path: Path) -> None:
    """A sequential judged run registers the prediction-powered method and its label rate; its in-order
    prefix stops at the first drawn pair without a label, so a run with none stops nowhere (INCONCLUSIVE,
    waiting), and the same stop is recomputed by the report."""
    _, url = server
    run_id = _run(url, tmp_path, 0.3, sequential=True, gold_rate=0.5)
    report = build_report(tmp_path / "judge.db", run_id)
    stop = report.sequential
    plan = report.sequential_plan
    assert plan is not None and plan.method == "ppi-mixture" and plan.label_rate == 0.5
    assert stop is not None and stop.decision == "INCONCLUSIVE" and stop.awaiting_label
    assert report.gold is not None and report.gold.awaiting >= 1


def test_a_judged_run_registered_before_bet_versions_resumes_with_its_bets(
    server: tuple[Scripted, str], tmp_path: Path
) -> None:
    """A sequential judged run registered before the interval's bets had versions reads as bets version 1,
    the same command resumes it (no change in its registration) and its report names version 1; a new
    run registers version 2."""
    _, url = server
    run_id = _run(url, tmp_path, 0.3, sequential=True, gold_rate=0.5)
    assert build_report(tmp_path / "judge.db", run_id).gold.bet == 2  # type: ignore[union-attr]
    as_registered_before_bet_versions(tmp_path / "judge.db", run_id)
    assert _run(url, tmp_path, 0.3, sequential=True, gold_rate=0.5) == run_id
    report = build_report(tmp_path / "judge.db", run_id)
    assert report.gold is not None and report.gold.bet == 1
    assert report.sequential_plan is not None and report.sequential_plan.label_bet == 1
    assert "interval bets version 1" in report.to_markdown()
    assert "bet" not in report.run.registration["gold"]


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
    first_calls = dict(state.arm_calls)
    state.fail.clear()
    run_id = _run(url, tmp_path)
    asked = Counter((_question(p), _position(p)) for p in state.judge_prompts)
    assert set(asked.values()) == {1} and len(asked) == 2 * JUDGED
    # A question stored by the first run is not asked again; one that was not (q5, and any pair whose
    # answers were still in flight when the judge failed) is answered once more.
    for (arm, index), calls in state.arm_calls.items():
        stored = f"q{index}" in answered
        assert calls == first_calls.get((arm, index), 0) + (0 if stored else 1), (arm, index)
    assert state.arm_calls[("base", 5)] == 2
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


OPEN_PROMPTS = [
    "Describe a quiet morning.",
    "Give one tip for learning to cook.",
    "What makes a good friend?",
]


def test_smollm2_judge_through_flyspec_serve(tmp_path: Path, tiny_models: TinyModels) -> None:
    """SmolLM2-135M-Instruct, prepared in the model zoo, judges two tiny engine arms (standard vs FLy) on
    open-ended chat prompts through a real `flyspec serve` on loopback: every question is judged in both
    orders, every verdict is stored, the pooled counts are the judge's outcomes, and the report shows the
    position-swap counts (a 135M judge is weak; the point is that the whole path is real)."""
    from zoo import SMOLLM2, zoo_model

    zoo_model(SMOLLM2)
    pair = tiny_models.forgiving_pair()
    spec = {"model": pair["draft"], "num_speculative_tokens": 3}
    base = {"kind": "engine", "model": pair["target"], "dtype": "float32", "max_num_seqs": 4}
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
    args = [
        "smollm2-135m-instruct",
        "--served-model-name",
        "smollm2",
        "--dtype",
        "float32",
        "--max-num-seqs",
        "2",
    ]
    with flyspec_serve(args, tmp_path / "judge.log", timeout_s=180) as url:
        store = tmp_path / "smol.db"
        judge = {"base_url": url, "model": "smollm2", "max_tokens": 48, "concurrency": 2}
        run_id = run_gate(
            store, str(dataset), baseline, candidate, 0.5, judge=judge, max_tokens=12, progress=False
        )
    report = build_report(store, run_id)
    j, pooled = report.judge, report.pooled
    assert j is not None and pooled is not None
    asked = len(OPEN_PROMPTS) - j.identical
    assert j.questions == len(OPEN_PROMPTS) and j.verdicts == 2 * asked
    assert j.baseline_better + j.candidate_better + j.ties + j.identical + j.undecided == len(OPEN_PROMPTS)
    assert (pooled.lost, pooled.gained) == (j.baseline_better, j.candidate_better)
    with GateStore(store) as opened:
        outputs = [r.output for r in opened.judgements(run_id)]
    assert len(outputs) == 2 * asked and all(isinstance(o, str) for o in outputs)
    markdown = report.to_markdown()
    print(markdown[markdown.index("## Judge") : markdown.index("**Rule.**")])
    assert "| pairs | identical (tie) | judge: baseline better | judge: candidate better |" in markdown
    assert report.run.registration["judge"]["served_model"]["id"] == "smollm2"
