"""`flyspec gate plan/run/report` through the real console entry point `flyspec.cli.main`.

Two tests run it as a subprocess (as a user would); the rest call `main()` in-process with the same
argv, which exercises the same code (including the one-line error handling) without paying for a new
interpreter per command on a shared CPU.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from loopback import serve_app
from registrations import assert_registrations_round_trip

from flyspec.gate.data.spec import Registration
from flyspec.gate.data.store import AnswerRecord, GateStore, RegisteredQuestion
from flyspec.gate.report.build import build_report
from flyspec.gate.stats import mcnemar, net_difference_ci

ENTRY = [sys.executable, "-c", "from flyspec.cli import main; main()", "gate"]


def _subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*ENTRY, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture()
def flyspec(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run `flyspec gate ARGS...` in-process; returns (exit code, stdout, stderr)."""
    from flyspec.cli import main

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["flyspec", "gate", *args])
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


def _last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def _store(path: Path, n: int, lost: int, gained: int, margin: float = 0.05, unanswered: int = 0) -> Path:
    """A gate store holding a run with the given paired counts (both wrong on every 5th other question);
    ``unanswered`` more questions are registered but have no answers (an interrupted run)."""
    registration = {
        "margin": margin,
        "alpha": 0.025,
        "seed": 0,
        "sampling": {"temperature": 0.0, "top_p": 1.0, "max_tokens": 8},
        "arms": {"baseline": {"kind": "openai", "model": "a"}, "candidate": {"kind": "openai", "model": "b"}},
        "datasets": {"ds": {"sha256": "ab" * 32, "questions": n + unanswered}},
    }
    questions = [RegisteredQuestion("ds", f"q{i}", i, f"h{i}", "1", "exact") for i in range(n + unanswered)]
    with GateStore(path) as store:
        store.register("gate", Registration.read("gate", registration), questions)
        for i in range(n):
            base_right = not (lost <= i < lost + gained) and not (i >= lost + gained and i % 5 == 0)
            cand_right = i >= lost and not (i >= lost + gained and i % 5 == 0)
            for arm, right in (("baseline", base_right), ("candidate", cand_right)):
                store.add_answer(
                    "gate",
                    AnswerRecord(
                        arm, 0, "ds", f"q{i}", 1, "x", "x", right, "stop", 5, 4, 0.1, 2, 6, 3, 1, "u"
                    ),
                )
        store.add_batch("gate", "baseline", 0, n, 4 * n, 2.0)
        store.add_batch("gate", "candidate", 0, n, 4 * n, 1.0)
    return path


def test_plan_json_and_text() -> None:
    """`gate plan` prints the Connor sample size and ends with JSON holding `questions`; with --margin it
    adds the non-inferiority plan."""
    done = _subprocess("plan", "--net-loss", "0.02", "--flip-rate", "0.06", "--json")
    assert done.returncode == 0 and "1175 questions" in done.stdout
    assert _last_json(done.stdout)["questions"] == 1175
    done = _subprocess("plan", "--net-loss", "0.01", "--flip-rate", "0.06", "--margin", "0.02", "--json")
    result = _last_json(done.stdout)
    assert result["questions"] == 4707 and result["noninferiority"]["questions_if_equal"] > 0


def test_plan_bad_input_is_one_line_error() -> None:
    """An impossible plan (net loss above the flip rate) is one `error:` line on stderr, exit 2."""
    done = _subprocess("plan", "--net-loss", "0.1", "--flip-rate", "0.06")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: net_loss=0.1 exceeds flip_rate=0.06: the net difference cannot exceed the flip rate"
    ]


@pytest.mark.parametrize(
    ("n", "lost", "gained", "decision", "code", "strict_code"),
    [
        (200, 1, 2, "PASS", 0, 0),
        (100, 30, 2, "FAIL", 1, 1),
        (20, 2, 1, "INCONCLUSIVE", 0, 2),
    ],
)
def test_report_decisions_and_exit_codes(
    flyspec, tmp_path: Path, n: int, lost: int, gained: int, decision: str, code: int, strict_code: int
) -> None:
    """`gate report` decides on the registered margin: exit 0 PASS, 1 FAIL, INCONCLUSIVE 0 (2 with
    --strict); --json ends with the decision object, whose counts and interval are the stored ones."""
    store = _store(tmp_path / "s.sqlite", n, lost, gained)
    done = flyspec("report", "--store", str(store), "--json")
    assert done.returncode == code, done.stderr
    report = _last_json(done.stdout)
    assert list(report)[-1] == "decision"
    d = report["decision"]
    assert (d["decision"], d["n"], d["lost"], d["gained"]) == (decision, n, lost, gained)
    assert d["ci"] == pytest.approx(list(net_difference_ci(n, lost, gained)))
    assert d["exact_p"] == pytest.approx(mcnemar(lost, gained).exact_p)
    assert (d["questions_needed"] is not None) == (decision == "INCONCLUSIVE")
    assert flyspec("report", "--store", str(store), "--strict").returncode == strict_code
    text = flyspec("report", "--store", str(store)).stdout
    assert f"## Decision: **{decision}**" in text and "**Rule.**" in text


