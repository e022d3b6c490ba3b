"""The engine's features over HTTP (docs/server.md): logprobs (checked against an independent forward pass),
echo, n > 1, penalties and logit bias, structured output and enforced tool calls under aggressive FLy,
and a request failing inside the engine while the others go on.

Real uvicorn servers on loopback ports, tiny random-weight models in float32:
- `plain`: a word-level tiny Llama decoding target-only;
- `fly`: the same target with a slightly perturbed draft and FLy at its most forgiving (theta 0, W 1);
- `byte_fly`: a byte-level tiny Llama (it can spell any JSON) with a noisy draft and the same FLy.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families
from test_structured import SCHEMA  # the engine tests' schema, so both layers check the same one
from tiny_llm import save_perturbed, save_tiny

from flyspec.config import EngineConfig
from flyspec.engine.engine import LLMEngine
from flyspec.server.app import IGNORED_FIELDS_HEADER, build_app
from flyspec.server.background import serve_in_background

MODEL = "tiny"
AGGRESSIVE_FLY = {"rejection_sample_method": "fly", "fly_window_size": 1, "fly_entropy_threshold": 0.0}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two small numbers",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 9},
                "b": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


@dataclass
class Server:
    url: str
    engine: LLMEngine
    target: Path

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=300)

    def ok(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = self.post(path, {"model": MODEL, **body})
        assert r.status_code == 200, r.text
        return r.json()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=300)

    def prompt_ids(self, **body: Any) -> list[int]:
        return self.ok("/tokenize", body)["tokens"]

    def finished(self, reason: str) -> float:
        """flyspec:request_success_total for one finished_reason."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return next(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "flyspec:request_success_total" and s.labels["finished_reason"] == reason
        )


def _serve(engine: LLMEngine, target: Path) -> Iterator[Server]:
    with serve_in_background(build_app(engine, served_model_name=MODEL)) as background:
        yield Server(background.base_url, engine, target)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("feature_models")
    target = save_tiny(root / "target", seed=0)
    byte_target = save_tiny(root / "byte_target", seed=0, byte_level=True)
    return {
        "target": target,
        "draft": save_perturbed(target, root / "draft", seed=1, noise=0.02),
        "byte_target": byte_target,
        # Enough noise that the draft disagrees with the target at most positions (as test_structured.py).
        "byte_draft": save_perturbed(byte_target, root / "byte_draft", seed=4, noise=0.1),
    }


def _engine(model: Path, spec: dict[str, Any] | None = None, **kwargs: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), speculative_config=spec, dtype="float32", **kwargs))


@pytest.fixture(scope="module")
def plain(models: dict[str, Path]) -> Iterator[Server]:
    yield from _serve(_engine(models["target"], max_model_len=256), models["target"])


@pytest.fixture(scope="module")
def fly(models: dict[str, Path]) -> Iterator[Server]:
    spec = {"model": str(models["draft"]), "num_speculative_tokens": 3, **AGGRESSIVE_FLY}
    yield from _serve(_engine(models["target"], spec, max_num_seqs=8, max_model_len=256), models["target"])


@pytest.fixture(scope="module")
def byte_fly(models: dict[str, Path]) -> Iterator[Server]:
    spec = {"model": str(models["byte_draft"]), "num_speculative_tokens": 4, **AGGRESSIVE_FLY}
    engine = _engine(models["byte_target"], spec, max_num_seqs=8, max_model_len=512)
    yield from _serve(engine, models["byte_target"])


class Reference:
    """An independent forward pass: the checkpoint through transformers, in float32."""

    def __init__(self, path: Path) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)

    def logits(self, ids: list[int]) -> torch.Tensor:
        """[len(ids), V] logits: row i predicts token i + 1."""
        with torch.no_grad():
            return self.model(torch.tensor([ids])).logits[0].float()

    def ids(self, tokens: list[str]) -> list[int]:
        return self.tokenizer.convert_tokens_to_ids(tokens)


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> Reference:
    return Reference(models["target"])


def _processed(
    logits: torch.Tensor,
    output: list[int],
    *,
    bias: dict[int, float] | None = None,
    presence: float = 0.0,
    frequency: float = 0.0,
    temperature: float = 0.0,
) -> torch.Tensor:
    """Log of the processed target distribution at each output position (docs/verification.md order):
    bias, then presence / frequency penalties over the tokens generated before it, then temperature."""
    rows = []
    for j in range(len(output)):
        row = logits[j].clone()
        for token, value in (bias or {}).items():
            row[token] += value
        for token in set(output[:j]):
            row[token] -= presence + frequency * output[:j].count(token)
        rows.append(torch.log_softmax(row / temperature if temperature else row, dim=-1))
    return torch.stack(rows)


