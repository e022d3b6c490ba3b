"""Clients written for OpenAI and vLLM work against the server (docs/server.md): their default fields,
`vllm bench serve`'s request shapes, agent histories, vLLM's response fields, utility routes and metric
names. Real uvicorn on a loopback port, tiny random-weight model, the official openai client.

`test_probe_table` is the table of request shapes a new user would try, against a byte-level tiny model
(it can spell JSON, so grammars apply) with FLy: every row either works or is a 400 whose message names
the field and why; run with -s to print it.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import openai
import pytest
import test_server_bounds
from prometheus_client.parser import text_string_to_metric_families
from test_server_bounds import KEY, MODEL, Server
from test_server_features import byte_fly, models  # noqa: F401 - fixtures of the probe table
from zoo import zoo_model

from flyspec.server.app import IGNORED_FIELDS_HEADER

server = test_server_bounds.server  # the same fixture: one tiny server for this module

CHAT = [{"role": "user", "content": "w5 w6 w7"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            },
        },
    }
]
AGENT_HISTORY = [
    {"role": "system", "content": "w1"},
    {"role": "user", "content": "w2 w3"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": "w3"},
]


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def _metrics(server: Server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _sse(response: httpx.Response) -> list[dict[str, Any]]:
    """The JSON events of a server-sent-event body, read as vLLM's benchmark client reads them."""
    events = []
    for message in response.text.split("\n\n"):
        message = message.strip()
        if message and message.removeprefix("data: ") != "[DONE]":
            events.append(json.loads(message.removeprefix("data: ")))
    return events