def test_report_margin_override_is_exploratory_only(flyspec, tmp_path: Path) -> None:
    """Asking for another margin than the registered one warns on stderr and at the top of the report and
    adds an exploratory decision, but never changes the registered decision: not `registered_decision`,
    not the decision object's `decision`, not the exit code (here PASS, exit 0 even with --strict, while
    the exploratory 0.1-point margin reads INCONCLUSIVE)."""
    store = _store(tmp_path / "s.sqlite", 200, 1, 2, margin=0.05)
    done = flyspec("report", "--store", str(store), "--margin", "0.001", "--json", "--strict")
    assert done.returncode == 0
    assert "WARNING: USING MARGIN 0.001 INSTEAD OF THE REGISTERED 0.05" in done.stderr
    report = _last_json(done.stdout)
    assert report["margin_overridden"] is True and report["registered_margin"] == 0.05
    assert report["registered_decision"] == report["decision"]["decision"] == "PASS"
    assert report["decision"]["margin"] == 0.05
    assert report["exploratory"]["decision"] == "INCONCLUSIVE" and report["exploratory"]["margin"] == 0.001
    text = flyspec("report", "--store", str(store), "--margin", "0.001").stdout
    assert text.index("USING MARGIN") < text.index("## Decision: **PASS**") < text.index("Exploratory")


def test_report_html_has_the_plot(flyspec, tmp_path: Path) -> None:
    """--html writes a self-contained page with the interval-vs-margin PNG embedded and the report text."""
    store = _store(tmp_path / "s.sqlite", 100, 30, 2)
    page = tmp_path / "r.html"
    done = flyspec("report", "--store", str(store), "--html", str(page))
    assert done.returncode == 1
    html = page.read_text()
    assert "data:image/png;base64,iVBORw0KGgo" in html and "Decision: **FAIL**" in html


def test_incomplete_run_is_not_decided(tmp_path: Path) -> None:
    """A run with registered questions still unanswered gets no decision (deciding early would be optional
    stopping): INCONCLUSIVE, with the interim reading labelled and a warning naming what is missing."""
    rep = build_report(_store(tmp_path / "s.sqlite", 200, 1, 2, unanswered=10))
    pooled = rep.pooled
    assert pooled is not None and (pooled.n, pooled.registered) == (200, 210)
    assert (pooled.decision, pooled.interim_decision) == ("INCONCLUSIVE", "PASS")
    assert any("only 200 of 210 registered questions" in w for w in rep.warnings)
    assert "interim estimate reads PASS" in rep.to_markdown()
    assert rep.to_dict()["decision"]["interim_decision"] == "PASS"


def test_report_speed_from_the_stored_run(tmp_path: Path) -> None:
    """Speed per arm comes from the same run: tokens/s from batch wall times, acceptance length from the
    stored counters (1 + 3/2), forgiven share 1/3."""
    rep = build_report(_store(tmp_path / "s.sqlite", 50, 2, 2))
    speeds = {s.arm: s for s in rep.speeds}
    assert speeds["baseline"].tokens_per_s == pytest.approx(100.0)
    assert speeds["candidate"].tokens_per_s == pytest.approx(200.0)
    assert speeds["candidate"].mean_acceptance_length == pytest.approx(2.5)
    assert speeds["candidate"].forgiven_share == pytest.approx(1 / 3)