def _check_completion_logprobs(
    logprobs: dict[str, Any], expected: torch.Tensor, ids: list[int], k: int, reference: Reference
) -> None:
    """Each token's logprob and every listed alternative's equal `expected` (1e-4); the listed
    alternatives include the top k of `expected`."""
    assert len(logprobs["tokens"]) == len(ids) == expected.shape[0]
    for j, token in enumerate(ids):
        assert logprobs["token_logprobs"][j] == pytest.approx(expected[j, token].item(), abs=1e-4)
        reported = logprobs["top_logprobs"][j]
        reported_ids = reference.ids(list(reported))
        assert len(reported) in (k, k + 1)
        for alt, value in zip(reported_ids, reported.values(), strict=True):
            assert value == pytest.approx(expected[j, alt].item(), abs=1e-4)
        assert set(torch.topk(expected[j], k).indices.tolist()) <= set(reported_ids)


def test_logprobs_equal_an_independent_forward_pass(plain: Server, reference: Reference) -> None:
    """Target-only, fp32: completions logprobs (greedy; greedy with logit_bias and presence/frequency
    penalties; seeded sampling at temperature 0.7) and chat logprobs report, for every token, the log of
    its probability under the processed target distribution as computed by transformers (1e-4), with the
    top-k alternatives of that distribution; greedy tokens are the argmax."""
    prompt = "w1 w2 w3 w4"
    prompt_ids = plain.prompt_ids(prompt=prompt)
    bias = {prompt_ids[-1] + 7: 3.0, 40: -2.0}
    cases = [
        ({"temperature": 0}, {}),
        (
            {
                "temperature": 0,
                "logit_bias": {str(t): v for t, v in bias.items()},
                "presence_penalty": 0.8,
                "frequency_penalty": 0.3,
            },
            {"bias": bias, "presence": 0.8, "frequency": 0.3},
        ),
        ({"temperature": 0.7, "seed": 3}, {"temperature": 0.7}),
    ]
    for fields, processing in cases:
        body = {"prompt": prompt, "max_tokens": 12, "logprobs": 3, "ignore_eos": True, **fields}
        choice = plain.ok("/v1/completions", body)["choices"][0]
        ids = reference.ids(choice["logprobs"]["tokens"])
        logits = reference.logits(prompt_ids + ids)[len(prompt_ids) - 1 : -1]
        expected = _processed(logits, ids, **processing)
        _check_completion_logprobs(choice["logprobs"], expected, ids, 3, reference)
        if fields["temperature"] == 0:
            assert ids == expected.argmax(dim=-1).tolist()

    messages = [{"role": "user", "content": "w5 w6 w7"}]
    chat = plain.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    ids = reference.ids([c.token for c in content])
    chat_ids = plain.prompt_ids(messages=messages)
    expected = _processed(reference.logits(chat_ids + ids)[len(chat_ids) - 1 : -1], ids)
    for j, entry in enumerate(content):
        assert entry.logprob == pytest.approx(expected[j, ids[j]].item(), abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
        top = torch.topk(expected[j], 2)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert reference.ids([t.token for t in entry.top_logprobs]) == top.indices.tolist()


def test_forgiven_tokens_report_the_targets_low_probability(fly: Server, reference: Reference) -> None:
    """With FLy (greedy, theta 0, W 1): every token's reported logprob is the target's own log-probability
    there (1e-4, independent pass), accepted, forgiven, recovered and bonus tokens alike. The tokens that
    are not the target's argmax are exactly the forgiven ones: as many as spec_decode counts, each below
    the best alternative the response lists."""
    forgiven_seen = 0
    for i in range(6):
        prompt = f"w{i} w{3 * i + 1} w{5 * i + 2}"
        prompt_ids = fly.prompt_ids(prompt=prompt)
        body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "logprobs": 1, "ignore_eos": True}
        response = fly.ok("/v1/completions", body)
        logprobs = response["choices"][0]["logprobs"]
        ids = reference.ids(logprobs["tokens"])
        expected = _processed(reference.logits(prompt_ids + ids)[len(prompt_ids) - 1 : -1], ids)
        _check_completion_logprobs(logprobs, expected, ids, 1, reference)
        not_argmax = [j for j, t in enumerate(ids) if t != expected[j].argmax().item()]
        assert len(not_argmax) == response["spec_decode"]["num_forgiven_tokens"]
        for j in not_argmax:
            assert logprobs["token_logprobs"][j] < max(logprobs["top_logprobs"][j].values()) - 1e-6
        forgiven_seen += len(not_argmax)
    assert forgiven_seen > 0, "FLy forgave nothing: the test would prove nothing"


