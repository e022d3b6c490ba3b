"""Server request parsing and stream bookkeeping, without a model: lax numbers as vLLM reads them, unknown
fields set aside, no-op values of unsupported fields accepted, every sampling value bounded, agent
histories turned into chat-template messages, and stop-string hold-back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flyspec.outputs import CompletionOutput, RequestMetrics, RequestOutput
from flyspec.server.errors import OpenAIError
from flyspec.server.protocol import (
    _NO_OP_VALUES,
    MAX_PROMPTS_PER_REQUEST,
    ChatCompletionRequest,
    CompletionRequest,
    ignored_fields,
    parse_body,
)
from flyspec.server.responses import stop_reason
from flyspec.server.streaming import TextDeltas


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
    """Every recognised-but-unimplemented field accepts its no-op values (clients such as `vllm bench
    serve` send them on every request) and refuses anything else with a 400 naming the field and saying
    it is not supported yet."""
    for value in _NO_OP_VALUES[name]:
        _completion(**{name: value})
        _chat([{"role": "user", "content": "a"}], **{name: value})
    different = {
        "n": 2,
        "logit_bias": {"5": 1.0},
        "bad_words": ["x"],
        "guided_json": {"type": "object"},
        "guided_regex": "a+",
        "guided_choice": ["a"],
        "guided_grammar": "root ::= 'a'",
        "structured_outputs": {"json": {}},
        "allowed_token_ids": [1],
        "prompt_logprobs": 1,
        "truncate_prompt_tokens": 5,
    }.get(name)
    if different is None:
        first = next(v for v in _NO_OP_VALUES[name] if v is not None)
        different = (not first) if isinstance(first, bool) else first + 1
    error = _refused(_completion, **{name: different})
    assert error.param == name and "not supported yet" in error.message


def test_fields_needing_the_engine_are_refused_by_name_defaults_pass() -> None:
    """logprobs, echo, response_format json, best_of > 1 and continuous usage are 400s naming the field;
    their defaults (and OpenAI's bookkeeping fields user, metadata, store, service_tier) pass."""
    for fields, param in [
        ({"logprobs": 2}, "logprobs"),
        ({"logprobs": 0}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
    ]:
        assert _refused(_completion, **fields).param == param
    _completion(
        logprobs=None,
        echo=False,
        best_of=1,
        response_format={"type": "text"},
        stream_options={"include_usage": True},
        user="u",
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
    )
    chat = [{"role": "user", "content": "a"}]
    for fields, param in [
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"chat_template": "{{ x }}"}, "chat_template"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
        ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ]:
        assert _refused(_chat, messages=chat, **fields).param == param
    _chat(chat, logprobs=False, top_logprobs=0, reasoning_effort="low", parallel_tool_calls=True)


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


def test_tools_need_tool_choice_none_for_now() -> None:
    """tools with tool_choice absent, auto, required or named are a 400 naming tools (no tool-call
    parsing yet); tool_choice none, empty tools, or tool_choice auto without tools pass; legacy functions
    follow the same rule."""
    chat = [{"role": "user", "content": "a"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for choice in (None, "auto", "required", {"type": "function", "function": {"name": "f"}}):
        fields: dict[str, Any] = (
            {"tools": tools} if choice is None else {"tools": tools, "tool_choice": choice}
        )
        error = _refused(_chat, messages=chat, **fields)
        assert error.param == "tools" and 'tool_choice="none"' in error.message
    _chat(chat, tools=tools, tool_choice="none", parallel_tool_calls=False)
    _chat(chat, tools=[], tool_choice="auto")
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


def _output(text: str, finished: bool) -> RequestOutput:
    return RequestOutput(
        "r",
        None,
        [1],
        [CompletionOutput(0, text, [], "stop" if finished else None)],
        finished,
        RequestMetrics(),
    )


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
            sent += deltas.next(0, _output(final, True))
            break
        if pos == len(raw):
            final = raw
            sent += deltas.next(0, _output(final, True))
            break
        sent += deltas.next(0, _output(raw[:pos], False))
        assert _sent_is_clean_prefix(sent, raw, stops)
    assert sent == final


def _sent_is_clean_prefix(sent: str, raw: str, stops: list[str]) -> bool:
    """What was sent so far contains no stop string and is a prefix of the generated text."""
    return raw.startswith(sent) and not any(s in sent for s in stops)