def test_run_bad_input_keeps_everything_stored(flyspec, tmp_path: Path) -> None:
    """`gate run` with a margin outside (0, 1), a dataset row missing its answer, an arm carrying its own
    dataset, or settings that differ from the registered run fails with one clear line (exit 2), and the
    answers already in the store are all still there."""
    store = _store(tmp_path / "s.sqlite", 30, 3, 1)
    with GateStore(store) as opened:
        before = opened.answers("gate")
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "q0", "prompt": "hi", "answer": "1", "grader": "exact"}) + "\n")
    arm = json.dumps({"base_url": "http://127.0.0.1:9/v1", "model": "a"})
    common = ["run", "--store", str(store), "--baseline", arm, "--no-progress"]

    done = flyspec(*common, "--dataset", str(data), "--candidate", arm, "--margin", "1.5")
    assert done.returncode == 2 and done.stderr.startswith("error: margin=1.5: must lie in (0, 1)")

    bad = tmp_path / "bad.jsonl"
    bad.write_text(data.read_text() + json.dumps({"id": "q1", "prompt": "yo", "grader": "exact"}) + "\n")
    done = flyspec(*common, "--dataset", str(bad), "--candidate", arm, "--margin", "0.05")
    assert done.returncode == 2 and f"{bad}:2: row is missing its answer" in done.stderr

    other = json.dumps({"base_url": "http://127.0.0.1:9/v1", "model": "b", "dataset": "gsm8k"})
    done = flyspec(*common, "--dataset", str(data), "--candidate", other, "--margin", "0.05")
    assert done.returncode == 2 and "arm 'candidate': unknown key(s) dataset" in done.stderr

    done = flyspec(*common, "--dataset", str(data), "--candidate", arm, "--margin", "0.05", "--run", "gate")
    assert done.returncode == 2 and "was registered with different settings" in done.stderr
    assert "arms.candidate.model (registered 'b', now 'a')" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("error: run 'gate'")

    with GateStore(store) as opened:
        assert opened.answers("gate") == before


def test_report_errors(flyspec, tmp_path: Path) -> None:
    """A missing store or an unknown run name is one clear error line, exit 2."""
    done = flyspec("report", "--store", str(tmp_path / "none.sqlite"))
    assert done.returncode == 2 and "does not exist" in done.stderr
    store = _store(tmp_path / "s.sqlite", 10, 1, 1)
    done = flyspec("report", "--store", str(store), "--run", "nope")
    assert done.returncode == 2 and "run 'nope' is not in" in done.stderr and "runs: gate" in done.stderr


# --------------------------------------------------------------------------- plain words and honest advice

WORDING_CASES = [
    # (decision, low, high, words that must appear)
    (
        "PASS",
        0.004,
        0.05,
        "The whole interval lies above zero: the candidate is more accurate than the baseline",
    ),
    (
        "PASS",
        -0.015,
        0.01,
        "The whole interval lies above -2 points: the candidate loses less than the margin",
    ),
    ("PASS", -0.015, -0.002, "the candidate is less accurate than the baseline, but by less than the margin"),
    (
        "FAIL",
        -0.08,
        -0.03,
        "The whole interval lies below -2 points: the candidate loses more than the margin",
    ),
    (
        "INCONCLUSIVE",
        -0.05,
        -0.01,
        "the candidate is worse than the baseline; whether by more than the margin of 2 points is not yet "
        "known",
    ),
    ("INCONCLUSIVE", -0.05, 0.03, "the data cannot tell yet whether the candidate stays within 2 points"),
    ("INCONCLUSIVE", -0.05, 0.0, "to no loss at all"),
]


@pytest.mark.parametrize(("decision", "low", "high", "words"), WORDING_CASES)
def test_plain_words_follow_the_numbers(decision: str, low: float, high: float, words: str) -> None:
    """Every case of the decision, with intervals entirely above zero, entirely below zero (within and
    beyond the margin) and straddling it: the sentences quote the interval, say where it lies, end with
    the decision, and never call a shown loss "not proof of harm"."""
    from flyspec.gate.report.advice import explain_decision
    from flyspec.gate.report.model import points

    lines = explain_decision(decision, low, high, 0.02, 250)
    text = " ".join(lines)
    assert words in text and f"{decision}" in lines[-1]
    assert f"between {points(low, 0.0, -0.02)} and {points(high, 0.0, -0.02)} points" in text
    assert "proof of harm" not in text
    assert ("loss detected" in text) == (decision == "INCONCLUSIVE" and high < 0)


def test_plain_words_refuse_a_decision_the_numbers_do_not_support() -> None:
    """The wording function checks the decision against the interval (so it cannot print a PASS the
    interval does not show), keeps enough decimals near the boundary, and says nothing is decided at 0."""
    from flyspec.gate.report.advice import explain_decision

    with pytest.raises(ValueError, match="does not follow from the interval"):
        explain_decision("PASS", -0.05, 0.01, 0.02, 100)
    with pytest.raises(ValueError, match="the rule gives FAIL"):
        explain_decision("INCONCLUSIVE", -0.08, -0.03, 0.02, 100)
    near = " ".join(explain_decision("PASS", -0.01996, 0.01, 0.02, 900))
    assert "between -1.996 and +1.0 points" in near
    assert explain_decision("INCONCLUSIVE", -1.0, 1.0, 0.02, 0) == [
        "No question has been answered by both arms yet, so there is nothing to decide."
    ]