def test_echo_returns_the_prompt_with_its_raw_logprobs(plain: Server, reference: Reference) -> None:
    """echo with logprobs (lm-eval's loglikelihood request): the text is prompt + completion, the first
    prompt token has null logprobs, every other prompt token its raw log-probability (independent pass);
    max_tokens 0 returns the prompt alone; streamed, the echo comes first and the pieces add up."""
    prompt = "w9 w8 w7 w6 w5"
    prompt_ids = plain.prompt_ids(prompt=prompt)
    raw = torch.log_softmax(reference.logits(prompt_ids), dim=-1)
    for max_tokens in (0, 1, 3):
        body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": max_tokens, "temperature": 0}
        response = plain.ok("/v1/completions", body)
        choice = response["choices"][0]
        lp = choice["logprobs"]
        n = len(prompt_ids)
        assert choice["text"].startswith(prompt) and len(lp["tokens"]) == n + max_tokens
        assert reference.ids(lp["tokens"][:n]) == prompt_ids
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for i in range(1, n):
            assert lp["token_logprobs"][i] == pytest.approx(raw[i - 1, prompt_ids[i]].item(), abs=1e-4)
            assert max(lp["top_logprobs"][i].values()) == pytest.approx(raw[i - 1].max().item(), abs=1e-4)
        assert response["usage"] == {
            "prompt_tokens": n,
            "completion_tokens": max_tokens,
            "total_tokens": n + max_tokens,
        }
        if max_tokens == 0:
            assert choice["text"] == prompt
        streamed = list(plain.client().completions.create(model=MODEL, stream=True, **body))
        assert "".join(c.choices[0].text for c in streamed if c.choices) == choice["text"]
        tokens = [
            t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens
        ]
        assert tokens == lp["tokens"]
    plain_echo = plain.ok("/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 0})["choices"][0]
    assert plain_echo["text"] == prompt and plain_echo["logprobs"] is None


def test_n_samples_are_the_seeded_requests_they_derive_from(fly: Server) -> None:
    """n = 3 with seed s gives choices 0..2 equal to three requests seeded s, s + 1, s + 2 (docs/
    sampling.md), for two prompts at once (index = prompt * n + sample); usage adds every sample's
    tokens, the prompt once each; streamed, each index concatenates to its non-streamed text; chat too."""
    common: dict[str, Any] = {"max_tokens": 10, "temperature": 0.9, "ignore_eos": True}
    client_common: dict[str, Any] = {"max_tokens": 10, "temperature": 0.9, "extra_body": {"ignore_eos": True}}
    prompts = ["w1 w2", "w30 w31 w32"]
    alone = [
        [
            fly.ok("/v1/completions", {"prompt": p, "seed": 5 + i, **common})["choices"][0]["text"]
            for i in range(3)
        ]
        for p in prompts
    ]
    assert len({t for texts in alone for t in texts}) > 1
    response = fly.ok("/v1/completions", {"prompt": prompts, "n": 3, "seed": 5, **common})
    assert [c["index"] for c in response["choices"]] == list(range(6))
    assert [c["text"] for c in response["choices"]] == alone[0] + alone[1]
    prompt_tokens = sum(len(fly.prompt_ids(prompt=p)) for p in prompts)
    assert response["usage"]["prompt_tokens"] == prompt_tokens
    assert response["usage"]["completion_tokens"] == 6 * 10
    chunks = list(
        fly.client().completions.create(
            model=MODEL, prompt=prompts, n=3, seed=5, stream=True, **client_common
        )
    )
    by_index: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + choice.text
    assert [by_index[i] for i in range(6)] == alone[0] + alone[1]
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason == "length") == 6

    messages = [{"role": "user", "content": "w5"}]
    chat_alone = [
        fly.ok("/v1/chat/completions", {"messages": messages, "seed": 8 + i, **common})["choices"][0][
            "message"
        ]["content"]
        for i in range(2)
    ]
    chat = fly.client().chat.completions.create(model=MODEL, messages=messages, n=2, seed=8, **client_common)  # type: ignore[arg-type]
    assert [c.message.content for c in chat.choices] == chat_alone and [c.index for c in chat.choices] == [
        0,
        1,
    ]
    stream = list(
        fly.client().chat.completions.create(
            model=MODEL, messages=messages, n=2, seed=8, stream=True, **client_common
        )
    )  # type: ignore[arg-type]
    streamed = [
        "".join(c.choices[0].delta.content or "" for c in stream if c.choices and c.choices[0].index == i)
        for i in range(2)
    ]
    assert streamed == chat_alone