def test_unknown_fields_are_ignored_named_in_a_header_and_logged(
    server: Server, caplog: pytest.LogCaptureFixture
) -> None:
    """Unknown fields (top level and inside messages) do not fail the request: it is answered normally,
    the x-flyspec-ignored-fields header names each one and a warning is logged; a request without unknown
    fields carries no such header, and an error response names them too."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "w5", "refusal": None}],
        "max_tokens": 2,
        "top-k": 3,
        "frobnicate": {"x": 1},
    }
    with caplog.at_level(logging.WARNING, logger="flyspec.server.app"):
        r = server.post("/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert r.headers[IGNORED_FIELDS_HEADER] == "top-k, frobnicate, messages.*.refusal"
    assert any("ignoring unknown request fields: top-k, frobnicate" in m for m in caplog.messages)
    plain = server.post("/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": 2})
    assert plain.status_code == 200 and IGNORED_FIELDS_HEADER not in plain.headers
    bad = server.post(
        "/v1/completions", {"model": MODEL, "prompt": "w1", "best_of": 3, "stream": True, "bogus": 1}
    )
    assert bad.status_code == 400 and bad.headers[IGNORED_FIELDS_HEADER] == "bogus"
    streamed = server.post("/v1/completions", {"model": MODEL, "prompt": "w1", "stream": True, "bogus": 1})
    assert streamed.status_code == 200 and streamed.headers[IGNORED_FIELDS_HEADER] == "bogus"
    # Names are client input: control and non-ASCII characters are escaped, never sent raw (found by
    # schemathesis: a raw control character made the header illegal and the connection drop).
    odd = server.post(
        "/v1/completions",
        {"model": MODEL, "prompt": "w1", "max_tokens": 1, "a\x15b": 1, "é": 2, "": 3, " x": 4},
    )
    assert odd.status_code == 200 and odd.headers[IGNORED_FIELDS_HEADER] == r'a\u0015b, \u00e9, "", \u0020x'


def test_vllm_bench_serve_request_shapes_work(server: Server) -> None:
    """The exact bodies `vllm bench serve` sends with its openai and openai-chat backends (streaming,
    stream_options, repetition_penalty 1.0, logprobs null, ignore_eos, an x-request-id header) succeed, and
    its way of reading the stream finds text chunks and a usage chunk with max_tokens tokens."""
    completions = {
        "model": MODEL,
        "prompt": "w1 w2 w3 w4",
        "repetition_penalty": 1.0,
        "max_tokens": 8,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "w1 w2 w3"}]}],
        "max_completion_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    for path, body, text_of in (
        ("/v1/completions", completions, lambda c: c["text"]),
        ("/v1/chat/completions", chat, lambda c: c["delta"].get("content") or ""),
    ):
        r = server.post(path, body, headers={"x-request-id": "bench-0"})
        assert r.status_code == 200, r.text
        events = _sse(r)
        chunks = [e for e in events if e.get("choices")]
        assert chunks and "".join(text_of(c["choices"][0]) for c in chunks)
        assert events[-1]["usage"]["completion_tokens"] == 8


def test_numbers_as_strings_work_end_to_end(server: Server) -> None:
    """`"max_tokens": "2"` and `"temperature": "0"` are read as numbers, as vLLM reads them."""
    r = server.post(
        "/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": "2", "temperature": "0"}
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_stop_reason_and_system_fingerprint(server: Server) -> None:
    """Responses carry vLLM's stop_reason (the stop string that ended the choice, the stop token id, or
    null for length) in JSON and on the final stream chunk, and one system_fingerprint throughout."""
    client = _client(server)
    common: dict[str, Any] = dict(model=MODEL, prompt="w1 w2 w3", temperature=0, max_tokens=20)
    full = client.completions.create(**common, extra_body={"ignore_eos": True})
    words = full.choices[0].text.split()
    assert full.choices[0].stop_reason is None and full.system_fingerprint.startswith("fp_")
    stop = words[3]
    by_string = client.completions.create(**common, stop=["zzz", stop], extra_body={"ignore_eos": True})
    assert by_string.choices[0].finish_reason == "stop" and by_string.choices[0].stop_reason == stop
    streamed = list(
        client.completions.create(**common, stop=[stop], stream=True, extra_body={"ignore_eos": True})
    )
    assert streamed[-1].choices[0].stop_reason == stop
    assert {c.system_fingerprint for c in streamed} == {full.system_fingerprint}
    first_id = server.post("/tokenize", {"prompt": words[0], "add_special_tokens": False}).json()["tokens"][0]
    by_id = client.completions.create(**common, extra_body={"stop_token_ids": [first_id]})
    assert by_id.choices[0].stop_reason == first_id and by_id.usage.completion_tokens == 1
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
    assert chat.system_fingerprint == full.system_fingerprint
    assert chat.choices[0].model_extra["stop_reason"] is None


def test_models_card_and_utility_routes(server: Server) -> None:
    """/v1/models cards carry root and parent; /version, /ping (GET and POST) answer without a key;
    /tokenize (text or chat) agrees with the prompt_tokens the server charges, /detokenize inverts it."""
    card = _client(server).models.list().data[0]
    assert card.id == MODEL and card.model_extra["root"] == MODEL and card.model_extra["parent"] is None
    assert httpx.get(f"{server.url}/version").json()["version"]
    assert httpx.get(f"{server.url}/ping").status_code == httpx.post(f"{server.url}/ping").status_code == 200
    text = server.post("/tokenize", {"model": MODEL, "prompt": "w1 w2 w3", "return_token_strs": True}).json()
    assert (
        text["count"] == 4
        and text["token_strs"] == ["<s>", "w1", "w2", "w3"]
        and text["max_model_len"] == 128
    )
    used = server.post("/v1/completions", {"model": MODEL, "prompt": "w1 w2 w3", "max_tokens": 1}).json()
    assert used["usage"]["prompt_tokens"] == text["count"]
    chat = server.post("/tokenize", {"messages": AGENT_HISTORY}).json()
    charged = server.post("/v1/chat/completions", {"messages": AGENT_HISTORY, "max_tokens": 1}).json()
    assert charged["usage"]["prompt_tokens"] == chat["count"]
    back = server.post("/detokenize", {"tokens": text["tokens"]}).json()
    assert back == {"prompt": "w1 w2 w3"}
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "w1"}).status_code == 401
    bad = server.post("/detokenize", {"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_models_retrieve_tokenizer_info_and_lm_evals_remote_tokenizer(server: Server) -> None:
    """The openai client's models.retrieve gets the served card (an unknown id: NotFoundError, a 404
    naming the model); /tokenizer_info answers vLLM's shape (tokenizer config without file paths, class,
    chat template; behind the key like /tokenize); and lm-eval 0.4.13's `tokenizer_backend=auto` probe
    accepts the server, whose RemoteTokenizer then encodes, decodes, finds EOS and renders chats exactly
    as the model's own tokenizer does. Before, /v1/models/{id} and /tokenizer_info were 404s, so `auto`
    fell back to a hub lookup of the model name."""
    import transformers
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    client = _client(server)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="'gpt-4o' is not served here") as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.code == "model_not_found"
    info = httpx.get(f"{server.url}/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert httpx.get(f"{server.url}/tokenizer_info").status_code == 401
    assert not [key for key in info if key.endswith("_file")]
    assert info["eos_token"] == "</s>" and info["bos_token"] == "<s>"
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and "chat_template" in info
    assert check_remote_tokenizer_support(server.url, auth_token=KEY)
    remote = RemoteTokenizer(server.url, auth_token=KEY)
    own = transformers.AutoTokenizer.from_pretrained(server.engine.config.model)
    text = "w1 w2 w3"
    assert remote.encode(text) == own(text, add_special_tokens=False).input_ids
    assert remote.decode(remote.encode(text)) == text
    assert (remote.eos_token_id, remote.bos_token_id) == (own.eos_token_id, own.bos_token_id)
    rendered = own.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert remote.apply_chat_template(CHAT) == rendered


def test_text_prompts_get_special_tokens_as_the_tokenizer_adds_them(server: Server) -> None:
    """vLLM's completions behaviour: a text prompt is tokenised with the model tokenizer's own special
    tokens (this tiny Llama-style tokenizer prepends <s>; add_special_tokens false leaves it out), a
    token-id prompt is taken as it is, and /tokenize, the usage the server charges and the prompt
    logprobs all agree."""
    import transformers

    own = transformers.AutoTokenizer.from_pretrained(server.engine.config.model)
    text = "w1 w2 w3"
    for special in (True, False):
        expected = own(text, add_special_tokens=special).input_ids
        body = {"prompt": text, "add_special_tokens": special}
        assert server.post("/tokenize", body).json()["tokens"] == expected
        used = server.post("/v1/completions", {**body, "max_tokens": 1, "prompt_logprobs": 0}).json()
        assert used["usage"]["prompt_tokens"] == len(expected)
        assert [int(next(iter(p))) for p in used["choices"][0]["prompt_logprobs"][1:]] == expected[1:]


def test_vllm_metric_names_with_model_name(server: Server) -> None:
    """The metrics vLLM dashboards read exist under flyspec: with model_name on every series: the
    admission cap, KV cache usage, preemptions (always 0), request_success by finished_reason, and queue /
    prefill / decode histograms that count each finished request once."""
    before = _metrics(server)
    label = (("model_name", MODEL),)
    client = _client(server)
    client.completions.create(model=MODEL, prompt="w1 w2", max_tokens=3)
    first = server.post("/tokenize", {"prompt": "w9", "add_special_tokens": False}).json()["tokens"][0]
    out = client.completions.create(model=MODEL, prompt="w1 w2", max_tokens=5, temperature=0)
    stop_id = server.post(
        "/tokenize", {"prompt": out.choices[0].text.split()[0], "add_special_tokens": False}
    )
    client.completions.create(
        model=MODEL,
        prompt="w1 w2",
        max_tokens=5,
        temperature=0,
        extra_body={"stop_token_ids": [stop_id.json()["tokens"][0], first]},
    )
    after = _metrics(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model_name": MODEL, **labels}.items())))
        return after[key] - before.get(key, 0.0)

    assert all(
        dict(labels).get("model_name") == MODEL for name, labels in after if name.startswith("flyspec:")
    )
    assert after[("flyspec:max_running_requests", label)] == server.engine.max_running
    assert 0 <= after[("flyspec:kv_cache_usage_perc", label)] <= 1
    assert after[("flyspec:num_preemptions_total", label)] == 0
    assert delta("flyspec:request_success_total", finished_reason="length") == 2
    assert delta("flyspec:request_success_total", finished_reason="stop") == 1
    for histogram in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert delta(f"flyspec:request_{histogram}_seconds_count") == 3
    assert delta("flyspec:request_generation_tokens_sum") == 3 + 5 + 1


def test_agent_history_through_the_openai_client(server: Server) -> None:
    """An agent conversation (assistant content null with tool_calls, then a tool result) is accepted by
    the official client and answered; tools sent with tool_choice "none" get a plain text answer."""
    client = _client(server)
    r = client.chat.completions.create(model=MODEL, messages=AGENT_HISTORY, max_tokens=3)
    assert r.choices[0].message.content and r.usage.completion_tokens == 3
    r = client.chat.completions.create(
        model=MODEL, messages=AGENT_HISTORY, tools=TOOLS, tool_choice="none", max_tokens=3
    )
    assert r.choices[0].message.content


def _probe_rows() -> list[tuple[str, str, dict[str, Any], str | None]]:
    """(description, route, body, expected error param or None for "works")."""
    c, p = "/v1/chat/completions", "/v1/completions"
    chat: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    comp: dict[str, Any] = {"model": MODEL, "prompt": "w1 w2", "max_tokens": 2}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    named = {"type": "function", "function": {"name": "add"}}
    return [
        ("chat, minimal", c, chat, None),
        ("completions, minimal", p, comp, None),
        (
            "chat, stream + stream_options.include_usage",
            c,
            {**chat, "stream": True, "stream_options": {"include_usage": True}},
            None,
        ),
        ("stream_options without stream", c, {**chat, "stream_options": {"include_usage": True}}, None),
        (
            "LangChain defaults: n 1, penalties 0, top_p 1, logit_bias {}",
            c,
            {**chat, "n": 1, "presence_penalty": 0, "frequency_penalty": 0, "top_p": 1, "logit_bias": {}},
            None,
        ),
        (
            "LiteLLM style: stop null, user, temperature 0.2",
            c,
            {**chat, "stop": None, "user": "u1", "temperature": 0.2},
            None,
        ),
        (
            "metadata, store false, service_tier auto",
            c,
            {**chat, "metadata": {"run": "1"}, "store": False, "service_tier": "auto"},
            None,
        ),
        ("reasoning_effort low", c, {**chat, "reasoning_effort": "low"}, None),
        ("parallel_tool_calls without tools", c, {**chat, "parallel_tool_calls": True}, None),
        ("tools + tool_choice none", c, {**chat, "tools": TOOLS, "tool_choice": "none"}, None),
        ("tools (tool_choice auto)", c, {**chat, "tools": TOOLS}, "tools"),
        ("tools + tool_choice required", c, {**chat, "tools": TOOLS, "tool_choice": "required"}, None),
        (
            "tools + tool_choice required, parallel_tool_calls false",
            c,
            {**chat, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
            None,
        ),
        ("tools + tool_choice naming a function", c, {**chat, "tools": TOOLS, "tool_choice": named}, None),
        (
            "tool_choice naming a function that is not in tools",
            c,
            {**chat, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sub"}}},
            "tool_choice.function.name",
        ),
        ("legacy functions", c, {**chat, "functions": [{"name": "add"}]}, "functions"),
        ("agent history: content null + tool_calls, tool role", c, {**chat, "messages": AGENT_HISTORY}, None),
        ("developer role", c, {**chat, "messages": [{"role": "developer", "content": "w1"}, *CHAT]}, None),
        (
            "content as text parts",
            c,
            {**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": "w1"}]}]},
            None,
        ),
        (
            "content with an image part",
            c,
            {
                **chat,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            },
            "messages.0.content",
        ),
        ("max_completion_tokens", c, {"model": MODEL, "messages": CHAT, "max_completion_tokens": 2}, None),
        ('max_tokens as a string "2"', p, {**comp, "max_tokens": "2"}, None),
        ("unknown field", c, {**chat, "frobnicate": 1}, None),
        (
            "prediction, modalities (ignored)",
            c,
            {**chat, "prediction": {"type": "content", "content": "w1"}, "modalities": ["text"]},
            None,
        ),
        ("response_format text", c, {**chat, "response_format": {"type": "text"}}, None),
        ("response_format json_object", c, {**chat, "response_format": {"type": "json_object"}}, None),
        (
            "response_format json_schema",
            c,
            {
                **chat,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            },
            None,
        ),
        (
            "response_format json_schema that does not compile",
            c,
            {**chat, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "response_format.json_schema.schema",
        ),
        ("guided_json (vLLM)", c, {**chat, "guided_json": schema}, None),
        ("guided_choice (vLLM)", p, {**comp, "guided_choice": ["yes", "no"]}, None),
        ("structured_outputs regex (vLLM)", p, {**comp, "structured_outputs": {"regex": "[0-9]+"}}, None),
        ("guided_choice with é, CJK, emoji", p, {**comp, "guided_choice": ["café", "東京", "🙂"]}, None),
        ("guided_regex with é, CJK, emoji", c, {**chat, "guided_regex": "(thé|東京タワー|👍🏽)+"}, None),
        (
            "json_schema enum with é",
            c,
            {
                **chat,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"enum": ["café", "crème brûlée"]}},
                },
            },
            None,
        ),
        ('guided_regex "(x{1000}){1000}"', p, {**comp, "guided_regex": "(x{1000}){1000}"}, "guided_regex"),
        (
            "response_format and guided_json together",
            c,
            {**chat, "response_format": {"type": "json_object"}, "guided_json": schema},
            "guided_json",
        ),
        ("chat logprobs + top_logprobs", c, {**chat, "logprobs": True, "top_logprobs": 2}, None),
        ("chat logprobs false, top_logprobs 0", c, {**chat, "logprobs": False, "top_logprobs": 0}, None),
        ("chat top_logprobs without logprobs", c, {**chat, "top_logprobs": 2}, "top_logprobs"),
        (
            "lm-eval loglikelihood: token ids, echo, logprobs 1, max_tokens 1",
            p,
            {
                **comp,
                "prompt": [[1, 70, 71, 72]],
                "echo": True,
                "logprobs": 1,
                "max_tokens": 1,
                "temperature": 0,
            },
            None,
        ),
        ("echo + logprobs, max_tokens 0", p, {**comp, "echo": True, "logprobs": 1, "max_tokens": 0}, None),
        ("max_tokens 0 without echo", p, {**comp, "max_tokens": 0}, "max_tokens"),
        ("completions logprobs 1", p, {**comp, "logprobs": 1}, None),
        ("completions logprobs 21", p, {**comp, "logprobs": 21}, "logprobs"),
        ("vLLM prompt_logprobs 1", p, {**comp, "prompt_logprobs": 1}, None),
        ("n 2", c, {**chat, "n": 2}, None),
        ("n 2, streamed", p, {**comp, "n": 2, "stream": True}, None),
        ("n 200", c, {**chat, "n": 200}, "n"),
        ("best_of 2 (n 1)", p, {**comp, "best_of": 2}, "best_of"),
        ("n 2, best_of 2", p, {**comp, "n": 2, "best_of": 2}, None),
        ("suffix", p, {**comp, "suffix": "w9"}, "suffix"),
        ("presence_penalty 0.5", c, {**chat, "presence_penalty": 0.5}, None),
        ("frequency_penalty 0.5", c, {**chat, "frequency_penalty": 0.5}, None),
        ("presence_penalty 3", c, {**chat, "presence_penalty": 3}, "presence_penalty"),
        ('logit_bias {"50": 5}', c, {**chat, "logit_bias": {"50": 5}}, None),
        ('logit_bias {"50": 500}', c, {**chat, "logit_bias": {"50": 500}}, "logit_bias.50"),
        ("logit_bias key of 5,000 digits", c, {**chat, "logit_bias": {"7" * 5000: 1}}, "logit_bias"),
        (
            'logit_bias {"999999": 1} (outside the vocabulary)',
            c,
            {**chat, "logit_bias": {"999999": 1}},
            "logit_bias",
        ),
        (
            "vLLM repetition_penalty 1.0, min_p 0, top_k -1",
            p,
            {**comp, "repetition_penalty": 1.0, "min_p": 0, "top_k": -1},
            None,
        ),
        ("vLLM repetition_penalty 1.1", p, {**comp, "repetition_penalty": 1.1}, None),
        ("vLLM repetition_penalty 0", p, {**comp, "repetition_penalty": 0}, "repetition_penalty"),
        ("vLLM min_p 0.1", p, {**comp, "min_p": 0.1}, None),
        (
            "vLLM skip_special_tokens true, min_tokens 0",
            p,
            {**comp, "skip_special_tokens": True, "min_tokens": 0},
            None,
        ),
        ("vLLM min_tokens 3", p, {**comp, "min_tokens": 3}, "min_tokens"),
        ("vLLM use_beam_search", p, {**comp, "use_beam_search": True}, "use_beam_search"),
        (
            "chat_template_kwargs enable_thinking",
            c,
            {**chat, "chat_template_kwargs": {"enable_thinking": False}},
            "chat_template_kwargs",
        ),
        (
            "seed, top_k, stop list, stop_token_ids",
            p,
            {**comp, "seed": 3, "top_k": 5, "stop": ["w9", "w8"], "stop_token_ids": [2]},
            None,
        ),
        ("temperature 1e300", p, {**comp, "temperature": 1e300}, "temperature"),
        ("temperature 1e-40", p, {**comp, "temperature": 1e-40}, "temperature"),
        ("top_k 2**64", p, {**comp, "top_k": 2**64}, "top_k"),
        ("seed 2**64", p, {**comp, "seed": 2**64}, "seed"),
        ("2000 prompts", p, {**comp, "prompt": ["w1"] * 2000}, "prompt"),
        ("verification standard (flyspec)", p, {**comp, "verification": "standard"}, None),
    ]


def test_probe_table(byte_fly: Any) -> None:  # noqa: F811 - the fixture imported above
    """Every request shape of the probe table either works (200) or is a 400 whose `param` and message
    name the field and say why; works rows report what the ignored-fields header names. The openai
    client sees the same (a BadRequestError naming the field)."""
    rows = []
    for description, route, body, expected in _probe_rows():
        r = byte_fly.post(route, body)
        if expected is None:
            assert r.status_code == 200, (description, r.text)
            ignored = r.headers.get(IGNORED_FIELDS_HEADER)
            outcome = "works" + (f" (ignored-fields header: {ignored})" if ignored else "")
        else:
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == expected, (description, r.text)
            assert expected.split(".")[0] in error["message"], (description, error["message"])
            outcome = f"400 `{expected}`: {error['message']}"
        rows.append(f"| {description} | {outcome} |")
    print("\n| request shape | result |\n|---|---|\n" + "\n".join(rows))
    client = openai.OpenAI(base_url=f"{byte_fly.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="tools with tool_choice .auto. .the default."):
        client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS)  # type: ignore[arg-type]


QWEN = "qwen2.5-coder-0.5b-instruct"


@pytest.mark.slow  # loads a real tokenizer from the prepared cache
def test_agent_history_renders_through_the_real_qwen_template() -> None:
    """Through the server's prompt path and Qwen2.5's own chat template, an assistant tool call renders
    as a <tool_call> block with its arguments as a JSON object (not a doubly quoted string) and the tool
    result as a <tool_response> block, followed by an open assistant turn."""
    import asyncio

    from flyspec.models.tokenizer import load_tokenizer
    from flyspec.server.prompts import PromptEncoder
    from flyspec.server.protocol import ChatCompletionRequest, parse_body
    from flyspec.server.workers import Workers

    tokenizer = load_tokenizer(zoo_model(QWEN))
    messages = [{"role": "user", "content": "add 1 and 2"}, *AGENT_HISTORY[2:]]
    messages[2] = {**messages[2], "content": "3"}
    req = parse_body(ChatCompletionRequest, json.dumps({"messages": messages}).encode())
    req.check(max_messages=4096)
    encoder = PromptEncoder(tokenizer, len(tokenizer), 4096, Workers(grammar_budget_s=2.0))
    ids = asyncio.run(encoder.chat_ids(req.template_messages()))
    text = tokenizer.decode(ids)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in text
    assert "<tool_response>\n3\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
