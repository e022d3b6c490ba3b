"""SpeculativeConfig and EngineConfig (docs/verification.md): defaults, every rule's error message, the lossy
warning, one validation path and a canonical dict form."""

from __future__ import annotations

import logging

import pytest

from flyspec.config import LOSSY_WARNING, EngineConfig, SpeculativeConfig, log_lossy_warning
from flyspec.spec_decode.verify import FlyParams


def test_defaults_and_method_inferred_from_model():
    """A dict with just model and K gives a standard draft-model config with the documented defaults."""
    cfg = SpeculativeConfig.from_dict({"model": "draft", "num_speculative_tokens": 4})
    assert cfg.method == "draft_model" and cfg.rejection_sample_method == "standard"
    assert cfg.fly_window_size is None and cfg.draft_sample_method is None
    assert (cfg.fly_entropy_threshold, cfg.fly_entropy_top_k) == (0.3, 3)
    assert not cfg.is_lossy and cfg.fly_params(151_936) is None
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max, ngram.model) == (2, 5, None)


@pytest.mark.parametrize("k, window", [(2, 1), (4, 3), (7, 6), (10, 6)])
def test_fly_window_default_is_min_6_k_minus_1(k, window):
    """With FLy and no window given, W = min(6, K - 1)."""
    cfg = SpeculativeConfig(model="d", num_speculative_tokens=k, rejection_sample_method="fly")
    assert cfg.fly_window_size == window and cfg.is_lossy


def test_fly_params_caps_top_k_at_vocab():
    """fly_params carries W, theta and top_k, capping top_k at the target vocabulary size."""
    cfg = SpeculativeConfig.from_dict(
        {
            "method": "ngram",
            "num_speculative_tokens": 5,
            "rejection_sample_method": "fly",
            "fly_window_size": 2,
            "fly_entropy_threshold": 1,
            "fly_entropy_top_k": 50,
        }
    )
    assert cfg.fly_params(151_936) == FlyParams(window_size=2, entropy_threshold=1.0, entropy_top_k=50)
    assert cfg.fly_params(10) == FlyParams(window_size=2, entropy_threshold=1.0, entropy_top_k=10)
    assert isinstance(cfg.fly_entropy_threshold, float)


