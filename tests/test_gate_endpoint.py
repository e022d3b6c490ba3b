"""The gate's endpoint arm against real OpenAI-compatible HTTP servers on loopback.

The servers are a minimal FastAPI app run by uvicorn in this process, returning scripted completions:
the baseline model answers "What is i + i?" wrongly when i % 5 == 0, the candidate when i % 4 == 0,
so on 20 questions the expected paired counts are known exactly (lost 4, gained 3); a "noisy" model is
wrong exactly when the request's seed is divisible by 3, which makes the pilot's flips predictable.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from flyspec.gate.arms import EndpointError
from flyspec.gate.report import build_report
from flyspec.gate.runner import question_seed, run_gate
from flyspec.gate.stats import questions_needed_noninferiority, wilson_interval
from flyspec.gate.store import GateStore

API_KEY = "sk-test-secret-7f3a"


@dataclass
class ServerState:
    """What the scripted servers saw: request bodies, in-flight peaks, auth headers, injected failures."""

    bodies: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    in_flight: dict[tuple[int, str], int] = field(default_factory=lambda: defaultdict(int))
    peak: dict[tuple[int, str], int] = field(default_factory=lambda: defaultdict(int))
    auth: set[str | None] = field(default_factory=set)
    fail_once: set[tuple[str, str]] = field(default_factory=set)
    failed: list[tuple[str, str]] = field(default_factory=list)
    stall_once: set[tuple[str, str]] = field(default_factory=set)
    stalled: list[tuple[str, str]] = field(default_factory=list)


def _answer(model: str, text: str, seed: int) -> str:
    match = re.search(r"What is (\d+) \+ \1\?", text)
    if match:
        i = int(match.group(1))
        # "noisy" mimics sampling noise: right or wrong depending on the request's seed only
        rule = {"noisy": seed % 3 == 0, "base": i % 5 == 0, "cand": i % 4 == 0}
        wrong = rule[model]
        return f"{i} + {i} = {2 * i + (1 if wrong else 0)}.\n#### {2 * i + (1 if wrong else 0):,}"
    # plain-prompt dataset: the candidate says "no" to the question containing "seven"
    return "no" if (model == "cand" and "seven" in text) else "yes"


def make_app(state: ServerState) -> FastAPI:
    app = FastAPI()

    async def handle(request: Request, body: dict[str, Any], text: str, chat: bool) -> JSONResponse:
        port = request.scope["server"][1]
        model = body["model"]
        state.bodies.append((port, body))
        state.auth.add(request.headers.get("authorization"))
        key = (model, text)
        if key in state.fail_once:
            state.fail_once.discard(key)
            state.failed.append(key)
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        if key in state.stall_once:  # longer than the client's timeout: the client must give up and retry
            state.stall_once.discard(key)
            state.stalled.append(key)
            await asyncio.sleep(3.0)
        state.in_flight[(port, model)] += 1
        state.peak[(port, model)] = max(state.peak[(port, model)], state.in_flight[(port, model)])
        await asyncio.sleep(0.02)
        state.in_flight[(port, model)] -= 1
        content = _answer(model, text, body["seed"])
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        return JSONResponse(
            {
                "id": "x",
                "object": "chat.completion" if chat else "text_completion",
                "model": model,
                "choices": [choice],
                "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
                "spec_decode": {
                    "num_drafts": 3,
                    "num_draft_tokens": 12,
                    "num_accepted_tokens": 6,
                    "num_forgiven_tokens": 1 if model == "cand" else 0,
                },
            }
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        return await handle(request, body, body["messages"][-1]["content"], chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body = await request.json()
        return await handle(request, body, body["prompt"], chat=False)

    return app


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture()
def servers() -> Iterator[tuple[ServerState, list[str]]]:
    """Two uvicorn servers (two ports) sharing one scripted state."""
    state = ServerState()
    running = []
    urls = []
    for _ in range(2):
        port = _free_port()
        config = uvicorn.Config(make_app(state), host="127.0.0.1", port=port, log_level="error")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        running.append((server, thread))
        urls.append(f"http://127.0.0.1:{port}/v1")
    deadline = time.monotonic() + 20
    while not all(s.started for s, _ in running):
        assert time.monotonic() < deadline, "test servers did not start"
        time.sleep(0.02)
    yield state, urls
    for server, thread in running:
        server.should_exit = True
        thread.join(timeout=10)


def _datasets(tmp_path: Path) -> list[str]:
    chat = tmp_path / "sums.jsonl"
    chat.write_text(
        "".join(
            json.dumps(
                {
                    "id": f"q{i}",
                    "messages": [{"role": "user", "content": f"What is {i} + {i}?"}],
                    "answer": f"{2 * i:,}",
                    "grader": "gsm8k",
                }
            )
            + "\n"
            for i in range(20)
        )
    )
    plain = tmp_path / "yesno.jsonl"
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight"]
    plain.write_text(
        "".join(
            json.dumps({"prompt": f"Is {w} a word?", "answer": "yes", "grader": "exact"}) + "\n"
            for w in words
        )
    )
    return [str(chat), str(plain)]


def test_endpoint_arms_pair_seed_retry_and_report(
    servers: tuple[ServerState, list[str]], tmp_path: Path
) -> None:
    """Two endpoint arms (the candidate spread over two base URLs, concurrency 2 each) answer 28 questions
    from a chat JSONL and a plain-prompt JSONL: every question gets the same seed in both arms; an
    injected HTTP 503 and a stalled request (past the 1 s timeout) are retried on the other URL;
    concurrency per URL never exceeds its bound; the API key reaches the server but never the store;
    the report's counts equal the scripted ones."""
    state, urls = servers
    state.fail_once.add(("cand", "What is 7 + 7?"))
    state.stall_once.add(("cand", "What is 9 + 9?"))
    store = tmp_path / "gate.sqlite"
    baseline = {"kind": "openai", "base_url": urls[0], "model": "base", "backoff": 0.01}
    candidate = {
        "base_urls": urls,
        "model": "cand",
        "api_key": API_KEY,
        "concurrency": 2,
        "backoff": 0.01,
        "timeout": 1.0,
        "extra_body": {"top_k": 5},
    }
    run_id = run_gate(
        store, _datasets(tmp_path), baseline, candidate, margin=0.05, max_tokens=64, seed=3, progress=False
    )

    rep = build_report(store, run_id)
    by_scope = {c.scope: c for c in rep.comparisons}
    assert (by_scope["sums"].lost, by_scope["sums"].gained, by_scope["sums"].n) == (4, 3, 20)
    assert (by_scope["yesno"].lost, by_scope["yesno"].gained, by_scope["yesno"].n) == (1, 0, 8)
    assert (by_scope["pooled"].lost, by_scope["pooled"].gained, by_scope["pooled"].n) == (5, 3, 28)
    assert rep.to_dict()["decision"]["decision"] == by_scope["pooled"].decision

    with GateStore(store) as s:
        answers = s.answers(run_id)
    assert len(answers) == 56 and len({(a.arm, a.dataset, a.question_id) for a in answers}) == 56
    cand = [a for a in answers if a.arm == "candidate"]
    assert {a.source for a in cand} == set(urls)  # both base URLs served the candidate
    assert all(a.num_accepted_tokens == 6 and a.num_forgiven_tokens == 1 for a in cand)
    assert all(a.completion_tokens == 7 for a in answers)

    seeds: dict[tuple[str, str], set[int]] = defaultdict(set)
    for _, body in state.bodies:
        text = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
        seeds[(body["model"], text)].add(body["seed"])
        assert body["temperature"] == 0.0 and body["max_tokens"] == 64 and body["top_p"] == 1.0
        assert body.get("top_k") == (5 if body["model"] == "cand" else None)
    for i in range(20):
        text = f"What is {i} + {i}?"
        assert seeds[("base", text)] == seeds[("cand", text)] == {question_seed(3, "sums", f"q{i}")}
    assert state.failed == [("cand", "What is 7 + 7?")] and state.stalled == [("cand", "What is 9 + 9?")]
    assert max(v for (_, model), v in state.peak.items() if model == "cand") <= 2
    assert f"Bearer {API_KEY}" in state.auth
    assert API_KEY.encode() not in store.read_bytes()
    assert _notes_mention_key(store)

    speeds = {s.arm: s for s in rep.speeds}
    assert speeds["candidate"].mean_acceptance_length == pytest.approx(3.0)
    assert speeds["candidate"].forgiven_share == pytest.approx(1 / 6)
    assert speeds["baseline"].tokens_per_s and speeds["baseline"].tokens_per_s > 0


