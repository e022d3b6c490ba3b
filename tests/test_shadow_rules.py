"""The shadow's rules without servers: the sampling draw, eligibility, the spend caps over a sliding minute,
redaction, reading streamed answers, and the settings' errors (each names its option and rule)."""

from __future__ import annotations

import json
import math

import pytest

from flyspec.gate.shadow.mirror import (
    Booking,
    PairBudget,
    SamplingRule,
    ShadowSettings,
    SpendCaps,
    endpoint_arm,
    ineligible,
)
from flyspec.gate.shadow.pairs import Redactor, from_stream

ARM = {"base_urls": ["http://127.0.0.1:9/v1"], "model": "m"}


def test_the_draw_is_deterministic_and_takes_the_share() -> None:
    """Each body is drawn or not, the same way every time and for the same seed; over 4000 distinct bodies
    the drawn share is within 4 standard deviations of S; another seed draws other bodies."""
    rule = SamplingRule(0.25, seed=11)
    bodies = [json.dumps({"prompt": f"q{i}"}).encode() for i in range(4000)]
    drawn = [rule.draws(b) for b in bodies]
    assert drawn == [SamplingRule(0.25, seed=11).draws(b) for b in bodies]
    assert abs(sum(drawn) - 1000) <= 4 * math.sqrt(4000 * 0.25 * 0.75)
    assert drawn != [SamplingRule(0.25, seed=12).draws(b) for b in bodies]
    assert all(SamplingRule(1.0).draws(b) for b in bodies[:10])
    assert SamplingRule(0.25, seed=11).describe()["share"] == 0.25


def test_eligibility() -> None:
    assert ineligible("/chat/completions", {"messages": [], "n": 1}) is None
    assert ineligible("/chat/completions", {"messages": [], "n": 3}) == "n_gt_1"
    assert ineligible("/completions", {"prompt": "a", "best_of": 2}) == "n_gt_1"
    assert ineligible("/chat/completions", {"messages": [], "tool_choice": "auto"}) == "tools"
    assert ineligible("/completions", {"prompt": ["a", "b"]}) == "several_prompts"
    assert ineligible("/completions", {"prompt": [1, 2, 3]}) is None  # one prompt of token ids
    budget = PairBudget(2)
    budget.take()
    assert not budget.exhausted
    budget.take()
    assert budget.exhausted


def test_spend_caps_slide_over_a_minute() -> None:
    now = [0.0]
    caps = SpendCaps(requests_per_minute=3, tokens_per_minute=100, clock=lambda: now[0])
    booking = caps.admit(60)
    assert isinstance(booking, Booking)
    assert caps.admit(60) == "over_token_cap"
    caps.settle(booking, 30)  # the candidate used fewer tokens than estimated
    assert isinstance(caps.admit(60), Booking)
    assert isinstance(caps.admit(5), Booking)
    assert caps.admit(1) == "over_request_cap"
    now[0] = 60.5
    assert isinstance(caps.admit(100), Booking)


def test_redaction_masks_every_string_but_keys() -> None:
    redactor = Redactor([r"\d{3}-\d{4}", "secret"])
    body = {"messages": [{"role": "user", "content": "call 555-1234, secret"}], "secret": 5}
    assert redactor.value(body) == {
        "messages": [{"role": "user", "content": "call [REDACTED], [REDACTED]"}],
        "secret": 5,
    }
    with pytest.raises(ValueError, match="--redact '\\(': not a valid regular expression"):
        Redactor(["("])
    with pytest.raises(ValueError, match="matches the empty string"):
        Redactor(["x*"])


def test_a_streamed_answer_is_assembled_and_a_broken_one_is_an_error() -> None:
    events = [
        {"choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
        {"choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}},
    ]
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"
    answer = from_stream("/chat/completions", 200, body, 0.5, 0.1)
    assert (answer.text, answer.finish_reason, answer.prompt_tokens, answer.completion_tokens) == (
        "Hello",
        "stop",
        4,
        2,
    )
    assert answer.acceptance is None and answer.streamed
    broken = from_stream("/chat/completions", 200, b"data: {not json\n\n", 0.5, None)
    assert not broken.ok and "not JSON" in broken.error
    failed = body + f"data: {json.dumps({'error': {'message': 'engine died'}})}\n\n".encode()
    assert "engine died" in from_stream("/chat/completions", 200, failed, 0.5, None).error


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"sample": 0}, "--sample=0: the mirrored share must be in"),
        ({"sample": 1.5}, "--sample=1.5"),
        ({"max_pairs": 0}, "--max-pairs=0: must be a positive integer"),
        ({"candidate_concurrency": 0}, "--candidate-concurrency=0"),
        ({"max_candidate_tokens_per_minute": -1}, "--max-candidate-tokens-per-minute=-1"),
        ({"max_candidate_requests_per_minute": 0}, "--max-candidate-requests-per-minute=0"),
        ({"redact": ("[",)}, "--redact '\\['"),
    ],
)
def test_bad_settings_name_their_option(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ShadowSettings(
            baseline=endpoint_arm("baseline", ARM), candidate=endpoint_arm("candidate", ARM), **settings
        )


def test_an_engine_arm_is_refused() -> None:
    with pytest.raises(
        ValueError, match="--candidate: gate shadow forwards traffic to OpenAI-compatible endpoints"
    ):
        endpoint_arm("candidate", {"kind": "engine", "model": "x"})
