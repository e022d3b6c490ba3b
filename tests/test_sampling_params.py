"""SamplingParams: defaults, normalisation and the errors that name the bad field."""

from __future__ import annotations

import pytest

from flyspec import SamplingParams


def test_defaults_match_the_public_contract() -> None:
    """The documented defaults (vLLM's) hold, and temperature 0 means greedy."""
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 0, 16)
    assert (p.seed, p.stop, p.stop_token_ids, p.ignore_eos, p.verification) == (None, [], [], False, None)
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_normalises_stop_and_top_k_spellings() -> None:
    """A single stop string becomes a list; vLLM's top_k=-1 ("off") becomes 0."""
    p = SamplingParams(stop="\n\n", top_k=-1, stop_token_ids=(3, 4))
    assert p.stop == ["\n\n"]
    assert p.top_k == 0
    assert p.stop_token_ids == [3, 4]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"verification": "lossy"}, "verification"),
    ],
)
def test_rejects_bad_values_naming_the_field(kwargs: dict, field: str) -> None:
    """Each bad value raises ValueError whose message names the field and the value."""
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": 1e300}, "temperature"),  # inf in float32
        ({"temperature": 1e-40}, "temperature"),  # logits / temperature overflows: NaN probabilities
        ({"temperature": 100.5}, "temperature"),
        ({"top_k": 2**64}, "top_k"),  # overflows int64
        ({"top_k": 2**31}, "top_k"),
        ({"top_p": 1e-12}, "top_p"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 1e-30}, "repetition_penalty"),
        ({"repetition_penalty": 1000}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"prompt_logprobs": 30}, "prompt_logprobs"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"structured_outputs": "json"}, "structured_outputs"),
    ],
)
def test_rejects_values_the_engine_cannot_compute_safely(kwargs: dict, field: str) -> None:
    """Every value is bounded into a range the engine computes safely in float32 (docs/sampling.md):
    ValueError naming the field and the value."""
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


def test_bounds_themselves_are_accepted() -> None:
    """The documented bounds are inclusive."""
    SamplingParams(temperature=0.01, top_k=2**31 - 1, seed=2**63 - 1, top_p=1e-9, n=128, logprobs=20)
    SamplingParams(temperature=100, seed=-(2**63), repetition_penalty=0.01, presence_penalty=-2)
    SamplingParams(repetition_penalty=100, frequency_penalty=2, min_p=1, prompt_logprobs=0)


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({5: 101}, r"logit_bias=101: the bias of token 5 must be a number in \[-100, 100\]"),
        ({5: float("inf")}, "logit_bias=inf"),
        ({-1: 1.0}, "logit_bias: key -1 is not a token id"),
        ({"x": 1.0}, "logit_bias: key 'x' is not a token id"),
        ([1, 2], "logit_bias=.*must be a mapping"),
    ],
)
def test_logit_bias_is_checked_entry_by_entry(bias, message) -> None:
    """Keys are token ids (JSON's string keys such as "50256" are read as ids), values in [-100, 100]."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)
    assert SamplingParams(logit_bias={"7": 1, 3: -2.5}).logit_bias == {7: 1.0, 3: -2.5}
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_stop_lists_are_bounded() -> None:
    """At most 64 stop strings of at most 1024 characters, and 1024 stop token ids; the message does not
    echo a huge value back."""
    with pytest.raises(ValueError, match="stop=<65 strings>: at most 64 stop strings"):
        SamplingParams(stop=["x"] * 65)
    with pytest.raises(ValueError, match="stop=<a string that long>"):
        SamplingParams(stop="x" * 1025)
    with pytest.raises(ValueError, match="stop_token_ids=<1025 ids>"):
        SamplingParams(stop_token_ids=list(range(1025)))


def test_max_tokens_zero_only_scores_a_prompt() -> None:
    """max_tokens=0 (generate nothing) is allowed only with prompt_logprobs."""
    assert SamplingParams(max_tokens=0, prompt_logprobs=1).max_tokens == 0
    with pytest.raises(ValueError, match="only together with prompt_logprobs"):
        SamplingParams(max_tokens=0, logprobs=1)


def test_feature_flags_mark_requests_that_need_logits_processing() -> None:
    """The defaults need no processing beyond temperature / top-k / top-p (the engine's fast path)."""
    assert not SamplingParams().shapes_logits and not SamplingParams(min_p=0.1, logprobs=5).shapes_logits
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(logit_bias={1: 1}).shapes_logits
    assert not SamplingParams(presence_penalty=0, frequency_penalty=0, repetition_penalty=1).has_penalties