def _notes_mention_key(store: Path) -> bool:
    with sqlite3.connect(store) as db:
        notes = json.loads(db.execute("SELECT notes FROM runs").fetchone()[0])
    return notes["arm_settings"]["candidate"]["api_key"] == "<set>"


def test_unreachable_endpoint_stops_clearly_and_resume_completes(
    servers: tuple[ServerState, list[str]], tmp_path: Path
) -> None:
    """A candidate endpoint nobody listens on stops the run with a clear error after its retries, the
    baseline answers already stored survive, and rerunning with the endpoint reachable (a new URL is
    allowed; where a server runs is not part of the registration) finishes with one row per question
    and arm. Resuming after the dataset changed is refused, naming the changed hash and question."""
    _, urls = servers
    datasets = _datasets(tmp_path)[:1]
    store = tmp_path / "gate.sqlite"
    dead = f"http://127.0.0.1:{_free_port()}/v1"
    baseline = {"base_url": urls[0], "model": "base"}
    with pytest.raises(
        EndpointError, match=r"arm 'candidate': no answer .* after 2 attempt\(s\).*ConnectError"
    ):
        run_gate(
            store,
            datasets,
            baseline,
            {"base_url": dead, "model": "cand", "max_retries": 1, "backoff": 0.01},
            margin=0.05,
            chunk_size=8,
            progress=False,
        )
    with GateStore(store) as s:
        before = s.answers("gate")
    assert len(before) == 8 and {a.arm for a in before} == {"baseline"}

    run_gate(store, datasets, baseline, {"base_url": urls[1], "model": "cand"}, margin=0.05, progress=False)
    with GateStore(store) as s:
        after = s.answers("gate")
    assert len(after) == 40 and len({(a.arm, a.question_id) for a in after}) == 40
    kept = {(a.arm, a.question_id): a for a in after}
    assert all(kept[(a.arm, a.question_id)] == a for a in before)  # untouched by the resume
    pooled = build_report(store).pooled
    assert pooled is not None and (pooled.lost, pooled.gained) == (4, 3)

    # The same run with an edited question (another prompt) is refused, and nothing stored changes.
    path = Path(datasets[0])
    path.write_text(path.read_text().replace("What is 3 + 3?", "What is 3 + 3 ?"))
    with pytest.raises(ValueError, match=r"cannot be resumed: datasets\.sums\.sha256 .*question sums/q3"):
        run_gate(
            store, datasets, baseline, {"base_url": urls[1], "model": "cand"}, margin=0.05, progress=False
        )
    with GateStore(store) as s:
        assert s.answers("gate") == after


