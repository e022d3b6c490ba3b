"""Server request parsing and stream bookkeeping, without a model: lax numbers as vLLM reads them, unknown
fields set aside, no-op values of unsupported fields accepted, every sampling value bounded, agent
histories turned into chat-template messages, and stop-string hold-back."""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from flyspec.outputs import CompletionOutput, Logprob
from flyspec.sampling_params import SamplingParams, StructuredOutputsParams
from flyspec.server.constraints import constraint_of
from flyspec.server.errors import OpenAIError
from flyspec.server.logprobs_json import CompletionLogprobs, chat_logprobs, prompt_logprobs_json
from flyspec.server.protocol import (
    _NO_OP_VALUES,
    MAX_PROMPTS_PER_REQUEST,
    ChatCompletionRequest,
    CompletionRequest,
    ignored_fields,
    parse_body,
)
from flyspec.server.request_params import sampling_params
from flyspec.server.responses import stop_reason
from flyspec.server.streaming import TextDeltas
from flyspec.server.tool_calls import ToolCallFormat


def _completion(**fields: Any) -> CompletionRequest:
    req = parse_body(CompletionRequest, json.dumps({"prompt": "x", **fields}).encode())
    req.check()
    return req


def _chat(messages: list[dict[str, Any]], **fields: Any) -> ChatCompletionRequest:
    req = parse_body(ChatCompletionRequest, json.dumps({"messages": messages, **fields}).encode())
    req.check(max_messages=100)
    return req


def _refused(make: Any, **fields: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        make(**fields)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        (b'{"prompt": "x", "max_tokens": 1.5}', "max_tokens", "integer"),
        (b'{"prompt": "x", "temperature": "warm"}', "temperature", "number"),
        (b'{"prompt": "x", "seed": true}', "seed", "integer"),
        (b'{"prompt": [1, "a"]}', "prompt", "token-id"),
        (b'{"prompt": "x", "stop": 3}', "stop", "list of strings"),
        (
            b'{"prompt": "x", "stream_options": {"include_usage": 1}}',
            "stream_options.include_usage",
            "boolean",
        ),
        (b'{"prompt": "x", "stream": "yes"}', "stream", "boolean"),
        (b'{"prompt": "x", "top_k": true}', "top_k", "not true/false"),
        (b'{"prompt": "x"', None, "not valid JSON"),
        (b'"x"', None, "JSON object"),
    ],
)
def test_completion_body_errors_name_the_field(body: bytes, param: str | None, needle: str) -> None:
    """A string that is no number, a fractional max_tokens, true as a seed or top_k, "yes" as a boolean:
    each is refused, and the error names the field path in `param` and says what was expected."""
    with pytest.raises(OpenAIError) as info:
        parse_body(CompletionRequest, body)
    assert info.value.status == 400 and info.value.param == param
    assert needle in info.value.message


def test_chat_body_errors_name_the_nested_field() -> None:
    """A bad message deep in the list is reported by its path; an image part is refused by its type."""
    with pytest.raises(OpenAIError) as info:
        parse_body(
            ChatCompletionRequest,
            b'{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}',
        )
    assert info.value.param == "messages.1.role"
    with pytest.raises(OpenAIError) as info:
        parse_body(
            ChatCompletionRequest, b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}'
        )
    assert info.value.param is not None and info.value.param.startswith("messages.0.content")


def test_numbers_sent_as_strings_are_read_as_vllm_reads_them() -> None:
    """pydantic's lax mode, as in vLLM: "2" is max_tokens 2, "0.5" a temperature, 2.0 an integer."""
    req = _completion(max_tokens="2", temperature="0.5", top_k=2.0, seed="7")
    assert (req.max_tokens, req.temperature, req.top_k, req.seed) == (2, 0.5, 2, 7)


