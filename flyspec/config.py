"""Engine and speculative-decoding configuration: defaults and validation.

Every broken rule raises ValueError with a message that names the field, the value and the rule, e.g.
`fly_window_size=5 is invalid: it must satisfy 1 <= fly_window_size < num_speculative_tokens (4)`.
The verification policy named by `rejection_sample_method` owns its fields, their defaults and rules
(flyspec/spec_decode/policies/); this module asks the registry, which is also how the gate, the server and
the benchmarks (which may not import the verifier's package) learn the policies' names and fields. It
imports no torch, so the command line can validate configs cheaply.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from flyspec.checks import is_int
from flyspec.spec_decode.policies import (
    VerificationPolicy,
    lossy_policy_names,
    plugin_failures,
    policy_named,
    policy_names,
    policy_owning,
    registered_policies,
)
from flyspec.spec_decode.policies.base import invalid as _invalid

__all__ = [
    "DEFAULT_PROMPT_LOOKUP_MAX",
    "DEFAULT_PROMPT_LOOKUP_MIN",
    "LOSSLESS_PREFIX_FIELD",
    "QUANTIZATION_CHOICES",
    "QUANTIZATION_METHODS",
    "EngineConfig",
    "SpeculativeConfig",
    "VerificationPolicy",
    "lossy_policy_names",
    "policy_names",
    "policy_owning",
    "verification_fields",
    "verification_policy",
]

DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 5
LOSSLESS_PREFIX_FIELD = "lossless_prefix_tokens"
"""The lossless prefix (docs/verification.md): a field of every lossy policy."""

_METHODS = ("draft_model", "ngram")
_DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
_NGRAM_FIELDS = ("prompt_lookup_min", "prompt_lookup_max")
_DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION_METHODS = ("int8", "int4")
"""Weight quantization at load time (flyspec/models/quantization.py); None = the weights as loaded."""
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, "auto")
"""What `quantization` accepts: a format, or "auto" (the fastest format on this CPU, measured at load by
flyspec/models/kernel_check.py; the weights as loaded where none beats bfloat16 or off the CPU)."""
_DRAFT_QUANTIZATION = (*QUANTIZATION_CHOICES, "none")
_DEVICE_RE = re.compile(r"cpu|cuda|cuda:\d+")


def _require_int(field: str, value: Any, minimum: int) -> None:
    if not is_int(value, minimum):
        raise _invalid(field, value, f"it must be an integer >= {minimum}")


def _require_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise _invalid(field, value, "it must be one of " + ", ".join(repr(c) for c in choices))


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _reject_set(config: Any, fields: tuple[str, ...], rule: str) -> None:
    """A setting that would do nothing is an error, whatever its value (None = not set)."""
    for name in fields:
        value = getattr(config, name)
        if value is not None:
            raise _invalid(name, value, rule)


def verification_policy(name: str) -> type[VerificationPolicy]:
    """The verification policy of a `rejection_sample_method` name (ValueError for an unknown one): what
    the gate, the server and the benchmarks ask whether a method is lossy, how to label a setting, ..."""
    return policy_named(name)


def verification_fields() -> tuple[str, ...]:
    """Every field that chooses or tunes verification: what two configs may differ in and still share an
    engine whose requests opt out per request (every registered policy's fields included)."""
    own = (f for policy in registered_policies() for f in policy.field_names())
    return ("rejection_sample_method", *own, LOSSLESS_PREFIX_FIELD)


@dataclass(kw_only=True, init=False)
class SpeculativeConfig:
    """How to draft and verify (the rules are in docs/verification.md).

    The constructor takes the fields below and, by name, the fields of the verification policy
    (`SpeculativeConfig(..., rejection_sample_method="fly", fly_window_size=2)`); each registered policy
    declares its own (flyspec/spec_decode/policies/) and resolves and checks them. A field left None is
    unset and takes its default; a field that would do nothing for this config (another policy's field, a
    lossless prefix with standard verification, a prompt-lookup setting with a draft model) is an error
    when set, whatever its value. After construction every default that applies is resolved: the
    configured policy's fields, in `policy_settings` (FLy's window: min(6, K - 1) when unset) and, with a
    lossy policy, `lossless_prefix_tokens` (0); `draft_sample_method` stays None (probabilistic drafting
    for requests that sample, greedy for greedy requests). `method` may be omitted when `model` is given
    (then it is "draft_model", as in vLLM). `quantization` is the draft model's weight quantization: None
    (the default) follows the engine's `quantization`, "int8", "int4" or "auto" quantizes the draft alone
    (or differently from the target), "none" keeps it unquantized; verification stays exact either way,
    only the drafts change. `disable_by_batch_size` (vLLM's field of that name; None = never): in a step
    where at least that many requests run, nobody drafts and every request decodes one token with the
    target alone (speculation costs more than it saves at large batches on a CPU; docs/performance.md);
    drafting resumes below it.

    Every registered policy's fields read as attributes, as in vLLM: `c.fly_window_size` is the
    configured policy's resolved value (also in `policy_settings`), and a field of a policy other than the
    configured one reads None (unset). The config is read-only once built, since its fields were checked
    together: setting an attribute raises `dataclasses.FrozenInstanceError`.

    `to_dict()` is the canonical form: the settings that apply, defaults resolved, the policy's fields
    beside the others, so that `SpeculativeConfig.from_dict(c.to_dict()) == c`. Build a variant from it
    (`from_dict({**c.to_dict(), ...})`).
    """

    method: str | None
    model: str | None
    num_speculative_tokens: int
    rejection_sample_method: str
    draft_sample_method: str | None
    prompt_lookup_min: int | None
    prompt_lookup_max: int | None
    quantization: str | None
    lossless_prefix_tokens: int | None
    disable_by_batch_size: int | None
    policy_settings: dict[str, Any]
    """The configured policy's own fields, resolved (e.g. {"fly_window_size": 3, ...}; {} for standard)."""

    def __init__(
        self,
        *,
        num_speculative_tokens: int,
        method: str | None = None,
        model: str | None = None,
        rejection_sample_method: str = "standard",
        draft_sample_method: str | None = None,
        prompt_lookup_min: int | None = None,
        prompt_lookup_max: int | None = None,
        quantization: str | None = None,
        lossless_prefix_tokens: int | None = None,
        disable_by_batch_size: int | None = None,
        **policy_fields: Any,
    ) -> None:
        # The one validation path: the constructor, from_dict and EngineConfig all come through here.
        self.method = "draft_model" if method is None and model is not None else method
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.rejection_sample_method = rejection_sample_method
        self.draft_sample_method = draft_sample_method
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.quantization = quantization
        self.lossless_prefix_tokens = lossless_prefix_tokens
        self.disable_by_batch_size = disable_by_batch_size
        _require_choice("method", self.method, _METHODS)
        if self.method == "draft_model":
            self._check_draft_model()
        else:
            self._check_ngram()
        _require_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        policy = policy_named(self.rejection_sample_method)
        if self.draft_sample_method is not None:
            _require_choice("draft_sample_method", self.draft_sample_method, _DRAFT_SAMPLE_METHODS)
        if self.disable_by_batch_size is not None:
            # vLLM's rule: at 1 speculation would be off for every batch, which is no speculation at all.
            _require_int("disable_by_batch_size", self.disable_by_batch_size, 2)
        self.policy_settings = self._check_verification(policy, policy_fields)
        object.__setattr__(self, "_built", True)

    def __getattr__(self, name: str) -> Any:
        """A verification policy's field read as an attribute, as vLLM's are (`config.fly_window_size`):
        the configured policy's resolved value, or None for another registered policy's field (unset, as
        vLLM's fields that do not apply). AttributeError for any other name."""
        # Only names the instance lacks come here. Read the settings from __dict__: a half-built object
        # (while unpickling or copying) has none, and must not recurse through this method.
        settings = self.__dict__.get("policy_settings")
        if settings is not None and name in settings:
            return settings[name]
        if not name.startswith("_") and policy_owning(name) is not None:
            return None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        # Read-only once built: the constructor checked the fields together (a window against K, a prefix
        # against the policy), and an engine reads its config once, so a later assignment would either
        # skip those rules or change nothing that runs.
        if self.__dict__.get("_built"):
            raise dataclasses.FrozenInstanceError(
                f"SpeculativeConfig is read-only once built, so {name} cannot be set: build a variant "
                f"with SpeculativeConfig.from_dict({{**config.to_dict(), {name!r}: ...}}), which checks it"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"SpeculativeConfig is read-only once built: {name} stays")

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *(f for p in registered_policies() for f in p.field_names())})

    def _check_verification(
        self, policy: type[VerificationPolicy], policy_fields: dict[str, Any]
    ) -> dict[str, Any]:
        """The policy's own fields resolved by it; ValueError for a field no policy owns, another
        policy's field, or a lossless prefix with a lossless policy."""
        for name, value in policy_fields.items():
            owner = policy_owning(name)
            if owner is None:
                raise ValueError(
                    f"speculative_config has unknown key {name!r}; allowed keys: {', '.join(_known_keys())}"
                    + _plugin_note()
                )
            if owner is not policy and value is not None:
                raise _invalid(
                    name,
                    value,
                    f"{owner.title} settings only apply with rejection_sample_method={owner.name!r} (they "
                    "would do nothing)",
                )
        settings = policy.resolve_config(policy_fields, self.num_speculative_tokens)
        if not policy.lossy:
            _reject_set(
                self,
                (LOSSLESS_PREFIX_FIELD,),
                f"a lossless prefix only applies with a lossy rejection_sample_method "
                f"({', '.join(repr(m) for m in lossy_policy_names())}); {policy.name!r} is lossless "
                "throughout",
            )
            return settings
        self.lossless_prefix_tokens = _default(self.lossless_prefix_tokens, 0)
        _require_int(LOSSLESS_PREFIX_FIELD, self.lossless_prefix_tokens, 0)
        return settings

    def _check_draft_model(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise _invalid("model", self.model, "method='draft_model' needs the draft model's path or name")
        _reject_set(self, _NGRAM_FIELDS, "they only apply to method='ngram'")
        if self.quantization is not None:
            _require_choice("quantization", self.quantization, _DRAFT_QUANTIZATION)
        self.prompt_lookup_min, self.prompt_lookup_max = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise _invalid("model", self.model, "method='ngram' drafts from the prompt and takes no model")
        if self.draft_sample_method is not None:
            raise _invalid(
                "draft_sample_method",
                self.draft_sample_method,
                "method='ngram' has no draft distribution to sample from; leave it unset",
            )
        _reject_set(self, ("quantization",), "method='ngram' has no draft model to quantize")
        lo = self.prompt_lookup_min = _default(self.prompt_lookup_min, DEFAULT_PROMPT_LOOKUP_MIN)
        hi = self.prompt_lookup_max = _default(self.prompt_lookup_max, DEFAULT_PROMPT_LOOKUP_MAX)
        _require_int("prompt_lookup_min", lo, 1)
        _require_int("prompt_lookup_max", hi, 1)
        if hi < lo:
            raise _invalid("prompt_lookup_max", hi, f"it must be >= prompt_lookup_min ({lo})")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        """Build from a dict (e.g. parsed JSON): unknown keys are an error, never ignored, and a JSON null
        means unset. Every other rule is the constructor's."""
        if not isinstance(data, dict):
            raise ValueError(
                f"speculative_config must be a dict (JSON object), got {type(data).__name__}: {data!r}"
            )
        known = _known_keys()
        unknown = sorted(set(data) - set(known), key=str)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {', '.join(repr(u) for u in unknown)}; "
                f"allowed keys: {', '.join(known)}{_plugin_note()}"
            )
        if data.get("num_speculative_tokens") is None:
            raise ValueError("speculative_config needs num_speculative_tokens (an integer >= 1)")
        return cls(**{key: value for key, value in data.items() if value is not None})

    def to_dict(self) -> dict[str, Any]:
        """The settings that apply to this config, defaults resolved (round-trips through from_dict).

        A lossless prefix of 0 (the default) and an unset draft quantization are left out, so that the
        canonical form, and the gate's record of a config, is what it was before those settings existed.
        """
        skip = set(_NGRAM_FIELDS) if self.method == "draft_model" else {"model", "draft_sample_method"}
        if not self.lossless_prefix_tokens:
            skip.add(LOSSLESS_PREFIX_FIELD)
        if self.quantization is None:  # None follows the engine: not a setting of its own
            skip.add("quantization")
        if self.disable_by_batch_size is None:
            skip.add("disable_by_batch_size")
        own = {f: getattr(self, f) for f in _OWN_FIELDS if f not in skip}
        head = ("method", "model", "num_speculative_tokens", "rejection_sample_method")
        return {
            **{f: own[f] for f in head if f in own},
            **self.policy_settings,
            **{f: v for f, v in own.items() if f not in head},
        }

    @property
    def policy(self) -> type[VerificationPolicy]:
        """The verification policy `rejection_sample_method` names (flyspec/spec_decode/policies/)."""
        return policy_named(self.rejection_sample_method)

    @property
    def is_lossy(self) -> bool:
        """True when verification may change the output distribution (FLy, typical acceptance)."""
        return self.policy.lossy

    def draft_quantization(self, engine_quantization: str | None) -> str | None:
        """The quantization the draft model loads with, given the engine's (None = unquantized)."""
        if self.quantization is None:
            return engine_quantization
        return None if self.quantization == "none" else self.quantization

    def verification_policy(self, vocab_size: int) -> VerificationPolicy | None:
        """The verifier's policy object for a target vocabulary (e.g. FLy's top-k capped at it), or None
        for standard verification."""
        if not self.is_lossy:
            return None
        _require_int("vocab_size", vocab_size, 1)
        return self.policy.from_config(self.policy_settings, vocab_size)


