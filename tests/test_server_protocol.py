"""Server request parsing and stream bookkeeping, without a model: strict bodies and stop-string hold-back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flyspec.outputs import CompletionOutput, RequestMetrics, RequestOutput
from flyspec.server.protocol import ChatCompletionRequest, CompletionRequest, OpenAIError, parse_body
from flyspec.server.streaming import TextDeltas


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        (b'{"prompt": "x", "max_tokens": 1.5}', "max_tokens", "integer"),
        (b'{"prompt": "x", "temperature": "1"}', "temperature", "number"),
        (b'{"prompt": "x", "seed": true}', "seed", "integer"),
        (b'{"prompt": [1, "a"]}', "prompt", "token-id"),
        (b'{"prompt": "x", "stop": 3}', "stop", "list of strings"),
        (
            b'{"prompt": "x", "stream_options": {"include_usage": 1}}',
            "stream_options.include_usage",
            "boolean",
        ),
        (b'{"prompt": "x", "echo": true, "best": 2}', "best", "unknown"),
        (b'{"prompt": "x"', None, "not valid JSON"),
        (b'"x"', None, "JSON object"),
    ],
)
def test_completion_body_errors_name_the_field(body: bytes, param: str | None, needle: str) -> None:
    """No coercion (a string is not a number, true is not a seed), unknown fields are refused, and the
    error names the field path in `param` and says what was expected."""
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


def test_unsupported_values_are_refused_not_ignored() -> None:
    """Fields the API defines but the engine does not implement fail when set to anything but the default."""
    for body, param in [
        (b'{"prompt": "x", "logprobs": 2}', "logprobs"),
        (b'{"prompt": "x", "echo": true}', "echo"),
        (b'{"prompt": "x", "presence_penalty": 0.5}', "presence_penalty"),
        (b'{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options"),
    ]:
        with pytest.raises(OpenAIError) as info:
            parse_body(CompletionRequest, body).check()
        assert info.value.param == param
    parse_body(CompletionRequest, b'{"prompt": "x", "presence_penalty": 0, "n": 1, "user": "u"}').check()


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