def test_unknown_fields_are_set_aside_with_their_dotted_names() -> None:
    """Unknown fields anywhere (top level, inside stream_options, inside any message) are accepted and
    named, list positions written as `*`, each name once; a request without any has none."""
    req = _chat(
        [{"role": "user", "content": "a", "refusal": None}, {"role": "user", "content": "b", "refusal": "x"}],
        **{"top-k": 3, "stream": True, "stream_options": {"include_usage": True, "chunked": 1}},
    )
    assert ignored_fields(req) == ["top-k", "stream_options.chunked", "messages.*.refusal"]
    assert ignored_fields(_completion(max_tokens=2)) == []


@pytest.mark.parametrize("name", sorted(_NO_OP_VALUES))
def test_no_op_values_pass_and_other_values_are_refused_by_name(name: str) -> None:
    """Every recognised-but-unimplemented field accepts its no-op values (clients send them by default)
    and refuses anything else with a 400 naming the field and saying it is not supported."""
    for value in _NO_OP_VALUES[name]:
        _completion(**{name: value})
        _chat([{"role": "user", "content": "a"}], **{name: value})
    different = {
        "bad_words": ["x"],
        "allowed_token_ids": [1],
        "truncate_prompt_tokens": 5,
    }.get(name)
    if different is None:
        first = next(v for v in _NO_OP_VALUES[name] if v is not None)
        different = (not first) if isinstance(first, bool) else first + 1
    error = _refused(_completion, **{name: different})
    assert error.param == name and "is not supported" in error.message


def test_fields_the_server_cannot_honour_are_refused_by_name_defaults_pass() -> None:
    """best_of other than n, continuous usage, chat echo, custom chat templates and top_logprobs without
    logprobs are 400s naming the field; the supported fields and OpenAI's bookkeeping fields pass."""
    for fields, param in [
        ({"best_of": 2}, "best_of"),
        ({"n": 2, "best_of": 3}, "best_of"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        ({"n": 2, "prompt": ["a"] * 129}, "n"),
    ]:
        assert _refused(_completion, **fields).param == param
    _completion(
        logprobs=5,
        echo=True,
        n=3,
        best_of=3,
        response_format={"type": "json_object"},
        stream_options={"include_usage": True},
        user="u",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
    )
    chat = [{"role": "user", "content": "a"}]
    for fields, param in [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        ({"echo": True}, "echo"),
        ({"chat_template": "{{ x }}"}, "chat_template"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ]:
        assert _refused(_chat, messages=chat, **fields).param == param
    _chat(chat, logprobs=False, top_logprobs=0, reasoning_effort="low", parallel_tool_calls=True)
    _chat(chat, logprobs=True, top_logprobs=20, n=128)


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"temperature": 1e300}, "temperature", "use 0 for greedy"),
        ({"temperature": 1e-40}, "temperature", "use 0 for greedy"),
        ({"temperature": 0.005}, "temperature", "[0.01, 100]"),
        ({"temperature": -1}, "temperature", "use 0 for greedy"),
        ({"top_p": 1e-300}, "top_p", "round to 0 in float32"),
        ({"top_p": 1.5}, "top_p", "[1e-09, 1]"),
        ({"top_k": 2**64}, "top_k", str(2**31 - 1)),
        ({"top_k": -2}, "top_k", "-1 or 0 (off)"),
        ({"seed": 2**63}, "seed", "signed 64-bit"),
        ({"seed": -(2**63) - 1}, "seed", "signed 64-bit"),
        ({"stop": ["s"] * 65}, "stop", "at most 64 stop strings"),
        ({"stop": "x" * 1025}, "stop", "1 to 1024 characters"),
        ({"stop": ["ok", "y" * 2000]}, "stop.1", "1 to 1024 characters"),
        ({"stop_token_ids": list(range(1025))}, "stop_token_ids", "at most 1024 token ids"),
        ({"prompt": ["p"] * (MAX_PROMPTS_PER_REQUEST + 1)}, "prompt", f"at most {MAX_PROMPTS_PER_REQUEST}"),
        ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0.001}, "repetition_penalty", "[0.01, 100]"),
        ({"repetition_penalty": 101}, "repetition_penalty", "[0.01, 100]"),
        ({"min_p": 1.5}, "min_p", "[0, 1]"),
        ({"logit_bias": {"5": 101}}, "logit_bias.5", "[-100, 100]"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
        ({"logit_bias": {"-5": 1}}, "logit_bias", "not a token id"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"),
        ({"n": 0}, "n", "[1, 128]"),
        ({"n": 129}, "n", "[1, 128]"),
    ],
)
def test_sampling_values_outside_safe_bounds_are_refused(
    fields: dict[str, Any], param: str, needle: str
) -> None:
    """Values the float32 / int64 sampler cannot compute safely (temperature 1e300 is inf, 1e-40 gives
    NaN probabilities, top_k 2**64 overflows int64, seeds beyond int64) and oversized lists are each a 400
    naming the field and its documented bound; the bounds themselves are accepted."""
    error = _refused(_completion, **fields)
    assert error.param == param and needle in error.message, error.message
    for ok in (
        {"temperature": 0},
        {"temperature": 0.01},
        {"temperature": 100},
        {"top_p": 1e-9},
        {"top_k": 2**31 - 1},
        {"top_k": -1},
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"stop": ["s"] * 64},
        {"prompt": ["p"] * MAX_PROMPTS_PER_REQUEST},
        {"repetition_penalty": 0.01},
        {"repetition_penalty": 100},
        {"logit_bias": {"5": -100, "7": 100}},
        {"n": 128, "logprobs": 20, "prompt_logprobs": 20},
    ):
        _completion(**ok)


