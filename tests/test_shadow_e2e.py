"""`flyspec gate shadow` end to end with real parts only: three real `flyspec serve` processes on SmolLM2
(production with standard verification, the candidate with FLy's lossy verification, a third as the
judge), the real `flyspec gate shadow` process in front, the official `openai` client in a few threads
(streamed and not), a SIGKILL of the shadow process in the middle of the traffic and a restart with the
same command, gold labels given through the labelling page's JSON API, and the gate's own CLI
(`gate report --json`, `gate compare`) reading the store afterwards.

The small judge's verdicts may be unreadable: the test asserts consistency (what clients got, what the
store holds, the decision in every place it is shown), never a particular verdict. Production serves one
sequence at a time so that its greedy answers do not depend on what shares a batch: a direct call gives
the same answer as one through the proxy.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import serve_process
from zoo import SMOLLM2, zoo_model

from flyspec.bench.peers import free_port

pytestmark = pytest.mark.slow  # three server loads and a few dozen short generations

MODEL = "smol"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
MARGIN = "0.05"
RUN = "e2e"
THREADS = 3
MAX_TOKENS = 12
TIMEOUT_S = 60.0  # the shadow answers its own routes slowly while three servers share the CI's 2 cores


def _serve_args(max_seqs: int, speculative: dict[str, Any] | None) -> list[str]:
    args = [str(zoo_model(SMOLLM2)), "--served-model-name", MODEL, "--dtype", "float32"]
    args += ["--max-num-seqs", str(max_seqs), "--seed", "0"]
    return args + (["--speculative-config", json.dumps(speculative)] if speculative else [])


def _request(i: int) -> dict[str, Any]:
    """Request ``i``: a distinct prompt, greedy, short."""
    content = f"In one short sentence, what is {i + 2} times {i + 3}?"
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "seed": 7,
    }


def _comparable(completion: Any) -> dict[str, Any]:
    """A completion without what differs on every request (its id and creation time)."""
    return {k: v for k, v in completion.model_dump().items() if k not in ("id", "created")}


def _ask(client: openai.OpenAI, i: int) -> Any:
    """Request ``i`` (odd ones streamed); what the client received: the completion, or (text, usage)."""
    if i % 2 == 0:
        return client.chat.completions.create(**_request(i))
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **_request(i))
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage


def _drive(proxy: str, indices: list[int], received: dict[int, Any], stop: threading.Event) -> None:
    """Send ``indices`` through the proxy from THREADS threads until done or ``stop``; a request that the
    kill interrupts fails at the client (it is not in ``received``)."""
    client = openai.OpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0, timeout=120)
    todo = list(indices)
    lock = threading.Lock()

    def work() -> None:
        while not stop.is_set():
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            try:
                answer = _ask(client, i)
            except (openai.APIConnectionError, openai.APIStatusError):
                continue
            with lock:
                received[i] = answer

    threads = [threading.Thread(target=work) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _rows(store: Path) -> list[tuple[int, str]]:
    """The stored pairs: (id, the user's message)."""
    with sqlite3.connect(store) as db:
        rows = db.execute("SELECT id, request FROM shadow_pairs ORDER BY id").fetchall()
    return [(i, json.loads(r)["messages"][0]["content"]) for i, r in rows]


def _counts(store: Path) -> tuple[int, int, int]:
    """Pairs stored, questions of the run, answers stored."""
    with sqlite3.connect(store) as db:
        return tuple(
            db.execute(sql).fetchone()[0]
            for sql in (
                "SELECT COUNT(*) FROM shadow_pairs",
                f"SELECT COUNT(*) FROM questions WHERE run_id = '{RUN}'",
                f"SELECT COUNT(*) FROM answers WHERE run_id = '{RUN}'",
            )
        )


def _wait(check: Callable[[], bool], what: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _differing(store: Path) -> int:
    """Stored pairs whose two answers differ (at --gold-rate 1.0, each is drawn for a gold label)."""
    with sqlite3.connect(store) as db:
        return db.execute(
            "SELECT COUNT(*) FROM answers b JOIN answers c USING (run_id, dataset, question_id) "
            "WHERE b.arm = 'baseline' AND c.arm = 'candidate' AND b.output != c.output"
        ).fetchone()[0]


def _metrics(proxy: str) -> dict[str, float]:
    return {
        line.split()[0]: float(line.split()[-1])
        for line in httpx.get(proxy + "/metrics", timeout=TIMEOUT_S).text.splitlines()
        if line and not line.startswith("#")
    }


def _label_everything(proxy: str) -> int:
    """Give every waiting gold label through the page's JSON API (keys A / B / E in turn, blind); returns
    how many were given."""
    given = 0
    while True:
        queue = httpx.get(proxy + "/label/api/queue", params={"labeller": "e2e"}, timeout=TIMEOUT_S).json()
        waiting = [p for p in queue["pairs"] if p["mode"] == "gold"]
        if not waiting:
            return given
        pair = waiting[0]
        body = {"dataset": pair["dataset"], "question_id": pair["question_id"], "labeller": "e2e"}
        label = {**body, "key": "abe"[given % 3], "second": False}
        reply = httpx.post(proxy + "/label/api/labels", json=label, timeout=TIMEOUT_S)
        assert reply.status_code == 200, reply.text
        given += 1


def _gate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [serve_process.FLYSPEC, "gate", *args], capture_output=True, text=True, timeout=300, env=os.environ
    )


def test_live_traffic_through_a_killed_and_restarted_shadow_decides_like_gate_report(tmp_path: Path) -> None:
    store = tmp_path / "shadow.db"
    with ExitStack() as stack:
        production = stack.enter_context(
            serve_process.flyspec_serve(_serve_args(1, NGRAM), tmp_path / "production.log")
        )
        candidate = stack.enter_context(
            serve_process.flyspec_serve(
                _serve_args(4, {**NGRAM, "rejection_sample_method": "fly"}), tmp_path / "candidate.log"
            )
        )
        judge = stack.enter_context(serve_process.flyspec_serve(_serve_args(4, None), tmp_path / "judge.log"))
        port = free_port()
        proxy = f"http://127.0.0.1:{port}"
        argv = [serve_process.FLYSPEC, "gate", "shadow", "--store", str(store), "--run", RUN]
        argv += ["--baseline", json.dumps({"base_urls": [production + "/v1"], "model": MODEL})]
        argv += ["--candidate", json.dumps({"base_urls": [candidate + "/v1"], "model": MODEL})]
        argv += ["--judge", json.dumps({"base_url": judge + "/v1", "model": MODEL, "max_tokens": 16})]
        argv += ["--margin", MARGIN, "--gold-rate", "1.0", "--candidate-concurrency", "2"]
        argv += ["--port", str(port)]

        received: dict[int, Any] = {}
        shadow = serve_process.start(argv, proxy, tmp_path / "shadow-1.log", timeout_s=120)
        killed = threading.Event()
        first = threading.Thread(target=_drive, args=(proxy, list(range(10)), received, killed))
        first.start()
        _wait(lambda: len(_rows(store)) >= 3 or not first.is_alive(), "three pairs before the kill")
        assert first.is_alive(), "the traffic ended before the kill: the kill must hit it mid-way"
        shadow.send_signal(signal.SIGKILL)
        shadow.wait()
        killed.set()
        first.join()
        before_restart = _rows(store)

        shadow = serve_process.start(argv, proxy, tmp_path / "shadow-2.log", timeout_s=120)
        stack.callback(serve_process.stop, shadow)
        assert f"run {RUN!r} resumed" in (tmp_path / "shadow-2.log").read_text()
        _drive(proxy, list(range(10, 16)), received, threading.Event())

        # Clients got exactly production's answers: a direct call to production gives the same.
        direct = openai.OpenAI(base_url=production + "/v1", api_key="none", max_retries=0, timeout=120)
        assert len(received) >= 9, sorted(received)
        for i, got in received.items():
            expected = _ask(direct, i)
            if i % 2 == 0:
                assert _comparable(got) == _comparable(expected), i
            else:
                assert got == expected, i

        # Nothing stored was lost or duplicated across the kill; every pair is a judged question.
        after = {_request(i)["messages"][0]["content"] for i in received if i >= 10}
        _wait(lambda: after <= {p for _, p in _rows(store)}, "the pairs of the requests after the restart")
        _wait(lambda: _counts(store)[2] == 2 * _counts(store)[0], "both answers of every stored pair")
        rows = _rows(store)
        assert set(before_restart) <= set(rows)
        prompts = [p for _, p in rows]
        assert len(prompts) == len(set(prompts)), "a request stored twice"
        assert set(prompts) <= {_request(i)["messages"][0]["content"] for i in range(16)}
        assert _counts(store)[:2] == (len(rows), len(rows))

        # People label through the page; the decision reads the labels.
        labelled = _label_everything(proxy)
        _wait(lambda: _metrics(proxy)["flyspec_shadow_labels_waiting"] == 0, "no label waiting")
        decision = httpx.get(proxy + "/decision", timeout=TIMEOUT_S).json()
        report = _gate("report", "--store", str(store), "--run", RUN, "--json")
        assert report.returncode in (0, 1), report.stderr
        assert decision == json.loads(report.stdout.strip().splitlines()[-1])["decision"]
        assert labelled == _differing(store) == decision["gold_labels"]
        assert decision["n"] <= len(rows)
        gauges = _metrics(proxy)
        code = {"FAIL": -1, "PASS": 1}.get(decision["decision"], 0)
        assert gauges["flyspec_shadow_decision"] == code
        low, high = decision["low"], decision["high"]
        assert gauges["flyspec_shadow_interval_low"] == (-1.0 if low is None else low)
        assert gauges["flyspec_shadow_interval_high"] == (1.0 if high is None else high)
        agreement = decision["judge_agreement"]
        if agreement is None:
            assert math.isnan(gauges["flyspec_shadow_judge_agreement"])
        else:
            assert gauges["flyspec_shadow_judge_agreement"] == agreement

        # gate compare reads the run's two arms like any run's.
        compared = _gate(
            "compare", f"{store}:{RUN}:baseline", f"{store}:{RUN}:candidate", "--margin", MARGIN, "--json"
        )
        assert compared.returncode in (0, 1), compared.stderr
        pooled = json.loads(compared.stdout.strip().splitlines()[-1])["decision"]
        assert pooled["n"] == len(rows)
