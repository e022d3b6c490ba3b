"""A shadow run is a registered judged gate run (SPEC 11.6): real parts on loopback (scripted OpenAI
servers as baseline, candidate and judge; the shadow app on uvicorn; the official openai client), the
gate's own store, judge machinery, labelling functions and report."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from registrations import as_registered_before_bet_versions
from shadow_harness import arm, judge_preferring, label_all, metric, shadow_run, shadow_run_parts, upstream

from flyspec.bench.peers import free_port
from flyspec.bench.scripted_openai import Script
from flyspec.gate.data.store import GateStore
from flyspec.gate.shadow import run as worker
from flyspec.gate.shadow.mirror import SamplingRule
from flyspec.gate.shadow.run import CLAIM, DATASET, ERRORS

ROOT = Path(__file__).resolve().parent.parent
ENTRY = [sys.executable, "-c", "from flyspec.cli import main; main()", "gate"]


def wait_until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def answers(store: Path, run_id: str = "shadow") -> int:
    with GateStore(store) as opened:
        return len(opened.answers(run_id))


def ask(client: OpenAI, i: int, stream: bool = False) -> str:
    """One chat request through the shadow; returns the text the client received."""
    messages = [{"role": "user", "content": f"question {i}"}]
    if stream:
        chunks = client.chat.completions.create(model="m", messages=messages, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return client.chat.completions.create(model="m", messages=messages).choices[0].message.content or ""


def report_json(store: Path, run_id: str = "shadow") -> dict:
    done = subprocess.run(
        [*ENTRY, "report", "--store", str(store), "--run", run_id, "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.returncode in (0, 1), done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_pairs_become_a_registered_judged_run_that_decides(tmp_path: Path) -> None:
    """Mirrored pairs land in the gate store as a registered judged run (questions in arrival order, both
    answers, both orders' verdicts, the pair record); people's labels through `gate label`'s functions
    move the decision; /decision is `gate report --json`'s decision object and the gauges agree; at the
    decision mirroring stops while clients keep getting the baseline's answers."""
    store = tmp_path / "shadow.db"
    with (
        upstream(Script("base")) as base,
        upstream(Script("cand")) as cand,
        upstream(judge_preferring("base")) as judge,
    ):
        arms = (arm(base + "/v1", "base"), arm(cand + "/v1", "cand"))
        with shadow_run(store, *arms, {"base_url": judge + "/v1", "model": "judge"}) as (root, run):
            client = OpenAI(base_url=root + "/v1", api_key="none", max_retries=0)
            for i in range(12):
                assert ask(client, i, stream=i % 2 == 1) == Script("base").text()
            wait_until(lambda: answers(store) == 24, "both answers of 12 judged pairs")
            assert httpx.get(root + "/decision").json()["decision"] == "INCONCLUSIVE"  # no gold label yet
            assert metric(root, "flyspec_shadow_labels_waiting") == 12

            with GateStore(store) as opened:
                reg = opened.get_run("shadow").registered
                questions = opened.questions("shadow")
                verdicts = opened.judgements("shadow")
            assert reg.kind == "gate" and reg.design == "sequential" and reg.margin == 0.05
            assert reg.shadow.sampling == SamplingRule(1.0).describe()
            assert reg.shadow.claim == CLAIM and reg.shadow.errors == ERRORS
            assert reg.gold.rate == 1.0 and reg.gold.source == "human" and reg.judge.model == "judge"
            assert [q.question_id for q in questions] == [str(p.id) for p in run.pairs.pairs()]
            assert [q.position for q in questions] == list(range(12))
            assert {q.dataset for q in questions} == {DATASET} and {q.grader for q in questions} == {"judge"}
            assert len(verdicts) == 24 and {v.position for v in verdicts} == {"AB", "BA"}
            assert all(v.preferred == "first" for v in verdicts)  # the judge prefers the baseline
            assert all(p.candidate["acceptance"]["num_drafts"] == 3 for p in run.pairs.pairs())

            shown = subprocess.run(
                [*ENTRY, "label", "--store", str(store)],
                input="q\n",
                capture_output=True,
                text=True,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                timeout=120,
            )
            assert "12 pair(s) wait" in shown.stdout and "[user] question 0" in shown.stdout, shown.stderr
            assert label_all(store) == 12
            wait_until(lambda: httpx.get(root + "/decision").json()["decision"] == "FAIL", "the decision")
            decision = httpx.get(root + "/decision").json()
            assert decision == report_json(store)["decision"]
            assert metric(root, "flyspec_shadow_decision") == -1
            assert metric(root, "flyspec_shadow_interval_low") == decision["low"]
            assert metric(root, "flyspec_shadow_interval_high") == decision["high"]
            assert metric(root, "flyspec_shadow_labels_waiting") == 0
            assert metric(root, "flyspec_shadow_judge_agreement") == decision["judge_agreement"] == 1.0
            wait_until(lambda: metric(root, "flyspec_shadow_mirroring") == 0, "mirroring to stop")
            before = metric(root, 'flyspec_shadow_skipped_total{reason="stopped"}')
            assert ask(client, 99) == Script("base").text()
            wait_until(
                lambda: metric(root, 'flyspec_shadow_skipped_total{reason="stopped"}') == before + 1,
                "the request after the decision to be counted as not mirrored",
            )
            page = httpx.get(root + "/status").text
            assert "FAIL" in page and "Traffic drifts" in page and "Judge agreement with gold" in page
    assert stat.S_IMODE(store.stat().st_mode) == 0o600


def test_a_changed_registration_is_refused_and_the_same_one_resumes(tmp_path: Path) -> None:
    """The same settings resume the run (one registered before the interval's bets had versions too, with
    its version 1); another margin on a run with pairs is refused, naming it."""
    store = tmp_path / "shadow.db"
    with upstream(Script("base")) as base, upstream(Script("cand")) as cand:
        judge_arm = {"base_url": base + "/v1", "model": "j"}
        arms = (arm(base + "/v1", "base"), arm(cand + "/v1", "cand"), judge_arm)
        with shadow_run(store, *arms) as (root, _):
            ask(OpenAI(base_url=root + "/v1", api_key="none", max_retries=0), 1)
            wait_until(lambda: answers(store) == 2, "one judged pair")
        _, again = shadow_run_parts(store, *arms)
        assert not again.new and again.stored == 1
        assert again.registration.gold is not None and again.registration.gold.bet == 2
        again.close()
        # A run registered before the interval's bets had versions resumes with version 1.
        as_registered_before_bet_versions(store, "shadow")
        _, older = shadow_run_parts(store, *arms)
        assert not older.new and older.registration.gold is not None and older.registration.gold.bet == 1
        older.close()
        with pytest.raises(ValueError, match="registered with different settings.*margin"):
            shadow_run_parts(store, *arms, margin=0.02)
        # The alpha ledger counts a shadow run like any look: the same comparison in another store is refused.
        with pytest.raises(ValueError, match="spent 0.025 of its error budget"):
            shadow_run_parts(tmp_path / "other.db", *arms)


def test_an_unreachable_judge_or_candidate_changes_nothing_for_clients(tmp_path: Path) -> None:
    """With the judge down, clients get exactly the baseline's answers and every pair is stored, waiting
    for the judge; a candidate that is down gives wrong answers (the registered rule), which decide."""
    down = f"http://127.0.0.1:{free_port()}/v1"
    with upstream(Script("base")) as base, upstream(Script("cand")) as cand:
        store = tmp_path / "judge-down.db"
        judge_arm = {"base_url": down, "model": "judge", "max_retries": 0}
        arms = (arm(base + "/v1", "base"), arm(cand + "/v1", "cand"))
        with shadow_run(store, *arms, judge_arm) as (root, run):
            client = OpenAI(base_url=root + "/v1", api_key="none", max_retries=0)
            assert all(ask(client, i, stream=i % 2 == 0) == Script("base").text() for i in range(6))
            wait_until(lambda: run.pairs.count() == 6, "6 stored pairs")
            assert answers(store) == 0 and httpx.get(root + "/decision").json()["n"] == 0

        store = tmp_path / "candidate-down.db"
        judge_arm = {"base_url": base + "/v1", "model": "judge"}
        # Another candidate (the ledger would refuse a second look at the same comparison).
        with shadow_run(store, arm(base + "/v1", "base"), arm(down, "cand-down"), judge_arm) as (root, run):
            client = OpenAI(base_url=root + "/v1", api_key="none", max_retries=0)
            for i in range(40):
                assert ask(client, i) == Script("base").text()
            wait_until(lambda: httpx.get(root + "/decision").json()["decision"] == "FAIL", "a FAIL")
            with GateStore(store) as opened:
                stored = opened.answers("shadow")
            assert {a.correct for a in stored if a.arm == "candidate"} == {False}
            assert {a.correct for a in stored if a.arm == "baseline"} == {True}
            assert not opened_judgements(store)


def test_a_run_graded_against_the_baseline_decides_without_a_judge(tmp_path: Path) -> None:
    """--grader equivalent_to_baseline: a candidate whose answers equal production's PASSes, with no judge
    and no label; the report, /decision and the gauges agree."""
    store = tmp_path / "shadow.db"
    with upstream(Script("base")) as base, upstream(Script("base")) as same:
        arms = (arm(base + "/v1", "base"), arm(same + "/v1", "same"), None)
        with shadow_run(store, *arms, margin=0.2, grader="equivalent_to_baseline:whitespace") as (root, run):
            client = OpenAI(base_url=root + "/v1", api_key="none", max_retries=0)
            i = 0
            while httpx.get(root + "/decision").json()["decision"] != "PASS":
                assert i < 200, "no PASS after 200 identical answers"
                assert ask(client, i, stream=i % 2 == 0) == Script("base").text()
                i += 1
            assert run.registration.judge is None and run.registration.gold is None
            decision = httpx.get(root + "/decision").json()
            assert decision == report_json(store)["decision"]
            assert metric(root, "flyspec_shadow_decision") == 1
            assert metric(root, "flyspec_shadow_interval_low") == decision["low"] > -0.2
            assert metric(root, "flyspec_shadow_labels_waiting") == 0
            agreement = metric(root, "flyspec_shadow_judge_agreement")
            assert agreement != agreement  # NaN: no judge, no label
        with GateStore(store) as opened:
            assert {q.grader for q in opened.questions("shadow")} == {"equivalent_to_baseline:whitespace"}
            assert {a.correct for a in opened.answers("shadow")} == {True}
    with pytest.raises(ValueError, match="--judge JUDGE or --grader"):
        shadow_run_parts(tmp_path / "other.db", *arms[:2], None, grader=None)


def test_a_failing_judge_is_asked_again_once_it_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A judge that answers 500 leaves clients untouched and the pairs stored, waiting; once it answers,
    the waiting pairs are judged (asked again after the retry pause, here shortened)."""
    monkeypatch.setattr(worker, "JUDGE_RETRY_S", 0.3)
    healthy = threading.Event()
    judge = judge_preferring("base")
    prefer = judge.reply
    assert prefer is not None

    def reply(body: dict) -> str:
        if not healthy.is_set():
            raise RuntimeError("the judge is down")  # the scripted server answers 500
        return prefer(body)

    judge.reply = reply
    store = tmp_path / "shadow.db"
    with upstream(Script("base")) as base, upstream(Script("cand")) as cand, upstream(judge) as j:
        judge_arm = {"base_url": j + "/v1", "model": "judge", "max_retries": 0}
        with shadow_run(store, arm(base + "/v1", "base"), arm(cand + "/v1", "cand"), judge_arm) as (
            root,
            run,
        ):
            client = OpenAI(base_url=root + "/v1", api_key="none", max_retries=0)
            assert all(ask(client, i) == Script("base").text() for i in range(4))
            wait_until(lambda: run.pairs.count() == 4, "4 stored pairs")
            time.sleep(0.5)
            assert answers(store) == 0
            healthy.set()
            wait_until(lambda: answers(store) == 8, "the 4 pairs judged once the judge answers")
            assert len(opened_judgements(store)) == 8


def opened_judgements(store: Path) -> list:
    with GateStore(store) as opened:
        return opened.judgements("shadow")


def _command(store: Path, port: int, base: str, cand: str, judge: str) -> list[str]:
    return [
        *ENTRY,
        "shadow",
        "--baseline",
        json.dumps(arm(base + "/v1", "base")),
        "--candidate",
        json.dumps(arm(cand + "/v1", "cand")),
        "--judge",
        json.dumps({"base_url": judge + "/v1", "model": "judge"}),
        "--store",
        str(store),
        "--margin",
        "0.05",
        "--port",
        str(port),
        "--gold-rate",
        "1.0",
    ]


def _start(command: list[str], root: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True
    )
    wait_until(lambda: _up(root) or process.poll() is not None, "the shadow process to listen", 60)
    assert process.poll() is None, process.stderr.read() if process.stderr else ""
    return process


def _up(root: str) -> bool:
    try:
        return httpx.get(root + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_killed_shadow_process_resumes_its_run_losing_and_duplicating_nothing(tmp_path: Path) -> None:
    """`kill -9` of `flyspec gate shadow` mid-traffic, then the same command: every pair stored before the
    kill is still there once, registered in arrival order and judged, and the run continues; the process
    serves the labelling page (on loopback, no token) with each drawn pair's request read from the stored
    traffic."""
    store = tmp_path / "shadow.db"
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    with (
        upstream(Script("base")) as base,
        upstream(Script("cand", delay_s=0.05)) as cand,
        upstream(judge_preferring("base")) as judge,
    ):
        command = _command(store, port, base, cand, judge)
        process = _start(command, root)
        stop = threading.Event()

        def traffic() -> None:
            client = OpenAI(base_url=root + "/v1", api_key="none", max_retries=0, timeout=5)
            i = 0
            while not stop.is_set():
                try:
                    ask(client, i, stream=i % 3 == 0)
                except Exception:  # the process is being killed: clients see it, the test does not care
                    time.sleep(0.05)
                i += 1

        drivers = [threading.Thread(target=traffic) for _ in range(4)]
        for t in drivers:
            t.start()
        try:
            wait_until(lambda: metric(root, "flyspec_shadow_pairs_total") >= 15, "15 pairs")
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
        finally:
            stop.set()
            for t in drivers:
                t.join()
        with GateStore(store) as opened:
            before = {p.question_id for p in opened.questions("shadow")}
        with sqlite3.connect(store) as db:
            stored_before = [r[0] for r in db.execute("SELECT id FROM shadow_pairs ORDER BY id")]
        assert len(stored_before) >= 15

        process = _start(command, root)
        try:
            client = OpenAI(base_url=root + "/v1", api_key="none", max_retries=0)
            for i in range(5):
                assert ask(client, 1000 + i) == Script("base").text()
            wait_until(lambda: metric(root, "flyspec_shadow_pairs_total") == 5, "5 more pairs")
            with sqlite3.connect(store) as db:
                ids = [r[0] for r in db.execute("SELECT id FROM shadow_pairs ORDER BY id")]
            assert ids[: len(stored_before)] == stored_before and len(ids) == len(stored_before) + 5
            wait_until(lambda: answers(store) == 2 * len(ids), "every stored pair judged")
            with GateStore(store) as opened:
                questions = opened.questions("shadow")
                keys = [(a.arm, a.question_id) for a in opened.answers("shadow")]
            assert [q.question_id for q in questions] == [str(i) for i in ids]
            assert [q.position for q in questions] == list(range(len(ids)))
            assert before <= {q.question_id for q in questions}
            assert len(keys) == len(set(keys)) == 2 * len(ids)
            queue = httpx.get(root + "/label/api/queue", params={"labeller": "tester"}).json()
            assert len(queue["pairs"]) == len(ids)  # every pair drawn (rate 1), none labelled yet
            assert all("question" in p["request"] for p in queue["pairs"])
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=20)
        assert "resumed" in (process.stderr.read() if process.stderr else "")