def test_non_finite_numbers_are_refused() -> None:
    """JSON's Infinity / NaN extensions and "inf" strings are refused as not finite."""
    for body in (b'{"prompt": "x", "temperature": Infinity}', b'{"prompt": "x", "top_p": NaN}'):
        with pytest.raises(OpenAIError) as info:
            parse_body(CompletionRequest, body)
        assert "finite" in info.value.message
    assert _refused(_completion, temperature="inf").param == "temperature"


def test_agent_history_becomes_template_messages() -> None:
    """An assistant turn with content null and tool_calls and a tool result are accepted; the template
    sees content "" (templates concatenate strings), tool calls with their arguments parsed from the JSON
    string into a mapping (HF templates serialise arguments with tojson), and the tool_call_id."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    req = _chat(
        [
            {"role": "user", "content": "add 1 and 2"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        ]
    )
    assert req.template_messages() == [
        {"role": "user", "content": "add 1 and 2"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "add", "arguments": {"a": 1, "b": 2}},
                    "id": "call_1",
                }
            ],
        },
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
    ]
    error = _refused(_chat, messages=[{"role": "user", "content": None}])
    assert error.param == "messages.0.content"


def test_tools_are_accepted_where_a_call_can_be_enforced() -> None:
    """tools with tool_choice absent or auto are a 400 naming tools (no parser for calls in free text);
    "required", a named function and "none" pass; a named function that is not among the tools, or a
    call asked for without tools, is a 400 naming tool_choice; legacy functions need function_call
    "none"."""
    chat = [{"role": "user", "content": "a"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for choice in (None, "auto"):
        fields: dict[str, Any] = (
            {"tools": tools} if choice is None else {"tools": tools, "tool_choice": choice}
        )
        error = _refused(_chat, messages=chat, **fields)
        assert error.param == "tools" and 'tool_choice "required"' in error.message
    assert _chat(chat, tools=tools, tool_choice="required").calls_tools
    assert _chat(chat, tools=tools, tool_choice={"type": "function", "function": {"name": "f"}}).calls_tools
    assert not _chat(chat, tools=tools, tool_choice="none", parallel_tool_calls=False).calls_tools
    _chat(chat, tools=[], tool_choice="auto")
    named = {"type": "function", "function": {"name": "g"}}
    assert _refused(_chat, messages=chat, tools=tools, tool_choice=named).param == "tool_choice.function.name"
    assert _refused(_chat, messages=chat, tool_choice="required").param == "tool_choice"
    assert _refused(_chat, messages=chat, functions=[{"name": "f"}]).param == "functions"
    _chat(chat, functions=[{"name": "f"}], function_call="none")


def test_stop_reason_names_what_ended_the_choice() -> None:
    """vLLM's stop_reason: the matched stop string (found right after the cut text in the decoded
    tokens), a stop token id, or None for end-of-sequence and for length."""
    out = CompletionOutput(0, "a b", [5, 6, 7], "stop")
    assert stop_reason(out, ["c", "zz"], [], "a bc d") == "c"
    assert stop_reason(out, ["q"], [7], "a b") == 7
    assert stop_reason(out, [], [], None) is None
    assert stop_reason(CompletionOutput(0, "a b", [5], "length"), ["c"], [5], "a bc") is None


@given(
    raw=st.text(alphabet="ab ", max_size=24),
    stops=st.lists(st.text(alphabet="ab ", min_size=1, max_size=3), min_size=1, max_size=2),
    steps=st.lists(st.integers(1, 4), min_size=24, max_size=24),
)
def test_stream_deltas_add_up_to_the_final_text(raw: str, stops: list[str], steps: list[int]) -> None:
    """Whatever the stop strings and however many characters each step adds (speculative steps add
    several), the streamed pieces concatenate to exactly the final text the engine reports, which is cut
    before the earliest stop string: nothing sent ever has to be taken back."""
    deltas, sent, pos, i = TextDeltas(stops), "", 0, 0
    while True:
        pos = min(len(raw), pos + steps[i % len(steps)])
        i += 1
        hits = [j for j in (raw[:pos].find(s) for s in stops) if j >= 0]
        if hits:  # the engine stops at the first completed stop string and cuts the text before it
            final = raw[: min(hits)]
            sent += deltas.next(0, final, True)
            break
        if pos == len(raw):
            final = raw
            sent += deltas.next(0, final, True)
            break
        sent += deltas.next(0, raw[:pos], False)
        assert _sent_is_clean_prefix(sent, raw, stops)
    assert sent == final


def _sent_is_clean_prefix(sent: str, raw: str, stops: list[str]) -> bool:
    """What was sent so far contains no stop string and is a prefix of the generated text."""
    return raw.startswith(sent) and not any(s in sent for s in stops)


def _params(req: CompletionRequest | ChatCompletionRequest, prompt_len: int = 4) -> SamplingParams:
    constraint = constraint_of(
        req, ToolCallFormat.of(req) if isinstance(req, ChatCompletionRequest) else None
    )
    return sampling_params(
        req,
        prompt_len=prompt_len,
        max_model_len=64,
        vocab_size=100,
        structured=constraint.params if constraint is not None else None,
    )


def test_request_fields_map_onto_the_engines_sampling_params() -> None:
    """The penalties, min_p, logit_bias (string keys), n and seed reach SamplingParams unchanged;
    completions logprobs k is the engine's logprobs, and with echo also its prompt_logprobs; chat
    logprobs=true with top_logprobs k is logprobs k; vLLM's prompt_logprobs passes through."""
    params = _params(
        _completion(
            presence_penalty=0.5,
            frequency_penalty=-0.25,
            repetition_penalty=1.3,
            min_p=0.05,
            logit_bias={"7": -100, "50": 2.5},
            n=3,
            seed=9,
            top_k=-1,
            temperature=0.7,
        )
    )
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.25, 1.3)
    assert (params.min_p, params.logit_bias, params.n, params.seed) == (0.05, {7: -100.0, 50: 2.5}, 3, 9)
    assert (params.logprobs, params.prompt_logprobs, params.max_tokens) == (None, None, 16)
    assert (_params(_completion(logprobs=3)).logprobs, _params(_completion(logprobs=3)).prompt_logprobs) == (
        3,
        None,
    )
    echo = _params(_completion(logprobs=2, echo=True, max_tokens=1))
    assert (echo.logprobs, echo.prompt_logprobs, echo.max_tokens) == (2, 2, 1)
    both = _params(_completion(logprobs=1, echo=True, prompt_logprobs=4))
    assert both.prompt_logprobs == 4
    chat = [{"role": "user", "content": "a"}]
    assert _params(_chat(chat, logprobs=True, top_logprobs=5)).logprobs == 5
    assert _params(_chat(chat, logprobs=True)).logprobs == 0
    assert _params(_chat(chat, logprobs=False)).logprobs is None
    assert _params(_chat(chat, prompt_logprobs=1)).prompt_logprobs == 1
    assert _params(_chat(chat)).max_tokens == 60  # chat without a limit: what fits


