"""No request can break the server (docs/server.md, "Bounds"): unsafe sampling values, oversized lists and
bodies, huge prompts, odd headers and wrong methods each get a clear 4xx while other requests go on.

Each test here failed on the server before these bounds existed (temperature 1e300 failed the whole
running batch, a 100 MB Content-Length was waited for, a non-ASCII key was a 500, ...). Real uvicorn on a
loopback port, tiny random-weight model.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from tiny_llm import save_tiny

from flyspec.config import EngineConfig
from flyspec.engine.engine import LLMEngine
from flyspec.server.app import build_app
from flyspec.server.background import serve_in_background

KEY = "bounds-key"
MODEL = "tiny"
MAX_MODEL_LEN = 128
HEADERS = {"Authorization": f"Bearer {KEY}"}
GOOD = {"model": MODEL, "prompt": "w1 w2 w3", "max_tokens": 2}


@dataclass
class Server:
    url: str
    engine: LLMEngine
    app: FastAPI

    def post(self, path: str, body: dict[str, Any] | bytes, **kwargs: Any) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {**HEADERS, "Content-Type": "application/json", **kwargs.pop("headers", {})}
        return httpx.post(f"{self.url}{path}", content=content, headers=headers, timeout=120, **kwargs)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    target = save_tiny(tmp_path_factory.mktemp("bounds") / "target", seed=0)
    engine = LLMEngine(
        EngineConfig(
            model=str(target),
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
        )
    )
    app = build_app(engine, served_model_name=MODEL, api_key=KEY)
    with serve_in_background(app) as background:
        yield Server(background.base_url, engine, app)


class _RecordingTokenizer:
    """The server's real tokenizer, noting the length of every text it is asked to tokenise."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.lengths.append(len(text))
        return self.inner(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_unsafe_sampling_values_are_refused_while_a_batch_runs(server: Server) -> None:
    """temperature 1e300 (inf in float32), 1e-40 (NaN probabilities), top_k 2**64 (int64 overflow),
    top_p 1e-300 (0 in float32) and seeds outside int64 each get a 400 naming the field while a batch of
    greedy requests runs; that batch completes with exactly the text each request gets alone."""
    good = [
        {"model": MODEL, "prompt": f"w{i} w{i + 5}", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
        for i in range(4)
    ]
    alone = [server.post("/v1/completions", body).json()["choices"][0]["text"] for body in good]
    bad = [
        ({"temperature": 1e300}, "temperature"),
        ({"temperature": 1e-40}, "temperature"),
        ({"top_k": 2**64}, "top_k"),
        ({"top_p": 1e-300}, "top_p"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
    ]
    with ThreadPoolExecutor(len(good)) as pool:
        running = [pool.submit(server.post, "/v1/completions", body) for body in good]
        deadline = time.monotonic() + 30
        while server.engine.num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        refused = [
            server.post("/v1/completions", {**GOOD, "temperature": 0.8, **fields}) for fields, _ in bad
        ]
        batch = [f.result() for f in running]
    assert [r.status_code for r in batch] == [200] * len(good), batch[0].text
    assert [r.json()["choices"][0]["text"] for r in batch] == alone
    for response, (fields, param) in zip(refused, bad, strict=True):
        assert response.status_code == 400, (fields, response.text)
        assert response.json()["error"]["param"] == param, response.text


def test_request_size_bounds_are_400_or_413(server: Server) -> None:
    """2,000 prompts in one request and 10,000 stop strings are 400s naming the field and the documented
    limit; a 20 MB stop list is over the body limit and gets 413 request_too_large."""
    r = server.post("/v1/completions", {**GOOD, "prompt": ["w1"] * 2000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "at most 256" in r.json()["error"]["message"]
    r = server.post("/v1/completions", {**GOOD, "stop": [f"s{i}" for i in range(10_000)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert "at most 64 stop strings" in r.json()["error"]["message"]
    r = server.post("/v1/completions", {**GOOD, "stop": ["x" * 1000] * 20_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert server.post("/v1/completions", GOOD).status_code == 200


def test_oversized_body_is_refused_before_it_is_read(server: Server) -> None:
    """A request announcing a 100 MB body gets its 413 after sending a few bytes (the server does not wait
    for the rest), and a chunked upload without Content-Length is cut off at the limit the same way."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {KEY}\r\nContent-Length: {100 << 20}\r\n\r\n".encode()
            + b'{"prompt": "'
        )
        head = sock.recv(4096).decode()
    assert head.startswith("HTTP/1.1 413"), head

    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"w1 " * (1 << 20)

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers=HEADERS, timeout=60)
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]


def test_huge_prompts_are_refused_after_tokenising_a_prefix_only(server: Server) -> None:
    """A 6 MB prompt (text or as chat content) that cannot fit max_model_len=128 is refused quickly with
    context_length_exceeded, and the tokenizer never saw more than a small prefix of it; a million-id
    token prompt is refused on its length alone."""
    huge = "w1 w2 " * 1_000_000
    chat = {"model": MODEL, "messages": [{"role": "user", "content": huge}], "max_tokens": 2}
    started = time.monotonic()
    r = server.post("/v1/completions", {**GOOD, "prompt": huge})
    elapsed = time.monotonic() - started
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert elapsed < 3.0  # tokenising all 6 MB takes several seconds here
    encoder = server.app.state.flyspec.encoder
    recording = _RecordingTokenizer(encoder.tokenizer)
    encoder.tokenizer = recording
    try:
        for path, body in (("/v1/completions", {**GOOD, "prompt": huge}), ("/v1/chat/completions", chat)):
            r = server.post(path, body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    finally:
        encoder.tokenizer = recording.inner
    assert recording.lengths and max(recording.lengths) < 100 * MAX_MODEL_LEN < len(huge) // 400
    r = server.post("/v1/completions", {**GOOD, "prompt": [5] * 1_000_000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_long_tokenisation_does_not_block_the_event_loop(server: Server) -> None:
    """A 3 MB prompt that is mostly whitespace must be tokenised in full (it fits), which takes a while;
    meanwhile /health keeps answering promptly because tokenisation runs off the event loop."""
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=60) as client:
            while not done.is_set():
                t0 = time.monotonic()
                assert client.get(f"{server.url}/health").status_code == 200
                latencies.append(time.monotonic() - t0)
                time.sleep(0.01)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    time.sleep(0.05)
    started = time.monotonic()
    r = server.post("/v1/completions", {**GOOD, "prompt": " " * 3_000_000 + "w1 w2"})
    elapsed = time.monotonic() - started
    done.set()
    poller.join()
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3, r.text
    assert len(latencies) > 5 and max(latencies) < elapsed / 2, (max(latencies), elapsed)


def test_non_ascii_authorization_is_401(server: Server) -> None:
    """An Authorization header with non-ASCII bytes (UTF-8 or Latin-1) is a wrong key: 401, never 500."""
    for value in ("Bearer kä".encode(), "Bearer \xe9t\xe9".encode("latin-1"), "Bäarer x".encode()):
        r = httpx.get(f"{server.url}/v1/models", headers={"Authorization": value})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text


def test_wrong_method_is_405_with_allow(server: Server) -> None:
    """A wrong method on an existing route answers 405 with an Allow header listing the methods."""
    r = httpx.get(f"{server.url}/v1/completions", headers=HEADERS)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = httpx.delete(f"{server.url}/ping")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "POST"}


def test_openapi_describes_request_bodies_and_errors(server: Server) -> None:
    """/openapi.json declares each POST route's JSON body by its pydantic schema (with the sampling
    bounds) and the 400/401/413 responses with the error shape, so schema-driven clients and fuzzers know
    what is valid and which errors are expected."""
    doc = httpx.get(f"{server.url}/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model in [
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/detokenize", "DetokenizeRequest"),
    ]:
        operation = doc["paths"][path]["post"]
        body = operation["requestBody"]
        assert body["required"] and body["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{model}"
        }
        assert model in schemas
        for status in ("400", "401", "413"):
            ref = operation["responses"][status]["content"]["application/json"]["schema"]["$ref"]
            assert ref == "#/components/schemas/ErrorResponse"
    temperature = schemas["CompletionRequest"]["properties"]["temperature"]["anyOf"][0]
    assert temperature["maximum"] == 100 and temperature["minimum"] == 0
    assert "prompt" in schemas["CompletionRequest"]["required"]
    assert schemas["ChatMessage"]["properties"]["tool_calls"]


@pytest.mark.parametrize("tmp_limit", [1000])
def test_max_request_bytes_is_configurable(tmp_path: Path, tmp_limit: int) -> None:
    """build_app(max_request_bytes=N): a body of N bytes passes, N + 1 bytes get 413."""
    target = save_tiny(tmp_path / "target", seed=0)
    engine = LLMEngine(EngineConfig(model=str(target), dtype="float32", max_model_len=MAX_MODEL_LEN))
    with serve_in_background(build_app(engine, served_model_name=MODEL, max_request_bytes=tmp_limit)) as bg:
        base = json.dumps(GOOD)[:-1] + ', "user": "'
        exact = (base + "u" * (tmp_limit - len(base) - 2) + '"}').encode()
        assert len(exact) == tmp_limit
        ok = httpx.post(f"{bg.base_url}/v1/completions", content=exact, timeout=60)
        assert ok.status_code == 200, ok.text
        over = exact[:-2] + b'u"}'
        assert httpx.post(f"{bg.base_url}/v1/completions", content=over, timeout=60).status_code == 413