def test_logit_bias_steers_greedy_output(plain: Server) -> None:
    """End to end through the processed distribution: logit_bias +100 on a token makes greedy decoding
    pick it at every position, -100 on the unbiased first token replaces it; repetition_penalty 1 and
    min_p 0 (vLLM's defaults) change nothing. (test_logprobs_equal_an_independent_forward_pass checks the
    penalised distributions value by value.)"""
    prompt_ids = plain.prompt_ids(prompt="w1 w2 w3")
    forced = prompt_ids[-1] + 11
    common = {"prompt": "w1 w2 w3", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}

    def tokens(**fields: Any) -> list[str]:
        return plain.ok("/v1/completions", {**common, **fields})["choices"][0]["logprobs"]["tokens"]

    plain_tokens = tokens()
    first = plain.ok("/tokenize", {"prompt": plain_tokens[0], "add_special_tokens": False})["tokens"][0]
    word = plain.ok("/detokenize", {"tokens": [forced]})["prompt"]
    assert tokens(logit_bias={str(forced): 100}) == [word] * 6
    assert tokens(logit_bias={str(first): -100})[0] != plain_tokens[0]
    assert tokens(repetition_penalty=1.0, min_p=0.0) == plain_tokens


def test_json_schema_outputs_validate_under_aggressive_fly(byte_fly: Server) -> None:
    """24 seeded sampling requests (chat and completions) with response_format json_schema, on a byte-level
    model whose draft disagrees often and FLy forgives at theta 0, W 1: every output parses and validates
    against the schema and ends because the grammar completed, and FLy did forgive tokens."""
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    common = {"max_tokens": 160, "temperature": 1.0, "response_format": response_format}

    def one(seed: int) -> tuple[str, str, dict[str, int]]:
        if seed % 2:
            body = {"messages": [{"role": "user", "content": "a person"}], "seed": seed, **common}
            r = byte_fly.ok("/v1/chat/completions", body)
            choice = r["choices"][0]
            return choice["message"]["content"], choice["finish_reason"], r["spec_decode"]
        r = byte_fly.ok("/v1/completions", {"prompt": "person:", "seed": seed, **common})
        return r["choices"][0]["text"], r["choices"][0]["finish_reason"], r["spec_decode"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(24)))
    for text, finish, _ in results:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert sum(spec["num_forgiven_tokens"] for _, _, spec in results) > 0
    assert sum(spec["num_draft_tokens"] - spec["num_accepted_tokens"] for _, _, spec in results) > 0


def test_json_object_guided_fields_and_grammar_errors(byte_fly: Server) -> None:
    """json_object gives an object; vLLM's guided_choice / guided_regex / structured_outputs constrain
    every sample of n = 3; a grammar the engine cannot compile is a 400 naming the client's field."""
    chat = [{"role": "user", "content": "x"}]
    obj = byte_fly.ok(
        "/v1/chat/completions",
        {"messages": chat, "max_tokens": 200, "seed": 1, "response_format": {"type": "json_object"}},
    )
    choice = obj["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:  # an unbounded object may run out of max_tokens
        assert choice["message"]["content"].lstrip().startswith("{")
    picked = byte_fly.ok(
        "/v1/completions",
        {"prompt": "x", "n": 3, "seed": 2, "max_tokens": 20, "guided_choice": ["yes", "no"]},
    )
    assert all(c["text"] in ("yes", "no") for c in picked["choices"]) and len(picked["choices"]) == 3
    regex = byte_fly.ok(
        "/v1/completions",
        {
            "prompt": "x",
            "n": 3,
            "seed": 3,
            "max_tokens": 20,
            "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"},
        },
    )
    assert all(len(c["text"]) == 6 and c["text"][3] == "-" for c in regex["choices"])
    for body, param in [
        ({"guided_regex": "(("}, "guided_regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strange"}}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs.grammar"),
    ]:
        r = byte_fly.post("/v1/chat/completions", {"messages": chat, "max_tokens": 5, **body})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and error["message"].startswith(param), r.text
    assert byte_fly.engine.num_running == 0