def test_endpoint_bad_input_is_refused(servers: tuple[ServerState, list[str]], tmp_path: Path) -> None:
    """Arms cannot carry their own prompts or sampling (extra_body with messages/temperature), unknown
    keys are named, a non-URL is refused, and a 4xx from the server stops the run with its message."""
    _, urls = servers
    datasets = _datasets(tmp_path)[:1]
    store = tmp_path / "gate.sqlite"
    good = {"base_url": urls[0], "model": "base"}
    with pytest.raises(ValueError, match="extra_body sets messages"):
        run_gate(store, datasets, good, {**good, "extra_body": {"messages": []}}, margin=0.05)
    with pytest.raises(ValueError, match="extra_body sets temperature"):
        run_gate(store, datasets, good, {**good, "extra_body": {"temperature": 1.0}}, margin=0.05)
    with pytest.raises(ValueError, match="unknown key.*dataset"):
        run_gate(store, datasets, good, {**good, "dataset": "gsm8k"}, margin=0.05)
    with pytest.raises(ValueError, match="base_url='localhost:8000'"):
        run_gate(store, datasets, good, {"base_url": "localhost:8000", "model": "m"}, margin=0.05)
    assert not store.exists()  # every refusal came before the store was touched


def test_pilot_cli_measures_the_flip_rate_with_fresh_seeds(
    servers: tuple[ServerState, list[str]], tmp_path: Path
) -> None:
    """`flyspec gate pilot` (a real subprocess talking to the loopback server) runs the baseline twice,
    the second pass with fresh per-question seeds, and reports exactly the flips those seeds imply, the
    Wilson interval of the flip rate, and the questions needed for the registered margin."""
    _, urls = servers
    dataset = _datasets(tmp_path)[0]
    store = tmp_path / "pilot.sqlite"
    arm = json.dumps({"base_url": urls[0], "model": "noisy"})
    command = [
        sys.executable,
        "-c",
        "from flyspec.cli import main; main()",
        "gate",
        "pilot",
        "--store",
        str(store),
    ]
    command += ["--dataset", dataset, "--baseline", arm, "--margin", "0.05", "--seed", "4", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    pilot = json.loads(done.stdout.strip().splitlines()[-1])["pilot"]
    wrong = [[question_seed(4, "sums", f"q{i}", r) % 3 == 0 for i in range(20)] for r in (0, 1)]
    flips = sum(a != b for a, b in zip(*wrong, strict=True))
    assert 0 < flips < 20 and wrong[0] != wrong[1]
    assert (pilot["n"], pilot["flips"]) == (20, flips)
    assert (pilot["flip_rate_low"], pilot["flip_rate_high"]) == pytest.approx(wilson_interval(flips, 20))
    assert pilot["questions_needed"] == questions_needed_noninferiority(0.05, flips / 20)
    assert pilot["accuracy_first"] == pytest.approx(1 - sum(wrong[0]) / 20)


def test_run_from_a_config_file_with_flag_override(
    servers: tuple[ServerState, list[str]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`flyspec gate run --config gate.json` takes every setting from the file (arms inline), a flag
    overrides the file (--limit), the progress bar and log go to stderr, and stdout ends with the
    report JSON whose decision covers the limited question set."""
    from flyspec.cli import main

    _, urls = servers
    config = tmp_path / "gate.json"
    config.write_text(
        json.dumps(
            {
                "store": str(tmp_path / "c.sqlite"),
                "datasets": _datasets(tmp_path)[:1],
                "baseline": {"base_url": urls[0], "model": "base"},
                "candidate": {"base_url": urls[1], "model": "cand"},
                "margin": 0.05,
                "limit": 20,
                "max_tokens": 32,
            }
        )
    )
    argv = ["flyspec", "gate", "run", "--config", str(config), "--limit", "10", "--json"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", argv)
        with pytest.raises(SystemExit) as exit_info:
            main()
    assert exit_info.value.code in (0, None)
    out, err = capsys.readouterr()
    decision = json.loads(out.strip().splitlines()[-1])["decision"]
    assert (decision["n"], decision["lost"], decision["gained"]) == (10, 2, 1)  # q4, q8 lost; q5 gained
    assert "registered" in err
    with GateStore(tmp_path / "c.sqlite") as s:
        assert s.get_run("gate").registration["sampling"]["max_tokens"] == 32  # type: ignore[union-attr]
