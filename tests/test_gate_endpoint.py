"""The gate's endpoint arm against real OpenAI-compatible HTTP servers on loopback.

The servers are a minimal FastAPI app run by uvicorn in this process, returning scripted completions:
the baseline model answers "What is i + i?" wrongly when i % 5 == 0, the candidate when i % 4 == 0,
so on 20 questions the expected paired counts are known exactly (lost 4, gained 3); a "noisy" model is
wrong exactly when the request's seed is divisible by 3, which makes the pilot's flips predictable.
"vllm", "plain" and "held" answer like the baseline: "vllm" reports acceptance counters the way vLLM's
`--per-request-spec-decode-metrics` does, "plain" reports none, "held" waits until the test releases it. Every
server lists its models at /v1/models (with a `root`) and stamps a `system_fingerprint` naming its port.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
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
from gate_answers import wait_for_answers

from flyspec.gate.arms.endpoint import EndpointError
from flyspec.gate.data.store import GateStore
from flyspec.gate.report.build import build_report
from flyspec.gate.runs.run import run_gate
from flyspec.gate.runs.session import question_seed
from flyspec.gate.stats import questions_needed_noninferiority
from flyspec.gate.stats.paired import wilson_interval

API_KEY = "sk-test-secret-7f3a"
MODELS = ("base", "cand", "noisy", "vllm", "plain", "held")


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
    down: set[str] = field(default_factory=set)  # models that answer HTTP 503 to every request
    release: threading.Event = field(default_factory=threading.Event)  # "held" answers once this is set


def _answer(model: str, text: str, seed: int) -> str:
    match = re.search(r"What is (\d+) \+ \1\?", text)
    if match:
        i = int(match.group(1))
        # "noisy" mimics sampling noise: right or wrong depending on the request's seed only
        rule = {"noisy": seed % 3 == 0, "base": i % 5 == 0, "cand": i % 4 == 0}
        wrong = rule.get(model, i % 5 == 0)
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
        if model in state.down:
            return JSONResponse({"error": {"message": "model is down"}}, status_code=503)
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
        while model == "held" and not state.release.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.02)
        state.in_flight[(port, model)] -= 1
        content = _answer(model, text, body["seed"])
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        if chat:
            choice["message"] = {"role": "assistant", "content": content}
        else:
            choice["text"] = content
        reply: dict[str, Any] = {
            "id": "x",
            "object": "chat.completion" if chat else "text_completion",
            "model": model,
            "system_fingerprint": f"fp-{port}",
            "choices": [choice],
            "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
        }
        if model == "vllm":  # vLLM's per-request metrics: no forgiven count
            reply["metrics"] = {
                "speculative_decoding": {
                    "num_spec_steps": 4,
                    "num_draft_tokens": 12,
                    "num_accepted_draft_tokens": 8,
                    "mean_acceptance_length": 3.0,
                }
            }
        elif model != "plain":
            reply["spec_decode"] = {
                "num_drafts": 3,
                "num_draft_tokens": 12,
                "num_accepted_tokens": 6,
                "num_forgiven_tokens": 1 if model == "cand" else 0,
            }
        return JSONResponse(reply)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [{"id": m, "object": "model", "root": f"/weights/{m}", "owned_by": "test"} for m in MODELS]
        return JSONResponse({"object": "list", "data": cards})

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
    """A candidate endpoint nobody listens on is refused before anything is answered, after its retries.
    A candidate whose server answers HTTP 503 to every request stops the run with a clear error after its
    retries; the baseline answers already stored survive, and rerunning with the endpoint working (a new
    URL is allowed; where a server runs is not part of the registration) finishes with one row per
    question and arm. Resuming after the dataset changed is refused, naming the changed hash and
    question."""
    state, urls = servers
    datasets = _datasets(tmp_path)[:1]
    store = tmp_path / "gate.sqlite"
    dead = f"http://127.0.0.1:{_free_port()}/v1"
    baseline = {"base_url": urls[0], "model": "base"}
    with pytest.raises(EndpointError, match=r"arm 'candidate': .*/models unreachable after 2 attempt\(s\)"):
        run_gate(
            store,
            datasets,
            baseline,
            {"base_url": dead, "model": "cand", "max_retries": 1, "backoff": 0.01},
            margin=0.05,
            progress=False,
        )
    with GateStore(store) as s:
        assert s.get_run("gate") is None  # refused before registering

    state.down.add("cand")
    with pytest.raises(EndpointError, match=r"arm 'candidate': no answer .* after 2 attempt\(s\).*HTTP 503"):
        run_gate(
            store,
            datasets,
            baseline,
            {"base_url": urls[0], "model": "cand", "max_retries": 1, "backoff": 0.2},
            margin=0.05,
            progress=False,
        )
    with GateStore(store) as s:
        before = s.answers("gate")
    assert before and {a.arm for a in before} == {"baseline"}

    state.down.clear()
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
    with pytest.raises(ValueError, match=r"cannot be resumed: .*datasets\.sums\.sha256 .*question sums/q3"):
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
    with GateStore(tmp_path / "c.sqlite") as s:
        chosen = [int(q.question_id[1:]) for q in s.questions("gate")]
    # The first 10 of the seeded order, not of the file: base is wrong when i % 5 == 0, cand when i % 4 == 0.
    assert len(chosen) == 10 and chosen != list(range(10))
    lost = sum(i % 4 == 0 and i % 5 != 0 for i in chosen)
    gained = sum(i % 5 == 0 and i % 4 != 0 for i in chosen)
    assert (decision["n"], decision["lost"], decision["gained"]) == (10, lost, gained)
    assert "registered" in err
    with GateStore(tmp_path / "c.sqlite") as s:
        assert s.get_run("gate").registration["sampling"]["max_tokens"] == 32  # type: ignore[union-attr]


def test_registration_identifies_endpoint_arms_and_counters_are_read_or_not_reported(
    servers: tuple[ServerState, list[str]], tmp_path: Path
) -> None:
    """Each endpoint arm's registration holds the served model's id and root from /v1/models; the notes
    hold its base URLs and the system_fingerprint each URL returned. vLLM-style per-request counters
    (`metrics.speculative_decoding`) are stored with the forgiven count as NULL, a server that reports
    none stores NULLs, and the report says "not reported" instead of a zero. A model the server does not
    list is refused before anything is stored."""
    _, urls = servers
    store = tmp_path / "gate.sqlite"
    datasets = _datasets(tmp_path)[:1]
    run_id = run_gate(
        store,
        datasets,
        {"base_urls": urls, "model": "vllm"},
        {"base_url": urls[1], "model": "plain"},
        margin=0.05,
        progress=False,
    )
    with GateStore(store) as s:
        run = s.get_run(run_id)
        answers = s.answers(run_id)
    assert run is not None
    arms = run.registration["arms"]
    assert arms["baseline"]["served_model"] == {"id": "vllm", "root": "/weights/vllm"}
    assert arms["candidate"]["served_model"] == {"id": "plain", "root": "/weights/plain"}
    ports = {url: url.rsplit(":", 1)[1].split("/")[0] for url in urls}
    assert run.notes["system_fingerprints"]["baseline"] == {u: [f"fp-{p}"] for u, p in ports.items()}
    (endpoint,) = [e for e in run.notes["executors"] if e["arms"] == ["baseline"]]
    assert endpoint["base_urls"] == urls
    vllm = [a for a in answers if a.arm == "baseline"]
    assert all((a.num_drafts, a.num_accepted_tokens, a.num_forgiven_tokens) == (4, 8, None) for a in vllm)
    plain = [a for a in answers if a.arm == "candidate"]
    assert all(a.num_drafts is None and a.num_accepted_tokens is None for a in plain)
    rep = build_report(store, run_id)
    speeds = {s.arm: s for s in rep.speeds}
    assert speeds["baseline"].mean_acceptance_length == pytest.approx(3.0)
    assert speeds["baseline"].forgiven_share is None and not speeds["baseline"].forgiven_reported
    assert speeds["candidate"].mean_acceptance_length is None and not speeds["candidate"].acceptance_reported
    text = rep.to_markdown()
    assert "| candidate | 20 |" in text and "not reported | not reported | not reported |" in text
    assert f"served at {urls[1]}: model id plain, root /weights/plain, system_fingerprint fp-" in text

    with pytest.raises(ValueError, match=r"serves model\(s\) base, cand, .*not 'nope'"):
        run_gate(tmp_path / "other.sqlite", datasets, {"base_url": urls[0], "model": "nope"},
                 {"base_url": urls[0], "model": "base"}, margin=0.05, progress=False)  # fmt: skip


def test_candidate_pilot_plans_and_its_questions_are_left_out(
    servers: tuple[ServerState, list[str]], tmp_path: Path
) -> None:
    """`run_pilot` with a candidate runs both arms once on a seeded set of questions and reports the
    candidate's flips with a plan from the flip rate's upper bound; a later gate run in the same store
    leaves exactly those questions out (recorded in its registration), so its questions are disjoint."""
    from flyspec.gate.runs.run import run_pilot
    from flyspec.gate.stats.sizing import plan_noninferiority

    _, urls = servers
    store = tmp_path / "gate.sqlite"
    datasets = _datasets(tmp_path)[:1]
    base = {"base_url": urls[0], "model": "base"}
    cand = {"base_url": urls[1], "model": "cand"}
    run_pilot(store, datasets, base, 0.05, candidate=cand, max_questions=8, progress=False)
    report = build_report(store, "pilot").to_dict()
    with GateStore(store) as s:
        used = {q.question_id for q in s.questions("pilot")}
    ids = sorted(int(q[1:]) for q in used)
    lost = sum(i % 4 == 0 and i % 5 != 0 for i in ids)
    gained = sum(i % 5 == 0 and i % 4 != 0 for i in ids)
    pilot = report["pilot"]
    assert (pilot["mode"], pilot["n"], pilot["lost"], pilot["gained"]) == ("candidate", 8, lost, gained)
    assert pilot["questions_needed_upper"] == plan_noninferiority(lost + gained, 8, 0.05).questions

    run_gate(store, datasets, base, cand, margin=0.05, progress=False)
    with GateStore(store) as s:
        run = s.get_run("gate")
        gate_ids = {q.question_id for q in s.questions("gate")}
    assert run is not None and run.registration["excluded"] == {"runs": ["pilot"], "questions": 8}
    assert len(gate_ids) == 12 and not gate_ids & used


def test_baseline_noise_is_shown_next_to_the_candidates_flips(
    servers: tuple[ServerState, list[str]], tmp_path: Path
) -> None:
    """A noise pilot of an endpoint baseline at temperature 0 runs (a server can be nondeterministic even
    when greedy; the report says what it measures), and the later gate report on the same data puts the
    baseline's own flip rate next to the candidate's flips."""
    from flyspec.gate.runs.run import run_pilot

    _, urls = servers
    store = tmp_path / "gate.sqlite"
    datasets = _datasets(tmp_path)[:1]
    noisy = {"base_url": urls[0], "model": "noisy"}
    run_pilot(store, datasets, noisy, 0.05, max_questions=10, seed=4, progress=False)
    pilot = build_report(store, "pilot")
    assert pilot.pilot is not None and pilot.pilot.mode == "noise"
    assert "only the nondeterminism of the engine or server" in pilot.to_markdown()
    run_gate(store, datasets, noisy, {"base_url": urls[1], "model": "cand"}, margin=0.05, progress=False)
    rep = build_report(store, "gate")
    assert rep.noise is not None and rep.noise.run_id == "pilot" and rep.noise.n == 10
    assert rep.noise.flips == pilot.pilot.flips
    assert rep.to_dict()["noise"]["flip_rate"] == pytest.approx(pilot.pilot.flip_rate)
    assert "The baseline's own noise, next to the candidate's flips: pilot `pilot`" in rep.to_markdown()


def test_two_gate_runs_on_one_store_at_once(servers: tuple[ServerState, list[str]], tmp_path: Path) -> None:
    """Two real `flyspec gate run` processes on the same store: the second is refused at once with the
    first one's PID while the first is answering (its candidate's server holds the answers until the
    second has been refused), and the store ends with exactly one row per question and arm."""
    state, urls = servers
    store = tmp_path / "gate.sqlite"
    command = [
        sys.executable, "-c", "from flyspec.cli import main; main()", "gate", "run", "--store", str(store),
        "--dataset", _datasets(tmp_path)[0], "--margin", "0.05", "--no-progress",
        "--baseline", json.dumps({"base_url": urls[0], "model": "base"}),
        "--candidate", json.dumps({"base_url": urls[1], "model": "held"}),
    ]  # fmt: skip
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_answers(first, store, timeout_s=120)
    second = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert first.poll() is None, "the first run should still be answering"
    state.release.set()
    assert second.returncode == 2 and f"is in use by gate run 'gate' (PID {first.pid} on" in second.stderr
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    with sqlite3.connect(store) as db:
        keys = db.execute("SELECT arm, question_id FROM answers").fetchall()
    assert len(keys) == len(set(keys)) == 40


@pytest.mark.slow
def test_ctrl_c_stops_a_sequential_run_at_once_and_a_rerun_continues(
    servers: tuple[ServerState, list[str]],
    tmp_path: Path,
    own_ledger,  # noqa: ANN001
) -> None:
    """Ctrl-C (SIGINT) on a real `flyspec gate run --sequential`, while the candidate's server holds two
    requests that would never finish, ends the process within 2 s: the held requests are dropped (not
    stored, not waited for), the report says INCONCLUSIVE, stopped by the interruption (JSON last), and
    the exit code is 130 with the resume hint; rerunning continues to the same stop as a run never
    interrupted."""
    state, urls = servers
    store = tmp_path / "gate.sqlite"
    dataset = _datasets(tmp_path)[0]
    base = {"base_url": urls[0], "model": "base"}
    held = {"base_url": urls[1], "model": "held", "concurrency": 2}
    # The child installs Python's Ctrl-C handler itself: a test run started in the background inherits
    # SIGINT ignored, and Python leaves an ignored SIGINT ignored.
    main = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from flyspec.cli import main; main()"
    )
    command = [
        sys.executable, "-c", main, "gate", "run", "--sequential",
        "--store", str(store), "--dataset", dataset, "--margin", "0.1", "--no-progress", "--json",
        "--baseline", json.dumps(base), "--candidate", json.dumps(held),
    ]  # fmt: skip
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_answers(proc, store, timeout_s=120)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        state.release.set()  # the held requests can finish now (the gate no longer waits for them)
    took = time.monotonic() - sent
    assert proc.returncode == 130, err
    assert took <= 2.0, f"exited {took:.2f} s after SIGINT"
    assert "gate: interrupted; the answers in flight are dropped" in err
    assert "rerun the same command to resume" in err
    report = json.loads(out.strip().splitlines()[-1])
    assert (report["sequential"]["reason"], report["decision"]["decision"]) == ("interrupted", "INCONCLUSIVE")
    with GateStore(store) as s:
        held_answers = [a for a in s.answers("gate") if a.arm == "candidate"]
    assert held_answers == []  # dropped, not waited for

    run_gate(store, [dataset], base, held, margin=0.1, sequential=True, progress=False)
    final = build_report(store, "gate").to_dict()["sequential"]
    reference = tmp_path / "reference.sqlite"
    with own_ledger():  # the run to compare with, not a look
        run_gate(reference, [dataset], base, held, margin=0.1, sequential=True, progress=False)
    expected = build_report(reference, "gate").to_dict()["sequential"]
    assert final["reason"] in ("boundary", "max_questions")
    assert (final["decision"], final["stopped_at"]) == (expected["decision"], expected["stopped_at"])


def test_equivalent_to_baseline_grades_the_candidate_against_the_baseline_output(
    servers: tuple[ServerState, list[str]], tmp_path: Path
) -> None:
    """With the `equivalent_to_baseline` grader the baseline is right by definition and the candidate is
    right when its output equals the baseline's: candidate answers that arrive first (the baseline's
    server holds its answers here) wait for the baseline's output, and the counts are the scripted
    deviations (outputs differ exactly when one of the two models is wrong)."""
    state, urls = servers
    rows = [
        {"id": f"e{i}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": "",
         "grader": "equivalent_to_baseline"}
        for i in range(20)
    ]  # fmt: skip
    dataset = tmp_path / "equiv.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "gate.sqlite"
    threading.Timer(0.5, state.release.set).start()
    run_gate(
        store,
        str(dataset),
        {"base_url": urls[0], "model": "held"},
        {"base_url": urls[1], "model": "cand"},
        margin=0.05,
        progress=False,
    )
    with GateStore(store) as s:
        answers = s.answers("gate")
    assert len(answers) == 40 and all(a.correct for a in answers if a.arm == "baseline")
    deviates = {f"e{i}" for i in range(20) if (i % 4 == 0) != (i % 5 == 0)}
    assert {a.question_id for a in answers if a.arm == "candidate" and not a.correct} == deviates
    pooled = build_report(store).pooled
    assert pooled is not None and (pooled.lost, pooled.gained) == (len(deviates), 0)
