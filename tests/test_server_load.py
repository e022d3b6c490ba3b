"""Nothing heavy on the event loop, nothing unbounded in a handler (docs/server.md, "Heavy and hostile
input"): bodies, tokenisation and grammars run on worker lanes, a grammar has a compile budget, a body a
read deadline, and an unexpected failure keeps the client's connection.

Each test failed on the server before: a body shorter than its Content-Length hung (and logged a
traceback when its client left), `guided_regex "(x{1000}){1000}"` compiled on the engine thread (every
stream paused for its compile) and then failed the request with a 500, an exception in a handler closed the
pooled connection, and the worst bodies stalled /health for seconds and an unrelated request for 40x its
time. Real uvicorn on loopback; latencies are compared with the same server's own solo latencies.
"""

from __future__ import annotations

import json
import logging
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from machine_noise import Reference
from tiny_llm import save_tiny
from zoo import SMOLLM2, zoo_model

from flyspec.config import EngineConfig
from flyspec.engine.engine import LLMEngine
from flyspec.engine.structured import Grammars
from flyspec.sampling_params import StructuredOutputsParams
from flyspec.server.app import build_app
from flyspec.server.background import serve_in_background

MODEL = "tiny"
HOSTILE_REGEX = "(x{1000}){1000}"


@dataclass
class Server:
    url: str
    engine: LLMEngine
    port: int
    app: FastAPI

    def post(self, path: str, body: dict[str, Any] | bytes, timeout: float = 120) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
        headers = {"Content-Type": "application/json"}
        return httpx.post(f"{self.url}{path}", content=content, headers=headers, timeout=timeout)


@contextmanager
def _serve(engine: LLMEngine, **kwargs: Any) -> Iterator[Server]:
    app = build_app(engine, served_model_name=MODEL, **kwargs)
    with serve_in_background(app) as background:
        yield Server(background.base_url, engine, background.port, app)


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("load") / "byte_target", seed=0, byte_level=True)


@pytest.fixture(scope="module")
def server(byte_model: Path) -> Iterator[Server]:
    """A tiny byte-level model (grammars work on it), a 0.25 s grammar budget and a 1 s read deadline."""
    engine = LLMEngine(EngineConfig(model=str(byte_model), dtype="float32", max_model_len=512))
    with _serve(engine, grammar_timeout_s=0.25, request_read_timeout_s=1.0) as served:
        yield served


def _raw_exchange(port: int, chunks: list[tuple[bytes, float]], read_timeout: float = 30) -> bytes:
    """Send each chunk after its delay on one connection, then read one response (head and
    Content-Length body) or what came before the server closed or `read_timeout` passed; sending stops
    once the server closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as sock:
        for data, delay in chunks:
            time.sleep(delay)
            try:
                sock.sendall(data)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed: read its answer
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
                head, sep, rest = received.partition(b"\r\n\r\n")
                length = [line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
                if sep and length and len(rest) >= int(length[0].split(b":")[1]):
                    break
        except TimeoutError:
            pass
        return received


def _request_head(length: int) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def test_short_and_trickled_bodies_get_408_and_a_client_leaving_mid_body_logs_nothing(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """A body 90 bytes short of its Content-Length, and one trickled a byte every 0.3 s, each get 408
    request_timeout after the 1 s read deadline (before: no answer, ever); a client that leaves in the
    middle of its body makes the server log no error or traceback (before: "unhandled error" with
    starlette's ClientDisconnect)."""
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    started = time.monotonic()
    short = _raw_exchange(server.port, [(_request_head(len(body) + 90) + body, 0.0)], read_timeout=10)
    assert short.startswith(b"HTTP/1.1 408"), short[:200]
    assert b'"code":"request_timeout"' in short and time.monotonic() - started < 5
    trickle = [(_request_head(len(body)), 0.0)] + [(body[i : i + 1], 0.3) for i in range(8)]
    assert _raw_exchange(server.port, trickle, read_timeout=10).startswith(b"HTTP/1.1 408")
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        _raw_exchange(server.port, [(_request_head(len(body)) + body[:5], 0.0)], read_timeout=0.2)
        time.sleep(0.5)
        assert httpx.get(f"{server.url}/health").status_code == 200
    problems = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert problems == [], [r.getMessage() for r in problems]


def test_an_error_in_a_handler_keeps_the_connection(server: Server) -> None:
    """On one kept-alive connection: a logit_bias key of 5,000 digits (int() refuses more than 4,300:
    a 500 before) is a 400 naming logit_bias, an unexpected exception inside a handler (a tokenizer that
    raises) is a 500 with the error JSON, and after each the same connection serves the next request
    (before, uvicorn closed it after the 500, resetting the client's next pooled request)."""
    bias = {"prompt": "hi", "max_tokens": 1, "logit_bias": {"7" * 5000: 1}}
    good = {"prompt": "hi", "max_tokens": 1}
    with httpx.Client(base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=1)) as client:
        sockets = set()

        def post(body: dict[str, Any]) -> httpx.Response:
            response = client.post("/v1/completions", json=body, extensions={"trace": note})
            return response

        def note(event: str, info: dict[str, Any]) -> None:
            if event == "connection.connect_tcp.complete":
                sockets.add(id(info["return_value"]))

        r = post(bias)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
        assert post(good).status_code == 200
        encoder = server.app.state.flyspec.encoder
        real = encoder.tokenizer
        encoder.tokenizer = _Exploding(real)
        try:
            r = post(good)
        finally:
            encoder.tokenizer = real
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        assert "boom" in r.json()["error"]["message"]
        assert post(good).status_code == 200
        assert len(sockets) == 1  # every request went over the first connection