FLY = {"model": "d", "rejection_sample_method": "fly"}


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"method": "eagle", "model": "d", "num_speculative_tokens": 4},
            "method='eagle' is invalid: it must be one of",
        ),
        (
            {"method": "draft_model", "num_speculative_tokens": 4},
            "model=None is invalid: method='draft_model' needs",
        ),
        ({"num_speculative_tokens": 4}, "method=None is invalid: it must be one of 'draft_model', 'ngram'"),
        (
            {"method": "ngram", "model": "d", "num_speculative_tokens": 4},
            "model='d' is invalid: method='ngram'",
        ),
        (
            {"model": "d", "num_speculative_tokens": 0},
            "num_speculative_tokens=0 is invalid: it must be an integer >= 1",
        ),
        ({"model": "d", "num_speculative_tokens": 2.0}, "num_speculative_tokens=2.0 is invalid"),
        ({"model": "d", "num_speculative_tokens": True}, "num_speculative_tokens=True is invalid"),
        (
            {**FLY, "num_speculative_tokens": 1},
            "num_speculative_tokens=1 is invalid: .*needs num_speculative_tokens >= 2",
        ),
        (
            {**FLY, "num_speculative_tokens": 4, "fly_window_size": 5},
            r"^fly_window_size=5 is invalid: it must satisfy "
            r"1 <= fly_window_size < num_speculative_tokens \(4\)$",
        ),
        (
            {**FLY, "num_speculative_tokens": 4, "fly_window_size": 4},
            r"fly_window_size=4 is invalid: it must satisfy",
        ),
        (
            {**FLY, "num_speculative_tokens": 4, "fly_window_size": 0},
            r"fly_window_size=0 is invalid: it must satisfy",
        ),
        (
            {**FLY, "num_speculative_tokens": 4, "fly_entropy_threshold": -0.1},
            "fly_entropy_threshold=-0.1 is invalid: it must be a finite number >= 0",
        ),
        (
            {**FLY, "num_speculative_tokens": 4, "fly_entropy_threshold": float("inf")},
            "fly_entropy_threshold=inf",
        ),
        ({**FLY, "num_speculative_tokens": 4, "fly_entropy_threshold": "0.3"}, "fly_entropy_threshold='0.3'"),
        (
            {**FLY, "num_speculative_tokens": 4, "fly_entropy_top_k": 0},
            "fly_entropy_top_k=0 is invalid: it must be",
        ),
        (
            {"model": "d", "num_speculative_tokens": 4, "rejection_sample_method": "lossy"},
            "rejection_sample_method='lossy'",
        ),
        (
            {"model": "d", "num_speculative_tokens": 4, "draft_sample_method": "top_p"},
            "draft_sample_method='top_p'",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "draft_sample_method": "greedy"},
            "draft_sample_method='greedy' is invalid: method='ngram' has no draft distribution",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
            r"prompt_lookup_max=3 is invalid: it must be >= prompt_lookup_min \(4\)",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 0},
            "prompt_lookup_min=0 is invalid",
        ),
        (
            {"model": "d", "num_speculative_tokens": 4, "prompt_lookup_max": 5},
            "prompt_lookup_max=5 is invalid: they only apply",
        ),
        (
            {"model": "d", "num_speculative_tokens": 4, "fly_entropy_threshold": 0.3},
            "fly_entropy_threshold=0.3 is invalid: FLy settings only apply with "
            "rejection_sample_method='fly'",
        ),
        (
            {"model": "d", "num_speculative_tokens": 4, "fly_window_size": 2},
            "fly_window_size=2 is invalid: FLy settings",
        ),
        (
            {"model": "d", "num_speculative_tokens": 4, "top_k": 2, "window": 1},
            "unknown key.*'top_k', 'window'",
        ),
        ({"model": "d"}, "needs num_speculative_tokens"),
    ],
)
def test_each_rule_raises_value_error_naming_field_value_and_rule(data, message):
    """Every documented config rule, broken on its own, raises a ValueError naming field, value and rule;
    unknown keys and settings that would silently do nothing (FLy keys with standard, even at their
    default) are errors."""
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(data)


def test_constructor_rejects_non_default_fly_fields_with_standard():
    """Built directly (not from a dict), a FLy field changed from its default with standard verification
    is still an error."""
    with pytest.raises(ValueError, match="fly_entropy_top_k=5 is invalid: FLy settings only apply"):
        SpeculativeConfig(model="d", num_speculative_tokens=4, fly_entropy_top_k=5)


def test_from_dict_rejects_non_dict():
    """A JSON array or string instead of an object is a clear error."""
    with pytest.raises(ValueError, match="speculative_config must be a dict"):
        SpeculativeConfig.from_dict([("model", "d")])  # type: ignore[arg-type]