def test_loss_detected_is_worded_as_a_loss_and_advice_is_not_optional_stopping(tmp_path: Path) -> None:
    """An interval entirely below zero but reaching past the margin is INCONCLUSIVE with loss_detected:
    the report says the candidate is worse (never "not proof of harm"), reports the significant McNemar
    test beside the decision, plans nothing that assumes equal accuracy, and recommends neither adding
    questions to this run nor a new look on fresh questions (a store written by hand was checked against no
    ledger, so its whole budget counts as spent): it says to act on the result, and how to keep room for a
    continuation next time."""
    report = build_report(_store(tmp_path / "s.sqlite", 300, 12, 0))
    d = report.to_dict()["decision"]
    assert (d["decision"], d["loss_detected"], d["significant_loss"]) == ("INCONCLUSIVE", True, True)
    assert d["high"] < 0 and d["low"] <= -0.05
    text = report.to_markdown()
    assert "## Decision: **INCONCLUSIVE** (loss detected)" in text
    assert "the candidate is worse than the baseline; whether by more than the margin" in text
    assert "proof of harm" not in text and "register a new, larger run" not in text
    assert "Exact McNemar test, beside the decision: lost 12, gained 0" in text
    advice = " ".join(d["advice"])
    assert "optional stopping" in advice and "--exclude-run" not in advice
    assert "refuses another look at it: act on this result" in advice and "--alpha-budget 0.025" in advice
    assert "a plan that assumes it is as accurate does not apply" in advice


def test_significant_mcnemar_beside_a_pass(tmp_path: Path) -> None:
    """A loss the exact test calls significant but that is shown smaller than the margin is a PASS (the
    old rule called it FAIL); the significant test is reported beside it, with a note."""
    report = build_report(_store(tmp_path / "s.sqlite", 400, 9, 1))
    d = report.to_dict()["decision"]
    assert (d["decision"], d["significant_loss"], d["loss_detected"]) == ("PASS", True, True)
    assert any("loses significantly more questions than it gains" in n for n in report.notes)


def test_zero_flips_plan_from_an_upper_bound(tmp_path: Path) -> None:
    """With no flipped question the flip rate is unknown: the advice says so and plans from the flip
    rate's one-sided upper confidence bound, never from a rate of zero."""
    from flyspec.gate.stats.sizing import plan_noninferiority

    report = build_report(_store(tmp_path / "s.sqlite", 40, 0, 0))
    d = report.to_dict()["decision"]
    plan = plan_noninferiority(0, 40, 0.05, 0.025, 0.8)
    assert d["decision"] == "INCONCLUSIVE" and d["questions_needed"] == plan.questions
    assert d["questions_needed_at_observed"] is None and d["flip_rate_upper"] == pytest.approx(
        plan.flip_rate_upper
    )
    advice = " ".join(d["advice"])
    assert "No question flipped in these 40 pairs, so the flip rate is not known" in advice
    assert f"{100 * plan.flip_rate_upper:.1f}%" in advice


def test_several_margins_on_the_same_data_are_flagged_at_the_top(tmp_path: Path) -> None:
    """A store holding two gate runs on the same data (same dataset hashes) with different margins says so
    in the first warning, above the decision, whichever run is reported."""
    store = _store(tmp_path / "s.sqlite", 50, 2, 2, margin=0.05)
    with GateStore(store) as s:
        original = s.get_run("gate")
        assert original is not None
        s.register("strict", replace(original.registered, margin=0.01), s.questions("gate"))
    for run in ("gate", "strict"):
        report = build_report(store, run)
        assert "SAME DATA WITH DIFFERENT MARGINS" in report.warnings[0]
        text = report.to_markdown()
        assert text.index("DIFFERENT MARGINS") < text.index("## Decision")
    assert build_report(_store(tmp_path / "one.sqlite", 50, 2, 2)).warnings == []


def test_pilot_at_temperature_zero_is_refused_for_batch_invariant_engines(flyspec, tmp_path: Path) -> None:
    """`gate pilot` of a batch-invariant engine baseline at temperature 0 would measure nothing (greedy
    decoding repeats itself): one clear error offering `gate pilot --candidate ARM`, and the store is never
    created."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "q0", "prompt": "hi", "answer": "1", "grader": "exact"}) + "\n")
    arm = json.dumps({"kind": "engine", "model": str(tmp_path / "some-model"), "batch_invariant": True})
    store = tmp_path / "p.sqlite"
    done = flyspec(
        "pilot", "--store", str(store), "--dataset", str(data), "--baseline", arm, "--margin", "0.02"
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "measure nothing" in done.stderr and "gate pilot --candidate ARM" in done.stderr
    assert not store.exists()


def test_sequential_flags_are_checked(flyspec, tmp_path: Path) -> None:
    """`--limit` with `--sequential` and `--sequential` on a pilot are one-line errors naming the rule."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"id": "q0", "prompt": "hi", "answer": "1", "grader": "exact"}) + "\n")
    arm = json.dumps({"base_url": "http://127.0.0.1:9/v1", "model": "a"})
    common = [
        "--store",
        str(tmp_path / "s.sqlite"),
        "--dataset",
        str(data),
        "--baseline",
        arm,
        "--margin",
        "0.02",
    ]
    done = flyspec("run", *common, "--candidate", arm, "--sequential", "--limit", "5")
    assert done.returncode == 2 and "a sequential run takes --max-questions" in done.stderr
    done = flyspec("run", *common, "--candidate", arm, "--max-minutes", "0")
    assert done.returncode == 2 and "max_minutes=0.0: must be a positive number" in done.stderr