class _Exploding:
    """A tokenizer that fails on every call (a bug inside a handler)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_grammar_over_its_budget_is_a_400_and_no_stream_pauses(server: Server, byte_model: Path) -> None:
    """guided_regex "(x{1000}){1000}", whose compile (with its first mask, where llguidance builds the
    lexer) takes half a second to a second, against a 0.25 s budget: a 400 naming guided_regex within about
    the budget, while a stream that runs meanwhile never pauses for half of that compile (it used to pause
    for all of it, on the engine thread; the compile's lane shares the GIL with the engine, and in a CI
    run on a 2-core Intel Xeon one gap reached 0.51 s of a 1.37 s compile). The budget counts compile
    time only: a fresh server's first grammar waits for the grammar tokenizer to be built, and is not
    refused for it."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(byte_model)
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    grammars.prepare()
    t0 = time.monotonic()
    grammars.compile(StructuredOutputsParams(regex=HOSTILE_REGEX))
    compile_s = time.monotonic() - t0
    # the hostile grammar is hostile on this machine: well over the 0.25 s budget (0.49-1.37 s measured
    # on the CI machines; it does not grow with the repeat counts, the lexer build dominates)
    assert compile_s > 0.4, compile_s

    r = server.post("/v1/completions", {"prompt": "x", "max_tokens": 3, "guided_regex": "[ab]+"})
    assert r.status_code == 200 and set(r.json()["choices"][0]["text"]) <= {"a", "b"}, r.text

    gaps: list[tuple[float, float]] = []
    streaming = threading.Event()

    def stream() -> None:
        body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
            last = time.monotonic()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    gaps.append((last, now))
                    last = now
                    streaming.set()

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream)
        assert streaming.wait(60)
        sent = time.monotonic()
        r = server.post("/v1/completions", {"prompt": "x", "max_tokens": 3, "guided_regex": HOSTILE_REGEX})
        answered = time.monotonic()
        running.result()
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "guided_regex", r.text
    assert error["message"].startswith("guided_regex: the grammar did not compile within 0.25 s")
    assert answered - sent < 0.25 + compile_s / 2
    during = [end - start for start, end in gaps if end > sent and start < answered + compile_s]
    assert during and max(during) < compile_s / 2, (max(during), compile_s)


