"""Judged runs end to end: `--judge-all` with the exact grader as gold against a scripted coin-flip judge
and a fair one, and `flyspec gate label` driven through a real pseudo-terminal.

A scripted OpenAI-compatible server on loopback serves the arms and the judges: the baseline always
answers "yes" (the reference), the candidate "no" on every fifth question (a true loss of 20 points);
the judge "coin" says A or B by a hash of the prompt (so its two orders disagree or agree by chance), the
judge "fair" prefers the answer equal to the reference it is shown.
"""

from __future__ import annotations

import hashlib
import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from loopback import serve_app

from flyspec.gate.data.store import GateStore
from flyspec.gate.report.build import build_report
from flyspec.gate.runs.run import run_gate


def _question(text: str) -> int:
    return int(re.search(r"Question (\d+)", text).group(1))  # type: ignore[union-attr]


def _content(body: dict, text: str) -> str:
    return text if body["model"] in ("base", "cand") else f"Verdict: {text}"


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"data": [{"id": m, "root": m} for m in ("base", "cand", "coin", "fair")]})

    @app.post("/v1/completions")
    async def complete(request: Request) -> JSONResponse:
        body = await request.json()
        i = _question(body["prompt"])
        text = "no" if body["model"] == "cand" and i % 5 == 0 else "yes"
        return JSONResponse(
            {
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            }
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        if body["model"] in ("base", "cand"):
            i = _question(prompt)
            verdict = "no" if body["model"] == "cand" and i % 5 == 0 else "yes"
            verdict = f"{verdict} (answer {i})"
        elif body["model"] == "coin":
            verdict = "A" if hashlib.sha256(prompt.encode()).digest()[0] % 2 else "B"
        else:
            a = re.search(r"\[Response A\]\n(.*?)\n\n\[Response B\]", prompt, re.S).group(1)  # type: ignore[union-attr]
            b = re.search(r"\[Response B\]\n(.*?)\n\nExplain", prompt, re.S).group(1)  # type: ignore[union-attr]
            verdict = "A" if a == "yes" and b != "yes" else "B" if b == "yes" and a != "yes" else "tie"
        return JSONResponse(
            {
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": _content(body, verdict)},
                     "finish_reason": "stop"}
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": 2},
            }
        )  # fmt: skip

    return app


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serve_app(_app()) as url:
        yield url


def _dataset(path: Path, n: int, grader: str = "exact") -> Path:
    rows = [{"id": f"q{i}", "prompt": f"Question {i}", "answer": "yes", "grader": grader} for i in range(n)]
    if grader == "judge":  # open-ended chat questions: only the judge (and gold labels) grade them
        rows = [
            {"id": r["id"], "messages": [{"role": "user", "content": r["prompt"]}], "grader": grader}
            for r in rows
        ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _judged_run(url: str, store: Path, data: Path, judge: str, **settings: object) -> str:
    return run_gate(
        store,
        str(data),
        {"base_url": url, "model": "base"},
        {"base_url": url, "model": "cand"},
        0.02,
        judge={"base_url": url, "model": judge, "max_tokens": 8},
        max_tokens=4,
        progress=False,
        **settings,
    )


@pytest.mark.parametrize(("judge", "allowed"), [("coin", {"INCONCLUSIVE", "FAIL"}), ("fair", {"FAIL"})])
def test_a_coin_judge_cannot_pass_a_harmful_candidate(
    server: str, tmp_path: Path, judge: str, allowed: set[str]
) -> None:
    """A candidate that loses 20 points, judged on all 300 questions with the exact grader labelling the
    drawn half of the differing pairs as gold, sequentially at a 2-point margin: the coin's verdicts
    cannot carry it to PASS (the old rule counted the coin's wrong-winner agreements as evidence), and the
    fair judge's verdicts, confirmed by the labels, FAIL it. Gold labels were stored with the exact
    grader's difference and the judge's agreement with them is in the report."""
    data = _dataset(tmp_path / "d.jsonl", 300)
    store = tmp_path / f"{judge}.db"
    run_id = _judged_run(server, store, data, judge, judge_all=True, gold_rate=0.5, sequential=True)
    report = build_report(store, run_id)
    assert report.decision in allowed, report.to_markdown()
    g = report.gold
    assert g is not None and g.source == "exact" and g.labelled > 0
    with GateStore(store) as opened:
        labels = opened.labels(run_id)
    assert labels and {label.value for label in labels.values()} == {-1}
    assert all(label.source == "exact" for label in labels.values())
    if judge == "fair":
        assert g.agreement == 1.0


def _read_until(fd: int, marker: str, timeout: float = 60) -> str:
    seen = ""
    deadline = time.monotonic() + timeout
    while marker not in seen:
        assert time.monotonic() < deadline, f"no {marker!r} within {timeout} s; got:\n{seen}"
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                seen += os.read(fd, 65536).decode(errors="replace")
            except OSError:
                break
    return seen


@pytest.mark.slow
def test_gate_label_from_a_real_terminal(server: str, tmp_path: Path) -> None:
    """`flyspec gate label` in a pseudo-terminal shows each drawn pair of a judged run blind (answers A
    and B in a seeded order, no arm named), stores each label the moment it is given, skips with s, quits
    with q, and a second session resumes with the pairs still waiting; once every drawn pair is labelled,
    `gate report` decides on them."""
    data = _dataset(tmp_path / "open.jsonl", 10, grader="judge")
    store = tmp_path / "label.db"
    run_id = _judged_run(server, store, data, "fair", gold_rate=1.0)
    main = "from flyspec.cli import main; main()"
    command = [sys.executable, "-c", main, "gate", "label", "--store", str(store)]

    def session(keys: list[str]) -> str:
        pid, fd = pty.fork()
        if pid == 0:  # the child: the real command, attached to the terminal
            os.execvpe(sys.executable, command, {**os.environ, "COLUMNS": "100"})
        out = ""
        try:
            for key in keys:
                out += _read_until(fd, "quit >")
                os.write(fd, f"{key}\n".encode())
            out += _read_until(fd, "still wait")
        finally:
            os.waitpid(pid, 0)
            os.close(fd)
        return out

    first = session(["a", "s", "q"])
    assert "2 pair(s) wait for a gold label" in first and "Answer A" in first and "Answer B" in first
    assert "baseline" not in first.split("Answer A")[1] and "1 label(s) stored" in first
    with GateStore(store) as opened:
        (label,) = opened.labels(run_id).values()
    assert label.source == "human" and label.detail["key"] == "a"
    shown_first = label.detail["shown_as_a"]
    assert label.value == (1 if shown_first == "candidate" else -1)
    second = session(["b"])
    assert "1 pair(s) wait for a gold label" in second and "0 pair(s) still wait" in second
    report = build_report(store, run_id)
    assert report.gold is not None and report.gold.labelled == 2 and report.gold.awaiting == 0
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "no pair waits for a label" in done.stdout