# ------------------------------------------------------------- gate run against a scripted endpoint


def _yes_app() -> FastAPI:
    """A scripted OpenAI-compatible server: "right" answers every question "yes" (and so does its alias
    "right-alias", whose card names "right" as its root); "wrong" answers "no"; "quarter" answers "no" to
    every fourth question ("Question i", i divisible by 4)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [{"id": m, "root": m} for m in ("right", "wrong", "quarter")]
        return JSONResponse({"data": [*cards, {"id": "right-alias", "root": "right"}]})

    @app.post("/v1/completions")
    async def complete(request: Request) -> JSONResponse:
        body = await request.json()
        i = int(body["prompt"].split()[-1])
        wrong = body["model"] == "wrong" or (body["model"] == "quarter" and i % 4 == 0)
        return JSONResponse(
            {
                "choices": [{"index": 0, "text": "no" if wrong else "yes", "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            }
        )

    return app


@pytest.fixture(scope="module")
def yes_server() -> Iterator[str]:
    with serve_app(_yes_app()) as url:
        yield url


def _yes_run(flyspec, url: str, store: Path, candidate: str, *extra: str):  # noqa: ANN202
    data = store.parent / "yes.jsonl"
    if not data.exists():
        data.write_text(
            "".join(
                json.dumps({"id": f"q{i}", "prompt": f"Question {i}", "answer": "yes", "grader": "exact"})
                + "\n"
                for i in range(40)
            )
        )
    arm = lambda model: json.dumps({"base_url": url, "model": model})  # noqa: E731
    return flyspec(
        "run", "--store", str(store), "--dataset", str(data), "--baseline", arm("right"),
        "--candidate", arm(candidate), "--margin", "0.3", "--max-tokens", "4", "--no-progress", *extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("candidate", "decision", "code", "strict_code"),
    [("right", "PASS", 0, 0), ("wrong", "FAIL", 1, 1), ("quarter", "INCONCLUSIVE", 0, 2)],
)
def test_run_exits_with_the_report_codes(
    flyspec, yes_server: str, tmp_path: Path, candidate: str, decision: str, code: int, strict_code: int
) -> None:
    """`gate run` ends with `gate report`'s exit code for its decision: 0 PASS, 1 FAIL, INCONCLUSIVE 0 and
    2 with --strict (it used to exit 0 on FAIL, so a CI job gating on it shipped a FAIL)."""
    store = tmp_path / "g.db"
    done = _yes_run(flyspec, yes_server, store, candidate, "--limit", "20", "--json")
    assert _last_json(done.stdout)["decision"]["decision"] == decision
    assert done.returncode == code, done.stderr
    again = _yes_run(flyspec, yes_server, store, candidate, "--limit", "20", "--strict")
    assert again.returncode == strict_code
    assert flyspec("report", "--store", str(store), "--strict").returncode == strict_code


def test_a_comparison_spends_its_alpha_once(flyspec, yes_server: str, tmp_path: Path) -> None:
    """Every look at the same two arms spends alpha from one budget, kept in the user's ledger (docs/gate.md,
    "Error spent once"). After a fixed run at the full alpha, each route to a second full-alpha look is
    refused with one line naming the earlier run and the valid ways forward, and nothing is registered: a
    bigger fixed run, a sequential run, a run that only changes max_tokens, a run on fresh questions
    (`--exclude-run`: under the default claim it tests the same hypothesis about the method), a run in
    another store, the same questions from a renamed copy of the dataset file, a candidate with an inert
    extra_body field, and one named by a model alias. The refusal recommends no fresh questions. A finite
    claim about fresh questions only is another hypothesis; another candidate is another comparison."""
    store = tmp_path / "g.db"
    assert _yes_run(flyspec, yes_server, store, "right", "--run", "small", "--limit", "10").returncode == 0
    copy = tmp_path / "copy" / "renamed.jsonl"
    copy.parent.mkdir()
    copy.write_text((tmp_path / "yes.jsonl").read_text())
    extra = json.dumps({"base_url": yes_server, "model": "right", "extra_body": {"user": "x"}})
    alias = json.dumps({"base_url": yes_server, "model": "right-alias"})
    routes = {
        "bigger": (store, ("--limit", "30")),
        "sequential": (store, ("--sequential", "--max-questions", "20")),
        "max_tokens": (store, ("--limit", "10", "--max-tokens", "5")),
        "fresh questions": (store, ("--limit", "10", "--exclude-run", "small")),
        "another store": (tmp_path / "other.db", ("--limit", "10")),
        "renamed file": (tmp_path / "third.db", ("--limit", "10", "--dataset", str(copy))),
        "inert extra_body": (tmp_path / "fourth.db", ("--limit", "10", "--candidate", extra)),
        "alias": (tmp_path / "fifth.db", ("--limit", "10", "--candidate", alias)),
    }
    for route, (where, args) in routes.items():
        done = _yes_run(flyspec, yes_server, where, "right", "--run", "again", *args)
        *_, error = done.stderr.strip().splitlines()
        assert done.returncode == 2 and error.startswith("error: "), route
        assert done.stderr.count("error:") == 1, route
        assert "fixed run 'small' of" in error and "spent 0.025 of its error budget 0.025" in error
        assert "no error is left for another look" in error and "--exclude-run" not in error
        assert "do not reset the budget" in error, route
        if where.exists():
            with GateStore(where) as opened:
                assert opened.get_run("again") is None, route
    finite = ("--sequential", "--max-questions", "20", "--population", "finite", "--exclude-run", "small")
    done = _yes_run(flyspec, yes_server, store, "right", "--run", "finite", *finite)
    assert done.returncode == 0, done.stderr
    other = _yes_run(flyspec, yes_server, store, "quarter", "--run", "other", "--limit", "10")
    assert other.returncode == 0, other.stderr


def test_a_budget_registered_first_keeps_room_and_is_reported(
    flyspec, yes_server: str, tmp_path: Path
) -> None:
    """A first run registered with `--alpha-budget` keeps room: a sequential continuation at the alpha left
    carries its answers (they lead the registered order and are stored in the continuation, counted once),
    and a third look is refused. Each report names the budget and the earlier looks it was counted with.
    A budget above 0.05 (0.45 allowed 18 looks at 0.025) is refused, and so is a later look's attempt to
    change the budget."""
    budgeted = tmp_path / "b.db"
    big = _yes_run(flyspec, yes_server, budgeted, "quarter", "--limit", "10", "--alpha-budget", "0.45")
    assert big.returncode == 2 and "at most 0.05" in big.stderr, big.stderr
    first = ("--run", "first", "--limit", "10", "--alpha", "0.0125", "--alpha-budget", "0.025")
    assert _yes_run(flyspec, yes_server, budgeted, "quarter", *first).returncode == 0
    more = ("--sequential", "--max-questions", "30", "--population", "finite")
    refused = _yes_run(flyspec, yes_server, budgeted, "quarter", "--run", "more", *more)
    assert refused.returncode == 2 and "--alpha at most 0.0125" in refused.stderr, refused.stderr
    changed = _yes_run(
        flyspec, yes_server, budgeted, "quarter", "--run", "more", *more, "--alpha-budget", "0.05"
    )
    assert changed.returncode == 2 and "a later look cannot change it" in changed.stderr, changed.stderr
    done = _yes_run(flyspec, yes_server, budgeted, "quarter", "--run", "more", *more, "--alpha", "0.0125")
    assert done.returncode == 0, done.stderr
    assert "carries 20 answers of fixed run 'first'" in done.stderr
    with GateStore(budgeted) as opened:
        head = [q.question_id for q in opened.questions("more")][:10]
        assert head == [q.question_id for q in opened.questions("first")]
        assert opened.get_run("more").registration["carries"] == "first"  # type: ignore[union-attr]
    first_ledger = _last_json(flyspec("report", "--store", str(budgeted), "--run", "first", "--json").stdout)
    assert first_ledger["ledger"]["budget"] == 0.025 and first_ledger["ledger"]["alpha"] == 0.0125
    assert first_ledger["ledger"]["earlier"] == [] and first_ledger["decision"]["alpha_budget"] == 0.025
    report = _last_json(flyspec("report", "--store", str(budgeted), "--run", "more", "--json").stdout)
    ledger = report["ledger"]
    assert ledger["budget"] == 0.025 and ledger["alpha"] == 0.0125 and ledger["spent_before"] == 0.0125
    assert len(ledger["earlier"]) == 1 and "fixed run 'first'" in ledger["earlier"][0]
    markdown = flyspec("report", "--store", str(budgeted), "--run", "more").stdout
    assert "Error budget" in markdown and "fixed run 'first'" in markdown
    third = _yes_run(flyspec, yes_server, budgeted, "quarter", "--run", "third", "--limit", "10")
    assert third.returncode == 2 and "fixed run 'first'" in third.stderr and "run 'more'" in third.stderr
    assert "continue sequential run 'more'" in third.stderr, third.stderr


def test_tune_takes_exclude_run_and_exits_0_when_a_setting_passed(
    flyspec, yes_server: str, tmp_path: Path
) -> None:
    """`gate tune --exclude-run RUN` leaves that run's questions out of the calibration and test questions
    (and records it); the tune passes its one lossless setting and exits 0; an unknown run is refused."""
    store = tmp_path / "g.db"
    assert _yes_run(flyspec, yes_server, store, "right", "--run", "first", "--limit", "25").returncode == 0
    spec = {
        "method": "draft_model",
        "model": "d",
        "num_speculative_tokens": 4,
        "rejection_sample_method": "fly",
    }
    candidates = json.dumps([{"arm": {"base_url": yes_server, "model": "right"}, "speculative_config": spec}])
    args = [
        "tune", "--store", str(store), "--dataset", str(tmp_path / "yes.jsonl"), "--baseline",
        json.dumps({"base_url": yes_server, "model": "right"}), "--candidates", candidates, "--margin", "0.3",
        "--order", "given", "--calibration-questions", "2", "--max-tokens", "4", "--no-progress",
        "--population", "finite",
    ]  # fmt: skip
    done = flyspec(*args, "--exclude-run", "nope")
    assert done.returncode == 2 and "--exclude-run nope: no such run" in done.stderr
    done = flyspec(*args, "--exclude-run", "first", "--json")
    assert done.returncode == 0, done.stderr
    tuned = _last_json(done.stdout)
    assert tuned["settings"][0]["decision"] == "PASS"
    # The tune is one look at its setting's comparison, another comparison than the first run's arms.
    (ledger,) = tuned["ledger"]
    assert ledger["alpha"] == 0.025 and ledger["budget"] == 0.025 and ledger["earlier"] == []
    with GateStore(store) as opened:
        first = {q.question_id for q in opened.questions("first")}
        used = {q.question_id for run in ("tune", "tune/calibration") for q in opened.questions(run)}
        registration = opened.get_run("tune").registration  # type: ignore[union-attr]
    assert len(used) == 15 and not first & used
    assert registration["excluded"] == {"runs": ["first"], "questions": 25}


def test_the_advice_simulates_the_registered_design() -> None:
    """The advice's question count is the registered design's own simulated 90th percentile (no scaling
    of a table: at a 5-point margin and 6% flips the old "x (0.02 / margin)^2" rule said 450 where the
    design needs about 530), for the i.i.d. claim and, smaller, for a finite pool."""
    from flyspec.gate.report.advice import sequential_questions

    wide = sequential_questions(0.06, 0.05)
    assert wide is not None and 490 <= wide <= 580
    table = sequential_questions(0.2, 0.02)
    assert table is not None and 8_500 <= table <= 10_500  # docs/statistics.md's table: 9,519
    finite = sequential_questions(0.16, 0.02, population_size=1319)
    assert finite is not None and finite <= 1319 < table


def test_an_inconclusive_sequential_run_is_continued(flyspec, yes_server: str, tmp_path: Path) -> None:
    """A sequential run that reaches its --max-questions undecided advises to continue this same run with
    a question count from the simulation table at the flip rate's upper bound (here more than its 40-question
    pool, so the whole pool), never a fresh run capped at a fixed design's size; rerunning the command
    with that --max-questions continues it: the stored answers are kept, not asked again, the registration
    records the extension, and the confidence sequence goes on along the same order."""
    from flyspec.gate.report.advice import sequential_questions
    from flyspec.gate.stats.sizing import flip_rate_upper_bound

    store = tmp_path / "g.db"
    args = ("--sequential", "--max-questions", "8", "--json")
    first = _last_json(_yes_run(flyspec, yes_server, store, "quarter", *args).stdout)
    d = first["decision"]
    assert d["decision"] == "INCONCLUSIVE" and first["sequential"]["reason"] == "max_questions"
    advice = " ".join(d["advice"])
    flips = d["lost"] + d["gained"]
    target = sequential_questions(flip_rate_upper_bound(flips, 8), 0.3)
    assert target > 40
    assert (
        "Continue this run: rerun the same command with `--max-questions 40` (its whole pool; the " in advice
    )
    assert (
        target is not None
        and f"about {target:,} questions at a 30-point margin" in advice
        and "--exclude-run" not in advice
    )
    query = "SELECT arm, question_id, created_at FROM answers WHERE run_id = 'gate'"
    with sqlite3.connect(store) as db:
        before = {(arm, qid): created for arm, qid, created in db.execute(query)}
    done = _yes_run(flyspec, yes_server, store, "quarter", "--sequential", "--max-questions", "40", "--json")
    assert done.returncode in (0, 1), done.stderr
    second = _last_json(done.stdout)
    assert second["sequential"]["max_questions"] == 40 and second["decision"]["n"] > 8
    with sqlite3.connect(store) as db:
        after = {(arm, qid): created for arm, qid, created in db.execute(query)}
    with GateStore(store) as opened:
        run = opened.get_run("gate")
        events = [e.event for e in opened.events("gate")]
    assert len(before) == 16 and len(after) > len(before)
    assert all(after[key] == created for key, created in before.items())
    assert [(e["from"], e["to"]) for e in run.registration["extensions"]] == [(8, 40)]  # type: ignore[union-attr]
    assert run.registration["sequential"]["max_questions"] == 40 and "extend" in events  # type: ignore[union-attr]
    assert assert_registrations_round_trip(store) == ["gate"]
    shrink = _yes_run(flyspec, yes_server, store, "quarter", "--sequential", "--max-questions", "20")
    assert shrink.returncode == 2 and "registered with different settings" in shrink.stderr


def test_a_run_with_code_questions_records_and_announces_the_sandbox(
    flyspec, yes_server: str, tmp_path: Path
) -> None:
    """A gate run whose dataset has code questions records the code sandbox of this machine in its notes
    and says once, at its start, each protection the sandbox lacks here (none in a root container with
    namespaces and Landlock); the answers ("yes", not a program) are graded wrong by the sandbox."""
    from flyspec.gate.grading.code_exec import isolation

    data = tmp_path / "code.jsonl"
    answer = {"tests": "assert f() == 1", "entry_point": "f"}
    data.write_text(
        "".join(
            json.dumps({"id": f"c{i}", "prompt": f"Question {i}", "answer": answer, "grader": "code"}) + "\n"
            for i in range(3)
        )
    )
    arm = json.dumps({"base_url": yes_server, "model": "right"})
    done = flyspec(
        "run", "--store", str(tmp_path / "c.db"), "--dataset", str(data), "--baseline", arm, "--candidate",
        arm, "--margin", "0.3", "--max-tokens", "4", "--no-progress", "--json",
    )  # fmt: skip
    report = _last_json(done.stdout)
    missing = isolation().missing
    assert report["run_notes"]["code_sandbox"]["missing"] == missing
    assert done.stderr.count("WARNING: the code sandbox runs without") == len(missing)
    assert report["decision"]["n"] == 3 and report["comparisons"][-1]["baseline_accuracy"] == 0.0


def test_a_control_is_caught_first_and_the_candidate_decides_after(
    flyspec, yes_server: str, tmp_path: Path
) -> None:
    """`--control draft=ARM` adds a comparison the gate must FAIL, with its own share of alpha (a fifth by
    default; the candidate keeps the rest, so the chance of any wrong decision stays at most alpha). In a
    sequential run its pairs are answered first: "wrong" FAILs after few questions, the gate stops asking
    it, and the candidate ("right") goes on until its own decision. The report names the control's
    decision before the candidate's; the exit code and the decision object are the candidate's."""
    store = tmp_path / "g.db"
    control = "draft=" + json.dumps({"base_url": yes_server, "model": "wrong"})
    args = ("--sequential", "--population", "finite", "--control", control, "--json")
    done = _yes_run(flyspec, yes_server, store, "right", *args)
    assert done.returncode == 0, done.stderr
    report = _last_json(done.stdout)
    assert report["decision"]["decision"] == "PASS" and report["decision"]["alpha"] == pytest.approx(0.02)
    (ctl,) = report["family"]
    assert ctl["comparison"] == "draft" and ctl["role"] == "control"
    assert ctl["decision"]["decision"] == "FAIL" and ctl["decision"]["alpha"] == pytest.approx(0.005)
    assert ctl["sequential"]["stopped_at"] < report["sequential"]["stopped_at"]
    with GateStore(store) as opened:
        registration = opened.get_run("gate").registration  # type: ignore[union-attr]
    assert registration["family"]["alpha"] == 0.025
    assert [c["name"] for c in registration["comparisons"]] == ["candidate", "draft"]
    assert assert_registrations_round_trip(store) == ["gate"]
    markdown = flyspec("report", "--store", str(store)).stdout
    assert markdown.index("The gate caught a harmful setting") < markdown.index("# The candidate")
    bad = _yes_run(flyspec, yes_server, store, "right", "--run", "x", "--control", "candidate=" + control)
    assert bad.returncode == 2 and "must be an identifier other than baseline" in bad.stderr
