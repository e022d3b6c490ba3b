"""A shadow run's live decision (flyspec/gate/shadow/live.py): the run's Monitor, fed as the worker stores
each pair, gives the same decision and interval as `gate report` on the same store after every pair, after
a restart and after labels stored from elsewhere, without rebuilding the report (whose cost grows with
every pair) while traffic flows. Real store, real worker thread, real report; scripted endpoints on
loopback where a judge must answer."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from openai import OpenAI
from shadow_harness import arm, judge_preferring, label_all, shadow_run, shadow_run_parts, upstream

from flyspec.bench.scripted_openai import Script
from flyspec.gate.data.store import GateStore
from flyspec.gate.report import build as report_build
from flyspec.gate.report.build import build_report
from flyspec.gate.shadow import run as shadow_run_module
from flyspec.gate.shadow.pairs import ArmAnswer, MirroredPair

UNREACHABLE = arm("http://127.0.0.1:9/v1", "m")  # never asked: the pairs are handed to the run directly
GRADER = "equivalent_to_baseline:whitespace"


def _pair(i: int, same: bool) -> MirroredPair:
    base = ArmAnswer(f"answer {i}", 200, 0.1, prompt_tokens=3, completion_tokens=2)
    cand = ArmAnswer(f"answer {i}" if same else f"other {i}", 200, 0.1, prompt_tokens=3, completion_tokens=2)
    request = {"messages": [{"role": "user", "content": f"question {i}"}]}
    return MirroredPair(time.time(), "proxy", "/chat/completions", request, base, cand)


def _reported(store: Path) -> tuple[int, float, float]:
    with GateStore(store) as opened:
        d = build_report(opened, "shadow").decision_object()
    code = {"FAIL": -1, "PASS": 1}.get(str(d["decision"]), 0)
    low, high = d["low"], d["high"]
    return code, -1.0 if low is None else float(low), 1.0 if high is None else float(high)  # type: ignore[arg-type]


def _wait_live(run: shadow_run_module.ShadowRun) -> None:
    deadline = time.monotonic() + 10
    while run._live is None:
        assert time.monotonic() < deadline, "the live walk was not built"
        time.sleep(0.02)


def test_the_live_decision_is_the_reports_after_every_pair_and_after_a_restart(tmp_path: Path) -> None:
    """A candidate that differs from production on a seeded 15% of requests, graded against production's
    answers: after each stored pair the live code and interval equal `gate report`'s, through the FAIL
    (the walk stops where the report stops, and later pairs change neither), and a new process on the same
    store goes on from the same state."""
    store = tmp_path / "shadow.db"
    rng = random.Random(7)
    same = [rng.random() > 0.15 for _ in range(400)]
    _, run = shadow_run_parts(store, UNREACHABLE, UNREACHABLE, None, margin=0.02, grader=GRADER)
    run.start()
    try:
        _wait_live(run)
        decided_at = None
        for i in range(60):
            run(_pair(i, same[i]))
            live = run.live()
            assert (live.code, live.low, live.high) == _reported(store), f"after pair {i + 1}"
    finally:
        run.close()
    _, resumed = shadow_run_parts(store, UNREACHABLE, UNREACHABLE, None, margin=0.02, grader=GRADER)
    resumed.start()
    try:
        _wait_live(resumed)
        assert (resumed.live().code, resumed.live().low, resumed.live().high) == _reported(store)
        for i in range(60, 400):
            resumed(_pair(i, same[i]))
            live = resumed.live()
            if decided_at is None and live.code != 0:
                decided_at = i
            if decided_at is None or i in (decided_at, decided_at + 1, 399):
                assert (live.code, live.low, live.high) == _reported(store), f"after pair {i + 1}"
    finally:
        resumed.close()
    assert decided_at is not None and _reported(store)[0] == -1, "a 15% loss against a 2-point margin FAILs"


def test_traffic_never_rebuilds_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While pairs flow and nobody asks /decision or /status, the report is never built: the worker's
    refresh reads the live walk (the report's cost grows with every stored pair, on the proxy's own
    interpreter lock). Asking /decision builds it once, and not again while nothing changed."""
    built = []
    original = report_build.build_report

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the report's own signature
        built.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(shadow_run_module, "build_report", counted)
    store = tmp_path / "shadow.db"
    _, run = shadow_run_parts(store, UNREACHABLE, UNREACHABLE, None, margin=0.001, grader=GRADER)
    run.start()
    try:
        for i in range(40):
            run(_pair(i, True))
            time.sleep(0.06)  # 2.4 s: two refreshes of the worker and more
        assert run.live().low > -1.0 and built == []
        assert run.decision() == run.decision() and len(built) == 1
    finally:
        run.close()


def test_labels_given_after_a_restart_reach_the_live_decision(tmp_path: Path) -> None:
    """A judged run whose drawn pairs all wait for labels when its process stops: the next process builds
    its walk from the store (the answers each waiting label must name included), the labels given from
    outside the process move it, and its gauges then agree with /decision and `gate report`."""
    store = tmp_path / "shadow.db"
    with (
        upstream(Script("base")) as base,
        upstream(Script("cand")) as cand,
        upstream(judge_preferring("base")) as judge,
    ):
        arms = (
            arm(base + "/v1", "base"),
            arm(cand + "/v1", "cand"),
            {"base_url": judge + "/v1", "model": "j"},
        )
        with shadow_run(store, *arms) as (root, run):
            client = OpenAI(base_url=root + "/v1", api_key="none", max_retries=0)
            for i in range(12):
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q {i}"}])
            deadline = time.monotonic() + 30
            while run.live().labels_waiting < 12:
                assert time.monotonic() < deadline, "12 judged pairs waiting for labels"
                time.sleep(0.05)
        with shadow_run(store, *arms) as (root, run):
            _wait_live(run)
            assert run.live().labels_waiting == 12 and run.live().code == 0
            assert label_all(store) == 12
            live = run.live()
            assert (live.code, live.low, live.high) == _reported(store) and live.code == -1
            assert live.labels_waiting == 0 and live.judge_agreement == 1.0
            assert run.decision()["judge_agreement"] == 1.0