def test_enforced_tool_calls_come_back_as_openai_tool_calls(byte_fly: Server) -> None:
    """With the official client: tool_choice naming a function returns one call to it whose arguments
    validate against its parameters (finish_reason stop); "required" with parallel_tool_calls false
    returns exactly one call of a declared function (finish_reason tool_calls); streamed, the call comes
    whole on the last chunk; tools with tool_choice auto is a typed 400 naming tools."""
    client = byte_fly.client()
    messages = [{"role": "user", "content": "add 2 and 3"}]
    named = {"type": "function", "function": {"name": "add"}}
    params = ADD["function"]["parameters"]  # type: ignore[index]
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=messages, tools=[ADD, NOW], tool_choice=named, seed=seed, max_tokens=200
        )  # type: ignore[arg-type]
        (call,) = r.choices[0].message.tool_calls  # type: ignore[misc]
        assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content is None
        assert call.function.name == "add" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), params)
    done = 0
    for seed in range(4):
        r = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[ADD, NOW],
            tool_choice="required",
            parallel_tool_calls=False,
            seed=seed,
            max_tokens=250,
        )  # type: ignore[arg-type]
        choice = r.choices[0]
        if choice.finish_reason == "length":  # the random model's whitespace can run out of tokens
            continue
        (call,) = choice.message.tool_calls  # type: ignore[misc]
        assert choice.finish_reason == "tool_calls" and call.function.name in ("add", "now")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(
            arguments, params if call.function.name == "add" else {"type": "object", "maxProperties": 0}
        )
        done += 1
    assert done >= 2
    stream = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=[ADD],
            tool_choice=named,
            seed=0,
            max_tokens=200,
            stream=True,
        )
    )  # type: ignore[arg-type]
    calls = [
        tc
        for c in stream
        if c.choices and c.choices[0].delta.tool_calls
        for tc in c.choices[0].delta.tool_calls
    ]
    assert len(calls) == 1 and calls[0].function.name == "add"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(calls[0].function.arguments), params)  # type: ignore[union-attr, arg-type]
    with pytest.raises(openai.BadRequestError, match="tool_choice .auto. .the default."):
        client.chat.completions.create(model=MODEL, messages=messages, tools=[ADD], max_tokens=5)  # type: ignore[arg-type, list-item]


