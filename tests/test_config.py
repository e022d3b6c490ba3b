"""SpeculativeConfig and EngineConfig (docs/verification.md): defaults, every rule's error message, the lossy
warning, one validation path and a canonical dict form."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flyspec.config import EngineConfig, SpeculativeConfig, verification_policy
from flyspec.spec_decode.policies import registered_policies
from flyspec.spec_decode.verify import FlyParams, TypicalParams


def test_defaults_and_method_inferred_from_model():
    """A dict with just model and K gives a standard draft-model config with the documented defaults."""
    cfg = SpeculativeConfig.from_dict({"model": "draft", "num_speculative_tokens": 4})
    assert cfg.method == "draft_model" and cfg.rejection_sample_method == "standard"
    assert cfg.draft_sample_method is None and cfg.lossless_prefix_tokens is None
    assert cfg.policy_settings == {}  # no policy field applies to standard
    assert not cfg.is_lossy and cfg.verification_policy(151_936) is None
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max, ngram.model) == (2, 5, None)


@pytest.mark.parametrize("k, window", [(2, 1), (4, 3), (7, 6), (10, 6)])
def test_fly_window_default_is_min_6_k_minus_1(k, window):
    """With FLy and no window given, W = min(6, K - 1)."""
    cfg = SpeculativeConfig(model="d", num_speculative_tokens=k, rejection_sample_method="fly")
    assert cfg.policy_settings["fly_window_size"] == window and cfg.is_lossy


def test_fly_policy_caps_top_k_at_vocab():
    """verification_policy gives FlyParams with W, theta and top_k, top_k capped at the vocabulary size."""
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
    policy = cfg.verification_policy(151_936)
    assert policy == FlyParams(window_size=2, entropy_threshold=1.0, entropy_top_k=50)
    assert cfg.verification_policy(10) == FlyParams(window_size=2, entropy_threshold=1.0, entropy_top_k=10)
    assert isinstance(cfg.policy_settings["fly_entropy_threshold"], float)
    assert cfg.lossless_prefix_tokens == 0 and EPS not in cfg.to_dict()


FLY = {"model": "d", "rejection_sample_method": "fly"}
TYPICAL = {"model": "d", "num_speculative_tokens": 1, "rejection_sample_method": "typical"}
EPS, DELTA = "typical_acceptance_sampler_posterior_threshold", "typical_acceptance_sampler_posterior_alpha"


def test_typical_defaults_are_vllms_and_work_with_k_1():
    """Typical acceptance takes vLLM's field names and defaults (0.09, 0.3), needs no K >= 2, is lossy,
    and its verifier object is TypicalParams; an int threshold is stored as a float."""
    cfg = SpeculativeConfig.from_dict(TYPICAL)
    assert cfg.policy_settings == {EPS: 0.09, DELTA: 0.3} and cfg.is_lossy
    assert cfg.verification_policy(100) == TypicalParams(posterior_threshold=0.09, posterior_alpha=0.3)
    assert "fly_window_size" not in cfg.to_dict() and cfg.lossless_prefix_tokens == 0
    cfg = SpeculativeConfig.from_dict({**TYPICAL, EPS: 1, DELTA: 1, "lossless_prefix_tokens": 16})
    eps, delta = cfg.policy_settings[EPS], cfg.policy_settings[DELTA]
    assert eps == 1.0 and isinstance(eps, float) and delta == 1.0
    assert cfg.lossless_prefix_tokens == 16


@pytest.mark.parametrize(
    "data, message",
    [
        ({**TYPICAL, EPS: 0}, f"^{EPS}=0 is invalid: it must be a finite number > 0$"),
        ({**TYPICAL, EPS: -0.1}, f"{EPS}=-0.1 is invalid"),
        ({**TYPICAL, EPS: float("nan")}, f"{EPS}=nan is invalid"),
        ({**TYPICAL, EPS: "0.09"}, f"{EPS}='0.09' is invalid"),
        ({**TYPICAL, DELTA: 0.0}, rf"^{DELTA}=0.0 is invalid: it must be a finite number in \(0, 1\]$"),
        ({**TYPICAL, DELTA: 1.01}, f"{DELTA}=1.01 is invalid"),
        ({**TYPICAL, DELTA: float("inf")}, f"{DELTA}=inf is invalid"),
        (
            {"model": "d", "num_speculative_tokens": 4, EPS: 0.09},
            f"^{EPS}=0.09 is invalid: Typical acceptance settings only apply with "
            "rejection_sample_method='typical' \\(they would do nothing\\)$",
        ),
        ({**FLY, "num_speculative_tokens": 4, DELTA: 0.3}, f"{DELTA}=0.3 is invalid: Typical acceptance"),
        ({**TYPICAL, "fly_window_size": 1}, "fly_window_size=1 is invalid: FLy settings only apply"),
        (
            {**TYPICAL, "lossless_prefix_tokens": -1},
            "lossless_prefix_tokens=-1 is invalid: it must be an integer >= 0",
        ),
        ({**TYPICAL, "lossless_prefix_tokens": 2.0}, "lossless_prefix_tokens=2.0 is invalid"),
        ({**FLY, "num_speculative_tokens": 4, "lossless_prefix_tokens": True}, "lossless_prefix_tokens=True"),
        (
            {"model": "d", "num_speculative_tokens": 4, "lossless_prefix_tokens": 0},
            "lossless_prefix_tokens=0 is invalid: a lossless prefix only applies with a lossy "
            "rejection_sample_method \\('fly', 'typical'\\)",
        ),
        (
            {**TYPICAL, "rejection_sample_method": "medusa"},
            "rejection_sample_method='medusa' is invalid: it must be one of 'standard', 'fly', 'typical'",
        ),
    ],
)
def test_typical_and_prefix_rules_raise_value_error_naming_field_value_and_rule(data, message):
    """Typical acceptance's fields and the lossless prefix follow SPEC 5: each broken rule, and each field
    set where it would do nothing (typical fields without "typical", a prefix without a lossy method,
    even at its default), raises ValueError naming the field, the value and the rule."""
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(data)


@pytest.mark.parametrize("k", range(2, 9))
def test_fly_fields_read_as_attributes_as_in_vllm(k):
    """Code written against vLLM reads the policy fields as attributes of SpeculativeConfig: FLy's window
    is min(6, K - 1) when unset, its other fields their defaults or the values given, typical acceptance's
    fields read None under FLy (unset, as vLLM's fields that do not apply) and the lossless prefix 0."""
    cfg = SpeculativeConfig(model="d", num_speculative_tokens=k, rejection_sample_method="fly")
    assert cfg.fly_window_size == min(6, k - 1)
    assert (cfg.fly_entropy_threshold, cfg.fly_entropy_top_k, cfg.lossless_prefix_tokens) == (0.3, 3, 0)
    assert getattr(cfg, EPS) is None and getattr(cfg, DELTA) is None
    given = {"fly_window_size": 1, "fly_entropy_threshold": 2, "fly_entropy_top_k": 7}
    cfg = SpeculativeConfig.from_dict({**FLY, "num_speculative_tokens": k, **given})
    assert (cfg.fly_window_size, cfg.fly_entropy_threshold, cfg.fly_entropy_top_k) == (1, 2.0, 7)


def test_typical_and_standard_fields_read_as_attributes():
    """Typical acceptance's fields read as attributes (its defaults, or the values given) and FLy's read
    None beside them; under standard verification every policy field and the lossless prefix read None;
    a name that is no field at all is still an AttributeError naming it."""
    cfg = SpeculativeConfig.from_dict({**TYPICAL, DELTA: 1, "lossless_prefix_tokens": 4})
    assert (getattr(cfg, EPS), getattr(cfg, DELTA), cfg.lossless_prefix_tokens) == (0.09, 1.0, 4)
    assert cfg.fly_window_size is None and cfg.fly_entropy_top_k is None
    std = SpeculativeConfig(model="d", num_speculative_tokens=3)
    fields = [f for p in registered_policies() for f in p.field_names()]
    assert fields and all(getattr(std, f) is None for f in fields) and std.lossless_prefix_tokens is None
    assert set(fields) <= set(dir(std))
    with pytest.raises(AttributeError, match="has no attribute 'fly_windw_size'"):
        _ = std.fly_windw_size


def test_a_built_config_is_read_only_so_no_rule_is_skipped():
    """Setting a field after construction would skip the rules checked together (W < K, a prefix only
    with a lossy policy) and change nothing in an engine already built: it raises, naming the field and
    the checked way to a variant, and the config is unchanged. Copies and pickles keep their values and
    stay read-only."""
    import copy
    import dataclasses
    import pickle

    cfg = SpeculativeConfig(model="d", num_speculative_tokens=4, rejection_sample_method="fly")
    changes = (("fly_window_size", 9), ("num_speculative_tokens", 1), ("lossless_prefix_tokens", -1))
    for name, value in changes:
        with pytest.raises(dataclasses.FrozenInstanceError, match=f"so {name} cannot be set: build a"):
            setattr(cfg, name, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        del cfg.model
    assert (cfg.fly_window_size, cfg.num_speculative_tokens, cfg.lossless_prefix_tokens) == (3, 4, 0)
    with pytest.raises(ValueError, match="fly_window_size=9 is invalid"):
        SpeculativeConfig.from_dict({**cfg.to_dict(), "fly_window_size": 9})
    for twin in (copy.copy(cfg), copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert twin == cfg and twin.fly_window_size == 3
        with pytest.raises(dataclasses.FrozenInstanceError):
            twin.fly_window_size = 2


def test_policy_fields_are_owned_once_and_apart_from_the_configs_own():
    """Registration is consistent: no field belongs to two policies or shadows one of SpeculativeConfig's
    own fields, and standard, the lossless policy, comes first."""
    import dataclasses

    own = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    owned = [f for p in registered_policies() for f in p.field_names()]
    assert not set(owned) & own and len(owned) == len(set(owned))
    assert registered_policies()[0].name == "standard" and not registered_policies()[0].lossy


def test_config_validation_imports_no_torch():
    """Validating a typical-acceptance config with a lossless prefix, and FLy's, loads no torch (the
    policies' rules are read by flyspec.config, which the command line imports to validate cheaply)."""
    code = (
        "import sys\n"
        "from flyspec.config import SpeculativeConfig\n"
        "SpeculativeConfig(model='d', num_speculative_tokens=4, rejection_sample_method='typical',"
        " lossless_prefix_tokens=8)\n"
        "SpeculativeConfig(model='d', num_speculative_tokens=4, rejection_sample_method='fly')\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


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


def test_lossy_warning_text_is_exactly_spec():
    """FLy's warning is the documented sentence verbatim (the engine logs it once, at warning level:
    tests/test_server_cli.py reads it in a real server's log)."""
    assert verification_policy("fly").lossy_warning() == (
        "FLy verification is lossy: outputs do not follow the target model's distribution and may be of "
        "lower quality."
    )


def test_typical_warning_is_the_same_sentence_with_its_own_name():
    """Typical acceptance's warning is the FLy sentence with its own name (SPEC 5)."""
    assert verification_policy("typical").lossy_warning() == (
        "Typical acceptance verification is lossy: outputs do not follow the target model's distribution "
        "and may be of lower quality."
    )


def test_from_dict_treats_null_as_unset_and_round_trips():
    """JSON null means "unset" (so a FLy key set to null is no error with standard), and to_dict output
    rebuilds the same config through the constructor."""
    cfg = SpeculativeConfig.from_dict(
        {"model": "d", "num_speculative_tokens": 3, "fly_window_size": None, "prompt_lookup_min": None}
    )
    assert cfg.prompt_lookup_min == 2 and cfg.policy_settings == {}
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
        {**TYPICAL, EPS: 0.2},
        {**TYPICAL, "method": "ngram", "model": None, "lossless_prefix_tokens": 8},
        {**FLY, "num_speculative_tokens": 3, "lossless_prefix_tokens": 32},
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
    assert ("fly_window_size" in canonical) == (cfg.rejection_sample_method == "fly")
    assert (EPS in canonical) == (cfg.rejection_sample_method == "typical")
    assert ("lossless_prefix_tokens" in canonical) == bool(cfg.lossless_prefix_tokens)
    assert ("prompt_lookup_min" in canonical) == (cfg.method == "ngram")


def test_canonical_form_of_configs_before_policies_is_unchanged():
    """The canonical dicts of standard and FLy configs, which the gate stores as arm identities, are
    exactly what they were before typical acceptance and the lossless prefix existed (a prefix of 0 is
    left out), so stored runs stay resumable."""
    fly = SpeculativeConfig.from_dict({**FLY, "num_speculative_tokens": 4})
    assert fly.to_dict() == {
        "method": "draft_model",
        "model": "d",
        "num_speculative_tokens": 4,
        "rejection_sample_method": "fly",
        "fly_window_size": 3,
        "fly_entropy_threshold": 0.3,
        "fly_entropy_top_k": 3,
        "draft_sample_method": None,
    }
    assert list(fly.to_dict()) == list(
        SpeculativeConfig.from_dict(
            {**FLY, "num_speculative_tokens": 4, "lossless_prefix_tokens": 0}
        ).to_dict()
    )
    standard = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert standard.to_dict() == {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "rejection_sample_method": "standard",
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    }


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