def test_a_grammar_that_breaks_the_grammar_engines_limits_while_generating_is_a_400(byte_model: Path) -> None:
    """With a budget long enough for "(x{1000}){1000}" to compile, llguidance gives up on it at the first
    generated token (too many lexer expressions): the request is a 400 naming guided_regex (before: a 500
    "the engine failed on this request"), in a stream an error event with that 400, and the server serves
    the next request."""
    engine = LLMEngine(EngineConfig(model=str(byte_model), dtype="float32", max_model_len=256))
    with _serve(engine, grammar_timeout_s=120) as server:
        body = {"prompt": "x", "max_tokens": 8, "guided_regex": HOSTILE_REGEX}
        r = server.post("/v1/completions", body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "guided_regex", r.text
        assert "too complex" in error["message"]
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert json.loads(events[-2][6:])["error"]["param"] == "guided_regex" and events[-1] == "data: [DONE]"
        assert server.post("/v1/completions", {"prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.fixture(scope="module")
def smollm2() -> Iterator[Server]:
    """SmolLM2-135M: a real byte-level BPE tokenizer, which takes seconds over 7 MB of text."""
    engine = LLMEngine(
        EngineConfig(model=str(zoo_model(SMOLLM2)), dtype="float32", max_model_len=1024, max_num_seqs=4)
    )
    with _serve(engine) as served:
        yield served


def _health_latencies(url: str, until: threading.Event, into: list[tuple[float, float]]) -> None:
    with httpx.Client(timeout=60) as client:
        while not until.is_set():
            t0 = time.monotonic()
            assert client.get(f"{url}/health").status_code == 200
            into.append((t0, time.monotonic() - t0))
            time.sleep(0.02)


@pytest.mark.slow  # SmolLM2, 21 MB of bodies and seconds of tokenisation on purpose
def test_health_and_a_small_request_stay_fast_while_the_worst_bodies_are_in_flight(
    smollm2: Server, tmp_path: Path
) -> None:
    """While a 6.8 MB chat body of 200,000 messages and two 7 MB /tokenize calls are in flight, every
    /health answers within 500 ms plus the machine's own noise, and the median latency of a small
    unrelated completion stays within 2x its solo median times the machine's own slowdown (run with -s
    to see the numbers).

    The machine's noise is measured in the same test, by a separate process (tests/machine_noise.py)
    over the same window: the slowest of its loopback round trips, or of 300 solo /health probes if
    that is larger; its slowdown is how much longer its fixed work took under load than in the solo
    phase. So another process loading a model meanwhile (which once made a probe take 811 ms against a
    bound of 556 ms) widens the bounds by what it costs, while a server that blocks its own event loop
    still fails them: the reference does not share the server's process.

    Before, pydantic parsed the 200,000 messages on the event loop (/health took 1.6 s) and all
    tokenisation shared one thread (the small completion waited 7 s behind the two /tokenize calls). Now
    large bodies are parsed in a worker process and their tokenisation queues in its own lane."""
    small = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    # Serialised up front: json.dumps of 200,000 messages would hold this process's GIL (the server's
    # too, in this process) while the latencies are measured.
    messages = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 200_000}).encode()
    text = ("The quick brown fox jumps over the lazy dog. café 東京 🙂 " * 120_000)[:6_120_000]
    tokenize = json.dumps({"prompt": text}, ensure_ascii=False).encode()
    assert len(messages) > 6_800_000 and len(tokenize) > 7_000_000

    def small_latencies(count: int) -> list[float]:
        times = []
        for _ in range(count):
            t0 = time.monotonic()
            assert smollm2.post("/v1/completions", small).status_code == 200
            times.append(time.monotonic() - t0)
        return times

    with Reference(tmp_path / "reference.log") as reference:
        small_latencies(2)  # warm up
        solo_started = time.monotonic()
        stop, solo_health = threading.Event(), []
        poller = threading.Thread(target=_health_latencies, args=(smollm2.url, stop, solo_health))
        poller.start()
        solo = small_latencies(5)
        while len(solo_health) < 300:  # the slowest of as many probes as the loaded phase sends
            time.sleep(0.05)
        stop.set()
        poller.join()
        solo_ended = time.monotonic()

        heavy_done, heavy = threading.Event(), []
        stop, loaded_health = threading.Event(), []
        with ThreadPoolExecutor(3) as pool:
            started = time.monotonic()
            heavy.append(pool.submit(smollm2.post, "/v1/chat/completions", messages))
            heavy += [pool.submit(smollm2.post, "/tokenize", tokenize) for _ in range(2)]
            poller = threading.Thread(target=_health_latencies, args=(smollm2.url, stop, loaded_health))
            poller.start()
            time.sleep(1.0)  # the bodies are uploaded and parsing or tokenising
            loaded = small_latencies(5)
            still_running = sum(not f.done() for f in heavy)
            results = [f.result() for f in heavy]
            heavy_done.set()
            ended = time.monotonic()
            stop.set()
            poller.join()
    during = [latency for t0, latency in loaded_health if started <= t0 <= ended]
    solo_noise = max(latency for _, latency in solo_health)
    noise = max(solo_noise, reference.slowest_round_trip(started, ended))
    slowdown = max(
        1.0, reference.median_work(started, ended) / reference.median_work(solo_started, solo_ended)
    )
    print(
        f"\n/health: {len(during)} probes under load, slowest {max(during) * 1000:.0f} ms (bound "
        f"{(0.5 + noise) * 1000:.0f} ms; solo slowest {solo_noise * 1000:.0f} ms); small completion median "
        f"{statistics.median(loaded):.2f} s under load, {statistics.median(solo):.2f} s solo (machine "
        f"slowdown {slowdown:.2f}x); heavy requests took {ended - started:.1f} s"
    )
    assert len(during) > 20 and max(during) < 0.5 + noise, (max(during), noise, len(during))
    assert statistics.median(loaded) < 2 * slowdown * statistics.median(solo), (loaded, solo, slowdown)
    assert still_running >= 2  # the small requests ran while the /tokenize calls were in flight
    chat, *tokenized = results
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages", chat.text
    assert all(r.status_code == 200 and r.json()["count"] > 1_000_000 for r in tokenized), [
        (r.status_code, r.text[:300]) for r in tokenized
    ]
