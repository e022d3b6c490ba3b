"""The OpenAI-compatible server end to end (docs/server.md).

Every test talks HTTP to a real uvicorn server on a free loopback port. The engine serves a tiny
random-weight Llama with FLy verification; its drafter is a slightly perturbed copy of the target, so
drafts are often accepted, sometimes rejected, and sometimes forgiven (entropy threshold 0).
"""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families
from tiny_llm import save_tiny

from flyspec import LLM, SamplingParams
from flyspec.config import EngineConfig
from flyspec.engine.engine import LLMEngine
from flyspec.server.app import build_app
from flyspec.server.background import serve_in_background

API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 8
K = 3
PROMPT = "w1 w2 w3 w4"
MESSAGES = [{"role": "user", "content": "w5 w6 w7"}]


def perturbed_copy(src: Path, dst: Path, noise: float, seed: int) -> Path:
    """The checkpoint at `src` with Gaussian noise added to every weight: a drafter that mostly agrees."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * noise)
    model.save_pretrained(dst)
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


@dataclass
class Served:
    """A running server and the engine behind it (read-only from tests, except for fault injection)."""

    url: str
    engine: LLMEngine
    target: Path

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, **kwargs)

    def post(self, path: str, body: dict | bytes, key: str | None = API_KEY) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
        return httpx.post(f"{self.url}{path}", content=content, headers=headers, timeout=60)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics, parsed by prometheus-client's own text parser, keyed by name and its
        labels other than model_name, which every flyspec series must carry with the served name."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        ours = [s for s in samples if s.name.startswith("flyspec:")]
        assert ours and all(s.labels.get("model_name") == MODEL for s in ours)
        return {
            (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for s in ours
        }

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until the engine has no request and the running/waiting gauges read 0."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            idle_gauges = (
                m[("flyspec:num_requests_running", ())] == 0 and m[("flyspec:num_requests_waiting", ())] == 0
            )
            if idle_gauges and not self.engine.has_unfinished_requests():
                return
            time.sleep(0.02)
        raise AssertionError(f"not idle after {timeout}s: running={self.engine.num_running}")


def _value(m: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    return m[(name, tuple(sorted(labels.items())))]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("server_models")
    target = save_tiny(base / "target", seed=0)
    draft = perturbed_copy(target, base / "draft", noise=0.02, seed=1)
    spec = {
        "model": str(draft),
        "num_speculative_tokens": K,
        "rejection_sample_method": "fly",
        "fly_window_size": 1,
        "fly_entropy_threshold": 0.0,  # random tiny models are flat; 0 lets FLy forgive at all
    }
    config = EngineConfig(
        model=str(target),
        speculative_config=spec,
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
    )
    engine = LLMEngine(config)
    app = build_app(engine, served_model_name=MODEL, api_key=API_KEY)
    with serve_in_background(app) as server:
        yield Served(server.base_url, engine, target)


def test_models_health_and_auth(served: Served) -> None:
    """/v1/models lists the served name through the openai client; /health and /metrics need no key; a
    wrong or missing key gets 401 OpenAI-style JSON on /v1 routes."""
    assert [m.id for m in served.client().models.list().data] == [MODEL]
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{served.url}/metrics").status_code == 200
    for key in ("wrong-key", None):
        r = served.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}, key=key)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


@pytest.mark.parametrize(("temperature", "seed"), [(0.0, None), (0.9, 11)])
def test_streamed_text_equals_non_streamed(served: Served, temperature: float, seed: int | None) -> None:
    """For completions and chat, greedy and seeded sampling: the concatenated stream deltas equal the
    non-streamed text, with the same finish reason, usage, and acceptance counters (final usage chunk)."""
    client = served.client()
    common: dict[str, Any] = dict(model=MODEL, temperature=temperature, seed=seed, max_tokens=24)

    full = client.completions.create(prompt=PROMPT, **common)
    chunks = list(
        client.completions.create(
            prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **common
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1  # really incremental
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert chunks[-1].spec_decode == full.spec_decode
    assert full.usage.completion_tokens > 0 and full.choices[0].text

    chat = client.chat.completions.create(messages=MESSAGES, **common)
    stream = list(
        client.chat.completions.create(
            messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **common
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert content == chat.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
    assert finishes == [chat.choices[0].finish_reason]
    assert stream[-1].usage == chat.usage and stream[-1].spec_decode == chat.spec_decode


def test_prompt_lists_give_one_choice_each(served: Served) -> None:
    """A list of prompts (text or token ids) gives one choice per prompt, in order, each equal to the same
    prompt sent alone, streamed or not; usage and spec_decode add up over the choices."""
    client = served.client()
    common: dict[str, Any] = dict(model=MODEL, temperature=0.0, max_tokens=10)
    ids = [1, 40, 41, 42]  # <s> w33 w34 w35 as token ids
    singles = [client.completions.create(prompt=p, **common) for p in ("w7 w8", ids)]
    batch = client.completions.create(prompt=["w7 w8", "w33 w34 w35"], **common)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles]
    assert batch.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    for key in ("num_drafts", "num_accepted_tokens", "num_forgiven_tokens"):
        assert batch.spec_decode[key] == sum(s.spec_decode[key] for s in singles)
    chunks = list(
        client.completions.create(
            prompt=[ids, ids], stream=True, stream_options={"include_usage": True}, **common
        )
    )
    texts = [
        "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)
    ]
    assert texts == [singles[1].choices[0].text] * 2
    assert chunks[-1].usage.completion_tokens == 2 * singles[1].usage.completion_tokens


def test_stop_string_is_cut_identically_when_streamed(served: Served) -> None:
    """A stop string taken from the middle of an output ends generation before it; the stream never sends
    a piece of it (held back until it cannot be a stop prefix) and equals the non-streamed text."""
    client = served.client()
    common: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, temperature=0.0, max_tokens=30)
    text = client.completions.create(**common).choices[0].text
    words = text.split()
    stop = f"{words[5]} {words[6][:2]}"  # spans a token boundary and ends inside a word
    expected = text.split(stop)[0]
    full = client.completions.create(stop=stop, **common)
    assert full.choices[0].text == expected and full.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **common)
    )
    assert streamed == expected


def test_metrics_move_by_the_amounts_responses_report(served: Served) -> None:
    """Counters on /metrics (parsed by prometheus-client) move by exactly the spec_decode and usage
    numbers the responses carry; per-position acceptances sum to the accepted tokens; FLy forgave some
    tokens; the lossy gauge reads 1; each finished request adds one TTFT and one e2e observation."""
    client = served.client()
    before = served.metrics()
    reported: list[dict[str, int]] = []
    usage = {"prompt": 0, "completion": 0}

    def note(spec: dict[str, int], u: Any) -> None:
        reported.append(spec)
        usage["prompt"] += u.prompt_tokens
        usage["completion"] += u.completion_tokens

    for seed in range(3):
        r = client.completions.create(
            model=MODEL, prompt=f"w{seed + 7} w9", max_tokens=40, temperature=0.0, seed=seed
        )
        note(r.spec_decode, r.usage)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0.8, seed=5)
    note(r.spec_decode, r.usage)
    stream = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=30, stream=True, stream_options={"include_usage": True}
        )
    )
    note(stream[-1].spec_decode, stream[-1].usage)
    served.wait_idle()
    after = served.metrics()

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    total = {k: sum(r[k] for r in reported) for k in reported[0]}
    assert delta("flyspec:spec_decode_num_drafts_total") == total["num_drafts"] > 0
    assert delta("flyspec:spec_decode_num_draft_tokens_total") == total["num_draft_tokens"]
    assert delta("flyspec:spec_decode_num_accepted_tokens_total") == total["num_accepted_tokens"] > 0
    assert delta("flyspec:spec_decode_num_forgiven_tokens_total") == total["num_forgiven_tokens"] > 0
    assert delta("flyspec:generation_tokens_total") == usage["completion"]
    assert delta("flyspec:prompt_tokens_total") == usage["prompt"]
    per_pos = [
        delta("flyspec:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(K)
    ]
    assert sum(per_pos) == total["num_accepted_tokens"]
    assert per_pos == sorted(per_pos, reverse=True)  # keeping position i needs positions < i kept
    assert _value(after, "flyspec:lossy_verification_enabled") == 1
    n = len(reported)
    assert delta("flyspec:time_to_first_token_seconds_count") == n
    assert delta("flyspec:e2e_request_latency_seconds_count") == n
    assert delta("flyspec:inter_token_latency_seconds_count") == usage["completion"] - n


def test_verification_standard_is_lossless_per_request(served: Served) -> None:
    """On a FLy server, a greedy request with verification="standard" forgives nothing and returns the
    target-only greedy output (offline LLM without a drafter); the same request under FLy forgives.
    Per-request top_k=1 or top_p=1e-6 at temperature 1 reduce sampling to that same greedy output."""
    client = served.client()
    common: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0.0)
    fly = client.completions.create(**common)
    std = client.completions.create(extra_body={"verification": "standard"}, **common)
    assert fly.spec_decode["num_forgiven_tokens"] > 0
    assert std.spec_decode["num_forgiven_tokens"] == 0 and std.spec_decode["num_drafts"] > 0
    reference = LLM(str(served.target), dtype="float32", max_model_len=MAX_MODEL_LEN)
    out = reference.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]
    assert std.choices[0].text == out.outputs[0].text
    assert std.usage.completion_tokens == len(out.outputs[0].token_ids)
    # top_k=1 or a tiny top_p leaves only the argmax: sampling at temperature 1 must then be greedy.
    for knobs in (
        {"extra_body": {"verification": "standard", "top_k": 1}},
        {"top_p": 1e-6, "extra_body": {"verification": "standard"}},
    ):
        sampled = client.completions.create(**{**common, "temperature": 1.0, "seed": 3, **knobs})
        assert sampled.choices[0].text == std.choices[0].text


_GOOD = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
_GOOD_CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}

# (path, body, expected status, expected error param, expected code or None)
_BAD_REQUESTS = [
    ("/v1/completions", b'{"model": "tiny", "prompt": "w1"', 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("/v1/completions", b"", 400, None, "invalid_json"),
    ("/v1/completions", {**_GOOD, "max_tokens": "five"}, 400, "max_tokens", None),
    ("/v1/completions", {**_GOOD, "max_tokens": 2.5}, 400, "max_tokens", None),
    ("/v1/completions", {**_GOOD, "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {**_GOOD, "prompt": 5}, 400, "prompt", None),
    ("/v1/completions", {**_GOOD, "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", None),
    ("/v1/completions", {**_GOOD, "model": "gpt-9"}, 400, "model", "model_not_found"),
    ("/v1/completions", {**_GOOD, "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {**_GOOD, "max_tokens": -3}, 400, "max_tokens", None),
    ("/v1/completions", {**_GOOD, "max_tokens": 10_000}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {**_GOOD, "prompt": "w1 " * 200}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {**_GOOD, "prompt": [5, 99_999]}, 400, "prompt", None),
    ("/v1/completions", {**_GOOD, "prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {**_GOOD, "top_k": "3.5"}, 400, "top_k", None),
    ("/v1/completions", {**_GOOD, "top_p": 0.0}, 400, "top_p", None),
    ("/v1/completions", {**_GOOD, "n": 129}, 400, "n", None),
    ("/v1/completions", {**_GOOD, "repetition_penalty": 0}, 400, "repetition_penalty", None),
    ("/v1/completions", {**_GOOD, "logit_bias": {"99999": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {**_GOOD, "echo": True, "logprobs": 21}, 400, "logprobs", None),
    ("/v1/completions", {**_GOOD, "verification": "lossy"}, 400, "verification", None),
    ("/v1/chat/completions", {**_GOOD_CHAT, "messages": "hi"}, 400, "messages", None),
    ("/v1/chat/completions", {**_GOOD_CHAT, "messages": [{"content": "hi"}]}, 400, "messages.0.role", None),
    ("/v1/chat/completions", {**_GOOD_CHAT, "messages": []}, 400, "messages", None),
    (
        "/v1/chat/completions",
        {**_GOOD_CHAT, "max_tokens": None, "max_completion_tokens": 500},
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        {**_GOOD_CHAT, "messages": [{"role": "user", "content": "w1 " * 200}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
]


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), _BAD_REQUESTS)
def test_bad_input_gets_openai_error_and_server_recovers(
    served: Served, path: str, body: dict | bytes, status: int, param: str | None, code: str | None
) -> None:
    """Each bad body gets OpenAI-style error JSON with the right status, the offending field in `param`
    and a message; the next good request on the same server succeeds and no slot is left taken."""
    r = served.post(path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    good = served.post(path, _GOOD_CHAT if "chat" in path else _GOOD)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2
    served.wait_idle()


def test_openai_client_raises_typed_errors(served: Served) -> None:
    """The official client maps our errors to its typed exceptions (400 -> BadRequestError) and an unknown
    route answers 404 in the same JSON shape."""
    with pytest.raises(openai.BadRequestError, match="not served here"):
        served.client().completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    r = httpx.get(f"{served.url}/v1/nothing", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_client_disconnect_mid_stream_aborts_the_request(served: Served) -> None:
    """A client that reads two SSE events and hangs up gets its request aborted: the engine holds no
    request, num_requests_running returns to 0, and far fewer tokens were generated than asked for."""
    before = served.metrics()
    body = {**_GOOD, "max_tokens": 120, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{served.url}/v1/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 2:
                break
    served.wait_idle()
    generated = _value(served.metrics(), "flyspec:generation_tokens_total") - _value(
        before, "flyspec:generation_tokens_total"
    )
    assert 0 < generated < 120


def test_client_disconnect_while_waiting_non_streaming_aborts(served: Served) -> None:
    """A non-streaming client that sends its request and closes the socket at once is noticed too: the
    request is aborted before it finishes and its slot is freed."""
    before = served.metrics()
    body = json.dumps({**_GOOD, "max_tokens": 120, "ignore_eos": True}).encode()
    host, port = served.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        time.sleep(0.05)  # let the server admit it before the hang-up
    served.wait_idle()
    after = served.metrics()
    generated = _value(after, "flyspec:generation_tokens_total") - _value(
        before, "flyspec:generation_tokens_total"
    )
    assert generated < 120
    assert _value(after, "flyspec:e2e_request_latency_seconds_count") == _value(
        before, "flyspec:e2e_request_latency_seconds_count"
    )


def test_lossless_server_refuses_fly_requests(tmp_path: Path) -> None:
    """Without FLy (n-gram drafter, standard verification, no --api-key): the lossy gauge reads 0, every
    acceptance position is exported, /v1 needs no key, and a request asking for verification="fly" is
    refused by the engine with a 400 naming the field, streamed or not, before any event is sent."""
    target = save_tiny(tmp_path / "target", seed=0)
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    engine = LLMEngine(
        EngineConfig(model=str(target), speculative_config=spec, dtype="float32", max_model_len=64)
    )
    with serve_in_background(build_app(engine, served_model_name=MODEL)) as server:
        url = f"{server.base_url}/v1/completions"
        for stream in (False, True):
            r = httpx.post(url, json={**_GOOD, "verification": "fly", "stream": stream}, timeout=60)
            assert r.status_code == 400 and r.headers["content-type"] == "application/json"
            assert r.json()["error"]["param"] == "verification"
        assert httpx.post(url, json=_GOOD, timeout=60).status_code == 200
        m = Served(server.base_url, engine, target).metrics()
    assert _value(m, "flyspec:lossy_verification_enabled") == 0
    assert {
        labels for name, labels in m if name == "flyspec:spec_decode_num_accepted_tokens_per_pos_total"
    } == {
        (("position", "0"),),
        (("position", "1"),),
    }


def _fail_next_step(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> Callable[[], bool]:
    """Make the engine's next step() raise (fault injection on the real engine); returns 'has it fired'."""
    real_step = engine.step
    fired = threading.Event()

    def step() -> list:
        if not fired.is_set():
            fired.set()
            raise RuntimeError("injected fault")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    return fired.is_set