def _assert_same_choices(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """The same tokens, text and finish; logprobs equal up to float32 rounding (a batch computes the same
    rows with other matrix shapes)."""
    for g, e in zip(got, expected, strict=True):

        def rest(choice: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in choice.items() if k != "logprobs"}

        assert rest(g) == rest(e)
        if e["logprobs"] is not None:
            assert g["logprobs"]["tokens"] == e["logprobs"]["tokens"]
            assert g["logprobs"]["token_logprobs"] == pytest.approx(e["logprobs"]["token_logprobs"], abs=1e-5)


def _poison(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch, marker: list[int], field: str, value: Any
) -> None:
    """Fault injection on the real engine: the request whose prompt is `marker` gets `field` set to
    `value` after validation, as a bug would (tests/test_isolation.py does the same in-process)."""
    real = engine.add_request

    def add_request(request_id: str, prompt: Any, params: Any, **kwargs: Any) -> None:
        if list(prompt) == marker:
            setattr(params, field, value)
        real(request_id, prompt, params, **kwargs)

    monkeypatch.setattr(engine, "add_request", add_request)


@pytest.mark.parametrize(
    ("field", "value"), [("temperature", 1e300), ("temperature", 1e-40), ("top_k", 2**64)]
)
def test_a_request_failing_in_the_engine_is_a_500_and_the_others_are_unchanged(
    fly: Server, monkeypatch: pytest.MonkeyPatch, field: str, value: Any
) -> None:
    """A request that fails inside the engine (a sampling value past validation, under FLy) is a 500
    server_error, never a 400 (as JSON, or an error event in its stream that the openai client raises),
    while concurrent greedy, seeded, n > 1 and logprobs requests complete with exactly the output they
    get alone; each failure counts once as finished_reason error; the server then has no request left and
    keeps serving."""
    good = [
        {"prompt": "w1 w2 w3", "max_tokens": 30, "temperature": 0, "ignore_eos": True},
        {"prompt": "w40 w41", "max_tokens": 30, "temperature": 0.8, "seed": 4, "ignore_eos": True},
        {"prompt": "w7 w8", "max_tokens": 20, "temperature": 0.8, "seed": 9, "n": 2, "ignore_eos": True},
        {"prompt": "w100 w90", "max_tokens": 20, "temperature": 0, "logprobs": 2, "ignore_eos": True},
    ]
    alone = [fly.ok("/v1/completions", body)["choices"] for body in good]
    errors_before = fly.finished("error")
    marker = [1, 200, 201, 202]
    _poison(fly.engine, monkeypatch, marker, field, value)
    bad = {
        "model": MODEL,
        "prompt": marker,
        "max_tokens": 30,
        "temperature": 0.7,
        "seed": 1,
        "ignore_eos": True,
    }
    started = threading.Barrier(len(good) + 2)

    def run(body: dict[str, Any]) -> httpx.Response:
        started.wait()
        return fly.post("/v1/completions", {"model": MODEL, **body})

    def run_stream() -> list[dict[str, Any]]:
        started.wait()
        with httpx.stream(
            "POST", f"{fly.url}/v1/completions", json={**bad, "stream": True}, timeout=300
        ) as r:
            assert r.status_code == 200
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    with ThreadPoolExecutor(len(good) + 2) as pool:
        running = [pool.submit(run, body) for body in good]
        failed = pool.submit(run, bad)
        streamed = pool.submit(run_stream)
        responses = [f.result() for f in running]
        failed_response, events = failed.result(), streamed.result()
    assert failed_response.status_code == 500, failed_response.text
    error = failed_response.json()["error"]
    assert error["type"] == "server_error" and "the engine failed on this request" in error["message"]
    assert events[-1]["error"]["type"] == "server_error"
    assert [r.status_code for r in responses] == [200] * len(good)
    for response, expected in zip(responses, alone, strict=True):
        _assert_same_choices(response.json()["choices"], expected)
    with pytest.raises(openai.APIError, match="the engine failed on this request"):
        list(
            fly.client().completions.create(
                model=MODEL, prompt=marker, max_tokens=5, temperature=0.7, stream=True
            )
        )
    monkeypatch.undo()
    assert fly.finished("error") - errors_before == 3
    _assert_same_choices(fly.ok("/v1/completions", good[0])["choices"], alone[0])
    assert (fly.engine.num_running, fly.engine.num_waiting) == (0, 0)


def test_ignored_fields_header_names_exactly_what_had_no_effect(byte_fly: Server) -> None:
    """Every route's x-flyspec-ignored-fields header names the unknown fields (also nested in
    response_format, tools, messages) and the recognised ones that changed nothing (bookkeeping fields,
    reasoning_effort, parallel_tool_calls without a required call, tools with tool_choice none,
    stream_options without stream); a request whose every field acts has no header."""
    chat = [{"role": "user", "content": "x"}]
    acting = {
        "messages": chat,
        "max_tokens": 3,
        "n": 2,
        "seed": 1,
        "logprobs": True,
        "top_logprobs": 2,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.1,
        "repetition_penalty": 1.1,
        "min_p": 0.01,
        "logit_bias": {"70": 1},
        "top_k": 50,
        "top_p": 0.9,
        "stop": ["zz"],
        "verification": "standard",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": SCHEMA, "strict": True},
        },
    }
    r = byte_fly.post("/v1/chat/completions", acting)
    assert r.status_code == 200 and IGNORED_FIELDS_HEADER not in r.headers, r.headers
    cases = [
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x", "audio": None}],
                "max_tokens": 2,
                "metadata": {"a": "b"},
                "reasoning_effort": "low",
                "parallel_tool_calls": True,
                "tools": [{**ADD, "cache_control": {}}],
                "tool_choice": "none",
                "response_format": {"type": "json_object", "x_format": 1},
            },
            "response_format.x_format, messages.*.audio, tools.*.cache_control, metadata, reasoning_effort, "
            "parallel_tool_calls, tools",
        ),
        (
            "/v1/completions",
            {
                "prompt": "x",
                "max_tokens": 2,
                "user": "u",
                "stream_options": {"include_usage": True},
                "guided_decoding_backend": "xgrammar",
            },
            "guided_decoding_backend, user, stream_options",
        ),
        ("/tokenize", {"prompt": "x", "frob": 1}, "frob"),
        ("/detokenize", {"tokens": [70], "frob": 1}, "frob"),
    ]
    for path, body, header in cases:
        r = byte_fly.post(path, body)
        assert r.status_code == 200, r.text
        assert r.headers[IGNORED_FIELDS_HEADER] == header, path
