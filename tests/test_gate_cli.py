"""`flyspec gate plan/run/report` through the real console entry point `flyspec.cli.main`.

Two tests run it as a subprocess (as a user would); the rest call `main()` in-process with the same
argv, which exercises the same code (including the one-line error handling) without paying for a new
interpreter per command on a shared CPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from flyspec.gate.report import build_report
from flyspec.gate.stats import mcnemar, net_difference_ci
from flyspec.gate.store import AnswerRecord, GateStore, RegisteredQuestion

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
        store.register("gate", "gate", registration, questions)
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


def test_report_margin_override_warns_loudly(flyspec, tmp_path: Path) -> None:
    """Asking for another margin than the registered one works but warns on stderr and in the report, and
    the JSON says the margin was overridden."""
    store = _store(tmp_path / "s.sqlite", 200, 1, 2, margin=0.05)
    done = flyspec("report", "--store", str(store), "--margin", "0.001", "--json")
    assert "WARNING: USING MARGIN 0.001 INSTEAD OF THE REGISTERED 0.05" in done.stderr
    report = _last_json(done.stdout)
    assert report["margin_overridden"] is True and report["registered_margin"] == 0.05
    assert report["decision"]["decision"] == "INCONCLUSIVE"  # the interval is wider than 0.1 points
    assert "USING MARGIN" in flyspec("report", "--store", str(store), "--margin", "0.001").stdout


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