_OWN_FIELDS = tuple(f.name for f in dataclasses.fields(SpeculativeConfig) if f.name != "policy_settings")
"""SpeculativeConfig's own fields (the policies' fields come from the registry)."""


def _known_keys() -> tuple[str, ...]:
    """Every key a speculative config may have: its own fields, then every registered policy's."""
    return (*_OWN_FIELDS, *(f for p in registered_policies() for f in p.field_names()))


def _plugin_note() -> str:
    """For an unknown key: the policy plugins that did not load (the key may be one of theirs)."""
    failures = plugin_failures()
    return f" (a verification policy plugin did not load: {'; '.join(failures)})" if failures else ""


@dataclass
class EngineConfig:
    """Everything the engine needs to start: target model, speculation, dtype, device, quantization and
    budgets.

    `speculative_config` may be given as a dict (e.g. parsed JSON); it is converted here, the one place
    that does so, and is always a SpeculativeConfig or None after construction. `quantization` ("int8",
    "int4", "auto" or None, as vLLM's argument of that name) quantizes the target's weights at load time,
    and the draft model's unless the speculative config says otherwise (docs/performance.md); int8 and
    int4 are CPU kernels, "auto" picks the fastest format for this CPU and `max_num_seqs` (none off the
    CPU).

    `kv_cache_request_len` sizes the KV cache for the work: the positions (prompt plus max_tokens) of the
    longest request the caller will send (more than max_model_len counts as max_model_len). The cache
    then holds max_running such requests (and always one of max_model_len, so a longer request still
    runs, alone if it must) instead of max_running requests of max_model_len. `kv_cache_memory_bytes`
    caps the KV cache of the target and the draft model together instead (it must hold one request of
    max_model_len). With neither: max_running requests of max_model_len, at most a quarter of the
    machine's memory. `enable_prefix_caching` shares the KV blocks of identical prompt prefixes between
    requests. `batch_invariant` computes every token the same way whatever else is in the batch, so a
    request's output does not depend on the other requests
    (docs/performance.md).
    """

    model: str
    speculative_config: SpeculativeConfig | None = None
    dtype: str = "auto"
    device: str = "cpu"
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    quantization: str | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_request_len: int | None = None
    enable_prefix_caching: bool = True
    batch_invariant: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise _invalid("model", self.model, "it must be a model path, .gguf file or zoo name")
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        elif self.speculative_config is not None and not isinstance(
            self.speculative_config, SpeculativeConfig
        ):
            raise _invalid(
                "speculative_config",
                self.speculative_config,
                "it must be a dict, a SpeculativeConfig or None",
            )
        _require_choice("dtype", self.dtype, _DTYPES)
        if not isinstance(self.device, str) or not _DEVICE_RE.fullmatch(self.device):
            raise _invalid("device", self.device, "it must be 'cpu', 'cuda' or 'cuda:N'")
        if self.quantization is not None:
            _require_choice("quantization", self.quantization, QUANTIZATION_CHOICES)
        for field, value in (
            ("quantization", self.quantization),
            ("draft quantization", self.draft_quantization),
        ):
            if value not in (None, "auto") and self.device != "cpu":
                raise _invalid(
                    field, value, f"it runs on device='cpu' only (CPU kernels), not {self.device!r}"
                )
        _require_int("max_num_seqs", self.max_num_seqs, 1)
        _require_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            _require_int("max_model_len", self.max_model_len, 1)
        if not is_int(self.seed) or not 0 <= self.seed < 2**63:
            raise _invalid("seed", self.seed, "it must be an integer in [0, 2**63)")
        if self.kv_cache_memory_bytes is not None:
            _require_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)
        if self.kv_cache_request_len is not None:
            self._check_kv_cache_request_len()
        for field in ("enable_prefix_caching", "batch_invariant"):
            if not isinstance(getattr(self, field), bool):
                raise _invalid(field, getattr(self, field), "it must be True or False")
        per_request = 1 + self.num_speculative_tokens
        if self.max_num_batched_tokens < per_request:
            raise _invalid(
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f"each decode step of a request charges 1 + K = {per_request} tokens; "
                f"raise max_num_batched_tokens to at least 1 + K = {per_request}",
            )

    def _check_kv_cache_request_len(self) -> None:
        _require_int("kv_cache_request_len", self.kv_cache_request_len, 1)
        if self.kv_cache_memory_bytes is not None:
            raise _invalid(
                "kv_cache_request_len",
                self.kv_cache_request_len,
                "kv_cache_memory_bytes also sizes the KV cache; set one of the two",
            )

    @property
    def num_speculative_tokens(self) -> int:
        """K, or 0 without speculation."""
        spec = self.speculative_config
        return spec.num_speculative_tokens if spec is not None else 0

    @property
    def is_lossy(self) -> bool:
        """True when the engine runs a lossy verification policy (FLy, typical acceptance)."""
        spec = self.speculative_config
        return spec is not None and spec.is_lossy

    @property
    def draft_quantization(self) -> str | None:
        """The draft model's quantization (None without a draft model, or when it is not quantized)."""
        spec = self.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        return spec.draft_quantization(self.quantization)
