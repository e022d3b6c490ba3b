"""Fuzzing the server (docs/server.md, "Probes"): thousands of requests, none answered with a 5xx.

Two generators against one real server on loopback (a tiny byte-level model with FLy, so grammars
compile and any text can be generated, API key on):

- schemathesis generates bodies, paths and headers from /openapi.json, valid and invalid ones, for every
  operation;
- a hypothesis strategy puts hostile values into otherwise good bodies of the four POST routes: numbers
  of thousands of digits (as JSON numbers and as digit strings, in values and in logit_bias keys), NaN
  and Infinity literals, deep nesting, Unicode anywhere, wrong types, every recognised field name and
  unknown ones, and raw bytes that are not JSON at all.

Every answer is below 500, every error has the OpenAI error shape, and the one kept-alive connection of
the hypothesis run is never closed by the server (a 500 used to close it).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from tiny_llm import save_perturbed, save_tiny

from flyspec.config import EngineConfig
from flyspec.engine.engine import LLMEngine
from flyspec.server.app import build_app
from flyspec.server.background import serve_in_background
from flyspec.server.protocol import ChatCompletionRequest, CompletionRequest

KEY = "fuzz-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}
# 500 of each in `make test-all` (about a minute together); the probe table in docs/server.md was measured
# with FLYSPEC_FUZZ_EXAMPLES=1500,2000.
SCHEMATHESIS_EXAMPLES, HOSTILE_EXAMPLES = (
    int(n) for n in os.environ.get("FLYSPEC_FUZZ_EXAMPLES", "500,500").split(",")
)
COUNTS: dict[str, dict[int, int]] = {}


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("fuzz")
    target = save_tiny(root / "target", seed=0, byte_level=True)
    draft = save_perturbed(target, root / "draft", seed=4, noise=0.1)
    spec = {"model": str(draft), "num_speculative_tokens": 3, "rejection_sample_method": "fly"}
    engine = LLMEngine(
        EngineConfig(model=str(target), speculative_config=spec, dtype="float32", max_model_len=64)
    )
    app = build_app(engine, served_model_name="tiny", api_key=KEY, grammar_timeout_s=1.0)
    with serve_in_background(app) as background:
        yield background.base_url


def _count(kind: str, status: int) -> None:
    by_status = COUNTS.setdefault(kind, {})
    by_status[status] = by_status.get(status, 0) + 1


def _check(status: int, content_type: str, text: str, what: str) -> None:
    assert status < 500, (what, status, text[:2000])
    if status >= 400 and content_type.startswith("application/json"):
        message = json.loads(text)["error"]["message"]
        assert isinstance(message, str) and message, (what, text[:2000])


@pytest.mark.slow  # SCHEMATHESIS_EXAMPLES generated requests, some of which generate text
def test_schemathesis_cases_never_get_a_server_error(url: str) -> None:
    """Every operation of /openapi.json, with valid and invalid generated inputs (schemathesis's
    strategies, drawn by hypothesis): never a 5xx, and every JSON error has a message."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    strategies = [operation.as_strategy(mode) for operation in operations for mode in GenerationMode]

    @settings(
        max_examples=SCHEMATHESIS_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=st.one_of(strategies))
    def run(case: Any) -> None:
        response = case.call(headers=HEADERS, timeout=120)
        _count("schemathesis", response.status_code)
        content_type = (response.headers.get("content-type") or [""])[0]
        _check(response.status_code, content_type, response.text, f"{case.method} {case.path} {case.body!r}")

    run()
    assert len(operations) >= 12


class Raw(str):
    """JSON text written as it is: numbers json.dumps refuses (thousands of digits) or NaN."""


def _dumps(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{_dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_dumps(v) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return json.dumps(value, ensure_ascii=False)


FIELDS = sorted(set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields))
BASES = {
    "/v1/completions": {"prompt": "hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [5, 6]},
}
digits = st.integers(min_value=1, max_value=6000).map(lambda n: "9" * n)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(
        ["café", "東京タワー", "🙂👍🏽", "\x00", "\ud7ff", "(x{1000}){1000}", "((", "-1", "1e999"]
    ),
    digits.map(Raw),  # a JSON number of up to 6,000 digits
    digits.map(lambda d: Raw("-" + d + ".5e-99999")),
    digits,  # the same as a string
)
hostile = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.dictionaries(st.one_of(st.text(max_size=10), digits, st.sampled_from(FIELDS)), inner, max_size=5),
    ),
    max_leaves=12,
)
nested = st.integers(min_value=100, max_value=20_000).map(lambda n: Raw("[" * n + "]" * n))


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    route = draw(st.sampled_from(sorted(BASES)))
    if draw(st.integers(0, 19)) == 0:  # not JSON, or not an object
        return route, draw(
            st.one_of(st.binary(max_size=200), st.sampled_from([b"", b"[]", b"null", b'{"a":']))
        )
    body: dict[str, Any] = dict(BASES[route])
    for name in draw(
        st.lists(st.one_of(st.sampled_from(FIELDS), st.text(max_size=8)), min_size=1, max_size=3)
    ):
        body[name] = draw(st.one_of(hostile, nested, st.dictionaries(digits, scalars, max_size=3)))
    return route, _dumps(body).encode()


@pytest.fixture(scope="module")
def kept_alive(url: str) -> Iterator[tuple[httpx.Client, list[int]]]:
    """One client with one connection, and the list of connections it had to open (one, if the server
    never closes it)."""
    with httpx.Client(base_url=url, timeout=120, limits=httpx.Limits(max_connections=1)) as client:
        yield client, []


@pytest.mark.slow  # HOSTILE_EXAMPLES requests
@seed(31)
@settings(
    max_examples=HOSTILE_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(request=requests())
def test_hostile_values_in_any_field_never_get_a_server_error(
    kept_alive: tuple[httpx.Client, list[int]], request: tuple[str, bytes]
) -> None:
    """Good bodies with one to three fields set to hostile values (see the module docstring): never a
    5xx, every error in the OpenAI shape, and the kept-alive connection survives every answer."""
    client, connects = kept_alive

    def trace(event: str, info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.complete":
            connects.append(1)

    route, body = request
    headers = {**HEADERS, "Content-Type": "application/json"}
    response = client.post(route, content=body, headers=headers, extensions={"trace": trace})
    _count("hostile", response.status_code)
    content_type = response.headers.get("content-type", "")
    _check(response.status_code, content_type, response.text, f"{route} {body[:3000]!r}")
    assert len(connects) <= 1, "the server closed the kept-alive connection"


def test_zz_report_counts() -> None:
    """Prints what the fuzz runs above sent (with -s), for docs/server.md's probe table."""
    print(json.dumps(COUNTS, sort_keys=True))
    assert all(status < 500 for by_status in COUNTS.values() for status in by_status)
