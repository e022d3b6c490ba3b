"""Shared pieces of the shadow tests: scripted upstreams (flyspec/bench/scripted_openai.py, fixed answers,
enough for proxy mechanics) and the shadow app, each served by a real uvicorn server on loopback."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from loopback import serve_app

from flyspec.bench.scripted_openai import Script, scripted_app
from flyspec.gate.arms.judge import parse_judge
from flyspec.gate.data.results import gold_rule, pending, record
from flyspec.gate.data.store import GateStore
from flyspec.gate.shadow.mirror import ShadowSettings, endpoint_arm
from flyspec.gate.shadow.pairs import SqlitePairStore
from flyspec.gate.shadow.proxy import create_shadow_app
from flyspec.gate.shadow.run import ShadowPlan, ShadowRun, shadow_registration


@contextmanager
def upstream(script: Script) -> Iterator[str]:
    """A scripted server for ``script``; yields its root URL."""
    with serve_app(scripted_app(script)) as v1:
        yield v1.removesuffix("/v1")


def arm(url: str, model: str, **extra: Any) -> dict[str, Any]:
    """An endpoint arm's JSON object."""
    return {"base_urls": [url], "model": model, **extra}


@contextmanager
def shadow(
    store: Path, baseline: dict[str, Any], candidate: dict[str, Any], **settings: Any
) -> Iterator[Any]:
    """The shadow app in front of ``baseline``, storing pairs in ``store``; yields (root URL, store)."""
    options = ShadowSettings(
        baseline=endpoint_arm("baseline", baseline),
        candidate=endpoint_arm("candidate", candidate),
        **settings,
    )
    pairs = SqlitePairStore(store)
    try:
        with serve_app(create_shadow_app(options, pairs)) as v1:
            yield v1.removesuffix("/v1"), pairs
    finally:
        pairs.close()


def wait_pairs(pairs: SqlitePairStore, count: int, timeout: float = 20.0) -> None:
    """Wait until ``count`` pairs are stored."""
    deadline = time.monotonic() + timeout
    while pairs.count() < count:
        assert time.monotonic() < deadline, f"{pairs.count()} pairs stored, expected {count}"
        time.sleep(0.02)


def metric(root: str, name: str) -> float:
    """One sample's value from the shadow app's /metrics (``name`` with its labels, as printed)."""
    for line in httpx.get(root + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


def skipped(root: str, reason: str) -> float:
    """flyspec_shadow_skipped_total for ``reason``."""
    return metric(root, f'flyspec_shadow_skipped_total{{reason="{reason}"}}')


def stored(store: Path) -> list[dict[str, Any]]:
    """The stored pairs, oldest first, their JSON columns decoded."""
    with sqlite3.connect(store) as db:
        rows = db.execute("SELECT source, route, request, baseline, candidate FROM shadow_pairs ORDER BY id")
        return [
            {
                "source": s,
                "route": r,
                "request": json.loads(q),
                "baseline": json.loads(b),
                "candidate": json.loads(c),
            }
            for s, r, q, b, c in rows.fetchall()
        ]


def judge_preferring(name: str) -> Script:
    """A scripted judge that prefers the response written by the server ``name`` (its answers start with
    ``name:``), and says tie when neither or both are."""

    def reply(body: dict[str, Any]) -> str:
        prompt = body["messages"][-1]["content"]
        a = prompt.split("[Response A]\n", 1)[1].split("[Response B]\n", 1)[0]
        b = prompt.split("[Response B]\n", 1)[1]
        a_wins, b_wins = a.startswith(f"{name}:"), b.startswith(f"{name}:")
        return "Verdict: " + ("A" if a_wins and not b_wins else "B" if b_wins and not a_wins else "tie")

    return Script("judge", reply=reply)


def shadow_run_parts(
    store: Path,
    baseline: dict[str, Any],
    candidate: dict[str, Any],
    judge: dict[str, Any] | None,
    margin: float = 0.05,
    gold_rate: float = 1.0,
    run_id: str = "shadow",
    grader: str | None = None,
    **settings: Any,
) -> tuple[ShadowSettings, ShadowRun]:
    """The settings and the registered run of a shadow app judged by ``judge`` (or graded by
    ``grader``)."""
    options = ShadowSettings(
        baseline=endpoint_arm("baseline", baseline),
        candidate=endpoint_arm("candidate", candidate),
        **settings,
    )
    plan = ShadowPlan(run_id, margin, 0.025, parse_judge(judge) if judge else None, gold_rate, grader=grader)
    registration = shadow_registration(plan, options.baseline, options.candidate, options.rule().describe())
    return options, ShadowRun(store, plan, registration)


@contextmanager
def shadow_run(store: Path, *arms: dict[str, Any], **settings: Any) -> Iterator[tuple[str, ShadowRun]]:
    """The shadow app of a registered run (see ``shadow_run_parts``); yields (root URL, run)."""
    options, run = shadow_run_parts(store, *arms, **settings)
    with serve_app(create_shadow_app(options, run)) as v1:
        yield v1.removesuffix("/v1"), run


def label_all(store: Path, run_id: str = "shadow") -> int:
    """Label every drawn pair waiting as a person who knows the baseline's answers are better would, with
    the terminal's functions (flyspec.gate.data.results.py); returns how many were labelled."""
    with GateStore(store) as opened:
        run, gold = gold_rule(opened, run_id)
        todo = pending(opened, run, gold, {})
        for pair in todo:
            record(opened, run, pair, "b" if pair.a_is_candidate else "a")
    return len(todo)