def test_max_tokens_zero_only_scores_a_prompt() -> None:
    """max_tokens 0 is lm-eval's "score the prompt, generate nothing": allowed with echo (the engine then
    computes prompt logprobs, 0 alternatives when none were asked) or prompt_logprobs, else a 400."""
    assert _params(_completion(echo=True, logprobs=1, max_tokens=0)).prompt_logprobs == 1
    assert _params(_completion(echo=True, max_tokens=0)).prompt_logprobs == 0
    assert _params(_completion(prompt_logprobs=2, max_tokens=0)).max_tokens == 0
    error = _refused(lambda: _params(_completion(max_tokens=0)))
    assert error.param == "max_tokens" and "echo=true" in error.message
    error = _refused(lambda: _params(_chat([{"role": "user", "content": "a"}], max_completion_tokens=0)))
    assert error.param == "max_completion_tokens"
    error = _refused(lambda: _params(_completion(logit_bias={"100": 1})))
    assert error.param == "logit_bias" and "outside the vocabulary [0, 100)" in error.message


def test_every_constraint_field_becomes_one_structured_outputs_params() -> None:
    """response_format json_object / json_schema, vLLM's guided_* and structured_outputs each give the
    StructuredOutputsParams the engine documents; text gives none; two at once, an unknown
    structured_outputs key or a malformed value is a 400 naming the client's field."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
            StructuredOutputsParams(json=schema),
        ),
        ({"guided_json": schema}, StructuredOutputsParams(json=schema)),
        ({"guided_json": json.dumps(schema)}, StructuredOutputsParams(json=schema)),
        ({"guided_regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
        ({"guided_grammar": 'start: "a"'}, StructuredOutputsParams(grammar='start: "a"')),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutputsParams(regex="a+")),
    ]
    for fields, expected in cases:
        assert _params(_completion(**fields)).structured_outputs == expected, fields
    assert _params(_completion(response_format={"type": "text"})).structured_outputs is None
    for fields, param, needle in [
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one way only"),
        ({"response_format": {"type": "json_object"}, "guided_json": schema}, "guided_json", "one way only"),
        (
            {"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
            "not supported",
        ),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema", "needs one"),
    ]:
        error = _refused(lambda f=fields: constraint_of(_completion(**f)))
        assert error.param == param and error.message.startswith(param) and needle in error.message, (
            error.message
        )


def test_engine_grammar_errors_are_renamed_to_the_clients_field() -> None:
    """The engine names its own field (structured_outputs.json: the grammar does not compile); the
    400 the client gets names the field it sent instead, with the engine's reason."""
    engine_error = OpenAIError("structured_outputs.json: the grammar does not compile: bad type")
    rf = {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}
    for fields, path in [
        ({"response_format": rf}, "response_format.json_schema.schema"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"structured_outputs": {"json": {}}}, "structured_outputs.json"),
    ]:
        constraint = constraint_of(_completion(**fields))
        assert constraint is not None
        renamed = constraint.rename(engine_error)
        assert (renamed.param, renamed.message) == (path, f"{path}: the grammar does not compile: bad type")
    whole = constraint_of(_completion(guided_regex="a")).rename(
        OpenAIError("structured_outputs: no tokenizer")
    )  # type: ignore[union-attr]
    assert (whole.param, whole.message) == ("guided_regex", "guided_regex: no tokenizer")
    other = OpenAIError("top_p=0: bad", param="top_p")
    assert constraint_of(_completion(guided_regex="a")).rename(other) is other  # type: ignore[union-attr]


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