def test_engine_config_converts_dict_and_validates_fields():
    """EngineConfig turns a dict into a SpeculativeConfig and keeps the documented defaults."""
    cfg = EngineConfig(model="m", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert isinstance(cfg.speculative_config, SpeculativeConfig)
    assert (
        cfg.dtype,
        cfg.device,
        cfg.max_num_seqs,
        cfg.max_num_batched_tokens,
        cfg.max_model_len,
        cfg.seed,
    ) == (
        "auto",
        "cpu",
        16,
        2048,
        None,
        0,
    )
    assert not cfg.is_lossy and cfg.num_speculative_tokens == 4
    assert EngineConfig(model="m", device="cuda:1", dtype="bfloat16").num_speculative_tokens == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"model": ""}, "model='' is invalid"),
        ({"model": "m", "dtype": "fp8"}, "dtype='fp8' is invalid: it must be one of 'auto', 'float32'"),
        ({"model": "m", "device": "gpu"}, "device='gpu' is invalid: it must be 'cpu', 'cuda' or 'cuda:N'"),
        ({"model": "m", "max_num_seqs": 0}, "max_num_seqs=0 is invalid: it must be an integer >= 1"),
        ({"model": "m", "max_model_len": -1}, "max_model_len=-1 is invalid"),
        ({"model": "m", "seed": -1}, "seed=-1 is invalid"),
        ({"model": "m", "speculative_config": "ngram"}, "speculative_config='ngram' is invalid"),
        (
            {
                "model": "m",
                "speculative_config": {"model": "d", "num_speculative_tokens": 7},
                "max_num_batched_tokens": 7,
            },
            r"max_num_batched_tokens=7 is invalid: .*raise max_num_batched_tokens to at least 1 \+ K = 8",
        ),
    ],
)
def test_engine_config_rejects_bad_fields(kwargs, message):
    """Bad engine fields, including a token budget below one decode step (1 + K), are ValueErrors naming
    field, value and rule."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_lossy_warning_text_is_exactly_spec(caplog):
    """log_lossy_warning logs the documented sentence verbatim, once, at warning level."""
    logger = logging.getLogger("flyspec.test")
    with caplog.at_level(logging.WARNING, logger="flyspec.test"):
        log_lossy_warning(logger)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.WARNING,
            "FLy verification is lossy: outputs do not follow the target model's distribution and may be of "
            "lower quality.",
        )
    ]
    assert caplog.records[0].getMessage() == LOSSY_WARNING


def test_from_dict_treats_null_as_unset_and_round_trips():
    """JSON null means "unset" (so a FLy key set to null is no error with standard), and to_dict output
    rebuilds the same config through the constructor."""
    cfg = SpeculativeConfig.from_dict(
        {"model": "d", "num_speculative_tokens": 3, "fly_window_size": None, "prompt_lookup_min": None}
    )
    assert cfg.prompt_lookup_min == 2 and cfg.fly_window_size is None
    fly = SpeculativeConfig.from_dict({**FLY, "num_speculative_tokens": 5})
    for c in (cfg, fly):
        assert SpeculativeConfig(**c.to_dict()) == c


@pytest.mark.parametrize(
    "data",
    [
        {"model": "d", "num_speculative_tokens": 4},
        {"model": "d", "num_speculative_tokens": 4, "draft_sample_method": "greedy"},
        {**FLY, "num_speculative_tokens": 5, "fly_window_size": 2, "fly_entropy_threshold": 0.5},
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
        {"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "fly"},
    ],
)
def test_to_dict_round_trips_through_from_dict(data):
    """to_dict() is the canonical form: it lists the settings that apply with their defaults resolved,
    and from_dict() of it rebuilds the same config (no resolved default reads as a stray setting)."""
    cfg = SpeculativeConfig.from_dict(data)
    canonical = cfg.to_dict()
    assert SpeculativeConfig.from_dict(canonical) == cfg
    assert SpeculativeConfig.from_dict(canonical).to_dict() == canonical
    assert all(value is not None for key, value in canonical.items() if key != "draft_sample_method")
    assert ("fly_window_size" in canonical) == cfg.is_lossy
    assert ("prompt_lookup_min" in canonical) == (cfg.method == "ngram")


def test_constructor_and_from_dict_apply_the_same_rules():
    """One validation path: a setting that would do nothing is refused by the constructor exactly as by
    from_dict, even at its default value, and EngineConfig holds a SpeculativeConfig however it was given."""
    for build in (
        lambda: SpeculativeConfig(model="d", num_speculative_tokens=4, fly_entropy_threshold=0.3),
        lambda: SpeculativeConfig.from_dict(
            {"model": "d", "num_speculative_tokens": 4, "fly_entropy_threshold": 0.3}
        ),
    ):
        with pytest.raises(ValueError, match="fly_entropy_threshold=0.3 is invalid: FLy settings only apply"):
            build()
    given = SpeculativeConfig(model="d", num_speculative_tokens=4)
    assert EngineConfig(model="m", speculative_config=given).speculative_config is given
    assert EngineConfig(model="m", speculative_config=given.to_dict()).speculative_config == given