def test_engine_failure_gives_500_and_the_server_keeps_serving(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception inside step() fails the request in flight with a 500 server_error (as JSON, or in-band
    in a stream, which the openai client raises), frees its slot, and the next request succeeds."""
    fired = _fail_next_step(served.engine, monkeypatch)
    r = served.post("/v1/completions", _GOOD)
    assert fired() and r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and "injected fault" in r.json()["error"]["message"]
    served.wait_idle()

    monkeypatch.undo()
    fired = _fail_next_step(served.engine, monkeypatch)
    with pytest.raises(openai.APIError, match="injected fault"):
        list(served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True))
    assert fired()
    served.wait_idle()
    assert served.post("/v1/completions", _GOOD).status_code == 200
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_bounded_load_64_clients(served: Served) -> None:
    """64 concurrent clients x 4 requests (completions and chat, streamed and not): no errors, every
    response complete (exactly max_tokens tokens, finish_reason length), the running batch reaches the
    admission cap, and afterwards no slot is held. Prints throughput and latency percentiles."""
    clients, per_client, max_tokens = 64, 4, 8
    aclient = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    extra = {"ignore_eos": True}
    peak = 0
    stop_sampling = threading.Event()

    def sample_running() -> None:
        nonlocal peak
        while not stop_sampling.is_set():
            peak = max(peak, served.engine.num_running)
            time.sleep(0.002)

    async def one(i: int, j: int) -> tuple[float, int]:
        kind = (i + j) % 4
        t0 = time.perf_counter()
        common: dict[str, Any] = dict(
            model=MODEL, max_tokens=max_tokens, temperature=0.7, seed=i * 10 + j, extra_body=extra
        )
        if kind == 0:
            r = await aclient.completions.create(prompt=f"w{i} w{j} w3", **common)
            assert r.choices[0].finish_reason == "length" and r.choices[0].text
            tokens = r.usage.completion_tokens
        elif kind == 1:
            r = await aclient.chat.completions.create(messages=MESSAGES, **common)
            assert r.choices[0].finish_reason == "length" and r.choices[0].message.content
            tokens = r.usage.completion_tokens
        else:
            create = aclient.completions.create if kind == 2 else aclient.chat.completions.create
            args = {"prompt": f"w{j} w{i}"} if kind == 2 else {"messages": MESSAGES}
            stream = await create(stream=True, stream_options={"include_usage": True}, **args, **common)
            chunks = [c async for c in stream]
            assert [
                c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
            ] == ["length"]
            tokens = chunks[-1].usage.completion_tokens
        assert tokens == max_tokens
        return time.perf_counter() - t0, tokens

    async def client_task(i: int) -> list[tuple[float, int]]:
        return [await one(i, j) for j in range(per_client)]

    async def main() -> list[list[tuple[float, int]]]:
        return await asyncio.gather(*(client_task(i) for i in range(clients)))

    sampler = threading.Thread(target=sample_running, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    results = asyncio.run(main())
    elapsed = time.perf_counter() - t0
    stop_sampling.set()
    sampler.join()
    served.wait_idle()

    latencies = sorted(lat for per in results for lat, _ in per)
    tokens = sum(tok for per in results for _, tok in per)
    assert len(latencies) == clients * per_client
    assert peak == served.engine.max_running == MAX_NUM_SEQS
    p50 = statistics.quantiles(latencies, n=100)[49]
    p99 = statistics.quantiles(latencies, n=100)[98]
    print(
        f"\nload: {len(latencies)} requests in {elapsed:.1f}s = {len(latencies) / elapsed:.1f} req/s, "
        f"{tokens / elapsed:.0f} output tok/s; latency p50 {p50:.2f}s p99 {p99:.2f}s; peak running {peak}"
    )
