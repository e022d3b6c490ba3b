"""/status plots the interval against the margin over time: inline SVG built on the server from the
report's own walk replayed over the stored pairs, one point per step (or per bucket on a long run), the
last point the interval as `gate report --json` gives it; scripted upstreams on loopback."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
from openai import OpenAI
from shadow_harness import arm, judge_preferring, label_all, shadow_run, upstream

from flyspec.bench.scripted_openai import Script
from flyspec.gate.data.store import GateStore
from flyspec.gate.report.decisions import Step, interval_path
from flyspec.gate.shadow.proxy import MAX_POINTS, interval_svg, thinned
from flyspec.gate.stats.decide import SequentialWalk


def _points(page: str, name: str) -> list[tuple[float, float]]:
    found = re.search(rf'<polyline class="{name}" points="([^"]*)"', page)
    assert found is not None, f"no {name} line in the plot"
    return [tuple(map(float, p.split(","))) for p in found.group(1).split()]  # type: ignore[misc]


def _answers(store: Path) -> int:
    with GateStore(store) as opened:
        return len(opened.answers("shadow"))


def _wait(check, what: str, timeout: float = 30.0) -> None:  # noqa: ANN001 - a test's callable
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_status_plots_one_point_per_step_of_the_reports_walk(tmp_path: Path) -> None:
    store = tmp_path / "shadow.db"
    with (
        upstream(Script("base")) as base,
        upstream(Script("cand")) as cand,
        upstream(judge_preferring("base")) as judge,
    ):
        arms = (arm(base + "/v1", "base"), arm(cand + "/v1", "cand"))
        with shadow_run(store, *arms, {"base_url": judge + "/v1", "model": "judge"}) as (root, _):
            client = OpenAI(base_url=root + "/v1", api_key="none", max_retries=0)
            for i in range(10):
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q {i}"}])
            _wait(lambda: _answers(store) == 20, "both answers of 10 judged pairs")
            waiting = httpx.get(root + "/status").text
            assert "No pair is counted yet" in waiting and "<svg" not in waiting  # the walk waits at pair 1

            label_all(store)
            _wait(lambda: httpx.get(root + "/decision").json()["decision"] == "FAIL", "the decision")
            page = httpx.get(root + "/status").text
            decision = httpx.get(root + "/decision").json()
    with GateStore(store) as opened:
        steps = interval_path(opened, "shadow")
    assert [s.n for s in steps] == list(range(1, len(steps) + 1)) and len(steps) == decision["n"]
    assert (steps[-1].low, steps[-1].high) == (decision["low"], decision["high"])
    low, high = _points(page, "low"), _points(page, "high")
    assert len(low) == len(high) == len(steps) and f'data-steps="{len(steps)}"' in page
    assert all(h[1] <= lo[1] for h, lo in zip(high, low, strict=True))  # SVG y grows downwards
    assert "-margin -5.0" in page and ">0</text>" in page


def test_a_long_run_is_thinned_to_buckets_ending_at_the_interval_now() -> None:
    steps = [Step(n, -1 + n / 2000, 1 - n / 4000) for n in range(1, 1001)]
    kept = thinned(steps)
    assert len(kept) == MAX_POINTS and kept[-1] == steps[-1]
    assert all(a.n < b.n for a, b in zip(kept, kept[1:], strict=False))
    svg = interval_svg(steps, 0.02, "run")
    assert len(_points(svg, "low")) == MAX_POINTS and 'data-pairs="1000"' in svg
    assert thinned(steps[:7]) == steps[:7]


def test_the_plot_escapes_its_text() -> None:
    svg = interval_svg([Step(1, -0.5, 0.5)], 0.02, "<script>alert(1)</script>")
    assert "<script>" not in svg and "&lt;script&gt;alert(1)&lt;/script&gt;" in svg


def _graded_run(store: Path, pairs: int) -> tuple[str, dict]:
    """A run graded against the baseline's answers with ``pairs`` pairs; its /status page and /decision."""
    with upstream(Script("base")) as base, upstream(Script("cand")) as cand:
        arms = (arm(base + "/v1", "base"), arm(cand + "/v1", "cand"), None)
        with shadow_run(store, *arms, margin=0.2, grader="equivalent_to_baseline") as (root, _):
            client = OpenAI(base_url=root + "/v1", api_key="none", max_retries=0)
            for i in range(pairs):
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"q {i}"}])
            _wait(lambda: _answers(store) == 2 * pairs, f"both answers of {pairs} graded pairs")
            return httpx.get(root + "/status").text, httpx.get(root + "/decision").json()


def test_a_run_graded_against_the_baseline_is_plotted_from_its_grades(tmp_path: Path) -> None:
    """--grader equivalent_to_baseline: the walk replayed is the exact one; its last step is the report's."""
    store = tmp_path / "shadow.db"
    page, decision = _graded_run(store, 6)
    with GateStore(store) as opened:
        steps = interval_path(opened, "shadow")
    assert len(steps) == decision["n"] == 6 and len(_points(page, "low")) == 6
    assert (steps[-1].low, steps[-1].high) == (decision["low"], decision["high"])


def test_the_path_is_walked_once(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001 - pytest's fixture
    """The plot's path is the walk `Rule.decide` makes, recorded as it goes: each stored pair is added to
    the confidence sequence once (a second walk doubled what /status costs the proxy's cores)."""
    store = tmp_path / "shadow.db"
    _graded_run(store, 5)
    added = []
    original = SequentialWalk.add
    monkeypatch.setattr(SequentialWalk, "add", lambda self, d: (added.append(d), original(self, d))[1])
    with GateStore(store) as opened:
        steps = interval_path(opened, "shadow")
    assert len(steps) == len(added) == 5