def test_enforced_tool_calls_have_a_schema_and_parse_into_openai_tool_calls() -> None:
    """A named tool choice constrains the output to that function's arguments (a parameterless function
    to {}); "required" to a non-empty array of {name, parameters} calls, one at most with
    parallel_tool_calls false. Complete outputs parse into OpenAI tool_calls (arguments as a compact JSON
    string); an output cut short does not parse, so it is returned as text."""
    chat = [{"role": "user", "content": "a"}]
    named = ToolCallFormat.of(
        _chat(chat, tools=[ADD, NOW], tool_choice={"type": "function", "function": {"name": "add"}})
    )
    assert named is not None and named.schema == ADD["function"]["parameters"]
    assert (named.schema_path, named.finish_reason) == ("tools.0.function.parameters", "stop")
    (call,) = named.parse('{ "a": 1,\n "b": 2 }')  # type: ignore[misc]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert named.parse('{"a": 1, "b"') is None and named.parse("[1]") is None
    none = ToolCallFormat.of(
        _chat(chat, tools=[ADD, NOW], tool_choice={"type": "function", "function": {"name": "now"}})
    )
    assert none is not None
    jsonschema.validate({}, none.schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"x": 1}, none.schema)

    required = ToolCallFormat.of(_chat(chat, tools=[ADD, NOW], tool_choice="required"))
    assert (
        required is not None and required.finish_reason == "tool_calls" and "maxItems" not in required.schema
    )
    calls = [{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(calls, required.schema)
    for bad in ([], [{"name": "add", "parameters": {"a": 1}}], [{"name": "sub", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required.schema)
    parsed = required.parse(json.dumps(calls))
    assert [c["function"] for c in parsed] == [  # type: ignore[union-attr]
        {"name": "add", "arguments": '{"a": 1, "b": 2}'},
        {"name": "now", "arguments": "{}"},
    ]
    single = ToolCallFormat.of(_chat(chat, tools=[ADD], tool_choice="required", parallel_tool_calls=False))
    assert single is not None and single.schema["maxItems"] == 1
    assert ToolCallFormat.of(_chat(chat, tools=[ADD], tool_choice="none")) is None
    enforced = _chat(chat, tools=[ADD], tool_choice="required")
    enforced_format = ToolCallFormat.of(enforced)
    assert enforced_format is not None
    assert _params(enforced).structured_outputs == StructuredOutputsParams(json=enforced_format.schema)
    twice = _chat(chat, tools=[ADD], tool_choice="required", guided_regex="a")
    error = _refused(lambda: constraint_of(twice, ToolCallFormat.of(twice)))
    assert error.param == "tools"


def _position(*entries: tuple[int, float, int, str]) -> dict[int, Logprob]:
    return {token: Logprob(lp, rank, text) for token, lp, rank, text in entries}


def test_logprobs_take_the_openai_shapes() -> None:
    """Completions: tokens, token_logprobs, top_logprobs (every reported entry, chosen included) and
    text_offset adding up token lengths, continued across stream pieces, null for an unscored first
    prompt token; chat: exactly top_logprobs alternatives by rank with UTF-8 bytes; -inf is -9999.0
    everywhere; vLLM's prompt_logprobs keyed by token id."""
    chosen_low = _position((5, -3.5, 4, "ab"), (6, -0.1, 1, "c"), (7, -1.0, 2, "d"))  # not in the top 2
    chosen_top = _position((6, -0.1, 1, "c"), (7, -1.0, 2, "d"))
    excluded = _position((8, -math.inf, 9, "é"), (6, -0.2, 1, "c"))
    built = CompletionLogprobs()
    built.add_unscored("<s>")
    built.add(5, chosen_low)
    first = built.take()
    assert first == {
        "tokens": ["<s>", "ab"],
        "token_logprobs": [None, -3.5],
        "top_logprobs": [None, {"ab": -3.5, "c": -0.1, "d": -1.0}],
        "text_offset": [0, 3],
    }
    built.add(8, excluded)
    assert built.take() == {
        "tokens": ["é"],
        "token_logprobs": [-9999.0],
        "top_logprobs": [{"é": -9999.0, "c": -0.2}],
        "text_offset": [5],
    }
    chat = chat_logprobs([5, 6, 8], [chosen_low, chosen_top, excluded], 2)
    assert chat["refusal"] is None
    low, top, gone = chat["content"]
    assert (low["token"], low["logprob"], low["bytes"]) == ("ab", -3.5, [97, 98])
    assert [e["token"] for e in low["top_logprobs"]] == ["c", "d"]
    assert [e["token"] for e in top["top_logprobs"]] == ["c", "d"]
    assert (gone["logprob"], gone["bytes"]) == (-9999.0, [195, 169])
    assert [e["token"] for e in chat_logprobs([6], [chosen_top], 0)["content"][0]["top_logprobs"]] == []
    assert prompt_logprobs_json([None, excluded]) == [
        None,
        {
            "8": {"logprob": -9999.0, "rank": 9, "decoded_token": "é"},
            "6": {"logprob": -0.2, "rank": 1, "decoded_token": "c"},
        },
    ]


def test_fields_without_effect_are_named_for_the_ignored_fields_header() -> None:
    """Besides unknown fields, the header names recognised fields that change nothing for this request:
    bookkeeping fields, stream_options without stream, reasoning_effort, parallel_tool_calls unless a
    "required" tool call reads it, and tools kept out of the prompt by tool_choice "none"."""
    chat = [{"role": "user", "content": "a"}]
    assert _completion(max_tokens=2, n=2, logprobs=1).unused_fields() == []
    assert _completion(
        user="u", metadata={}, store=False, service_tier="auto", stream_options={"include_usage": True}
    ).unused_fields() == ["user", "metadata", "store", "service_tier", "stream_options"]
    assert _completion(stream=True, stream_options={"include_usage": True}).unused_fields() == []
    assert _chat(chat, reasoning_effort="low", parallel_tool_calls=True).unused_fields() == [
        "reasoning_effort",
        "parallel_tool_calls",
    ]
    assert _chat(chat, tools=[ADD], tool_choice="none").unused_fields() == ["tools"]
    assert _chat(chat, tools=[ADD], tool_choice="required", parallel_tool_calls=False).unused_fields() == []
    named = {"type": "function", "function": {"name": "add"}}
    assert _chat(chat, tools=[ADD], tool_choice=named, parallel_tool_calls=False).unused_fields() == [
        "parallel_tool_calls"
    ]


def test_the_engine_keeps_the_servers_engine_contract(tmp_path) -> None:
    """LLMEngine has every method and attribute of the typed contract the server drives it through
    (flyspec/server/engine_contract.py), so the server reaches nothing else of it."""
    from tiny_llm import save_tiny

    from flyspec.config import EngineConfig
    from flyspec.engine.engine import LLMEngine
    from flyspec.server.engine_contract import ServedEngine

    engine = LLMEngine(EngineConfig(model=str(save_tiny(tmp_path / "m", seed=0)), dtype="float32"))
    assert isinstance(engine, ServedEngine)  # the methods and properties
    for name in ServedEngine.__annotations__:  # the plain attributes
        assert hasattr(engine, name), name
