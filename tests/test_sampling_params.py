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
