"""Engine and speculative-decoding configuration: defaults, validation and the lossy warning.

Every broken rule raises ValueError with a message that names the field, the value and the rule, e.g.
`fly_window_size=5 is invalid: it must satisfy 1 <= fly_window_size < num_speculative_tokens (4)`.
The verification policy named by `rejection_sample_method` owns its fields, their defaults and rules
(flyspec/spec_decode/policies/); this module asks it. It imports no torch, so the command line can
validate configs cheaply.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Any

from flyspec.checks import is_int
from flyspec.spec_decode.policies import LOSSY_POLICIES, POLICIES, VerificationPolicy, policy_named
from flyspec.spec_decode.policies import fly as _fly
from flyspec.spec_decode.policies.base import invalid as _invalid

__all__ = [
    "DEFAULT_FLY_ENTROPY_THRESHOLD",
    "DEFAULT_FLY_ENTROPY_TOP_K",
    "DEFAULT_FLY_WINDOW",
    "DEFAULT_PROMPT_LOOKUP_MAX",
    "DEFAULT_PROMPT_LOOKUP_MIN",
    "LOSSLESS_PREFIX_FIELD",
    "LOSSY_METHODS",
    "LOSSY_WARNING",
    "POLICY_FIELDS",
    "POLICY_OF_FIELD",
    "QUANTIZATION_CHOICES",
    "QUANTIZATION_METHODS",
    "REJECTION_SAMPLE_METHODS",
    "EngineConfig",
    "SpeculativeConfig",
    "VerificationPolicy",
    "log_lossy_warning",
    "verification_policy",
]

DEFAULT_FLY_WINDOW = _fly.DEFAULT_WINDOW
"""FLy window W when unset: min(DEFAULT_FLY_WINDOW, K - 1)."""
DEFAULT_FLY_ENTROPY_THRESHOLD = _fly.DEFAULT_ENTROPY_THRESHOLD
DEFAULT_FLY_ENTROPY_TOP_K = _fly.DEFAULT_ENTROPY_TOP_K
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 5

LOSSY_WARNING = _fly.FlyParams.lossy_warning()
"""FLy's warning; every lossy policy has its own (`VerificationPolicy.lossy_warning()`)."""

REJECTION_SAMPLE_METHODS = tuple(POLICIES)
"""Every verification policy's name, "standard" first."""
LOSSY_METHODS = tuple(p.name for p in LOSSY_POLICIES)
"""The lossy policies' names: what a request's `verification` may name besides "standard"."""
POLICY_OF_FIELD = {f: p.name for p in POLICIES.values() for f in p.config_fields}
"""Every policy's own SpeculativeConfig fields, each with the name of the policy that owns it."""
POLICY_FIELDS = tuple(POLICY_OF_FIELD)
"""Every policy's own SpeculativeConfig fields."""
LOSSLESS_PREFIX_FIELD = "lossless_prefix_tokens"
"""The lossless prefix (docs/verification.md): a field of every lossy policy."""
VERIFICATION_FIELDS = ("rejection_sample_method", *POLICY_FIELDS, LOSSLESS_PREFIX_FIELD)
"""Every field that chooses or tunes verification (what two configs may differ in and still share an
engine whose requests opt out per request)."""

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


@dataclass(kw_only=True)
class SpeculativeConfig:
    """How to draft and verify (the rules are in docs/verification.md).

    A field left None is unset and takes its default; a field that would do nothing for this config (a
    FLy or typical-acceptance setting with another `rejection_sample_method`, a lossless prefix with
    standard verification, a prompt-lookup setting with a draft model) is an error when set, whatever its
    value. After construction every default that applies is resolved: the fields of the configured
    verification policy (FLy's window: min(6, K - 1) when unset) and, with a lossy policy,
    `lossless_prefix_tokens` (0); the fields of the other policies stay None, as does
    `draft_sample_method` (None: probabilistic drafting for requests that sample, greedy for greedy
    requests). `method` may be omitted when `model` is given (then it is "draft_model", as in vLLM).
    `quantization` is the draft model's weight quantization: None (the default) follows the engine's
    `quantization`, "int8", "int4" or "auto" quantizes the draft alone (or differently from the target),
    "none" keeps it unquantized; verification stays exact either way, only the drafts change.

    `to_dict()` is the canonical form: the settings that apply, defaults resolved, so that
    `SpeculativeConfig.from_dict(c.to_dict()) == c`. Build a variant from it
    (`from_dict({**c.to_dict(), ...})`) rather than with `dataclasses.replace`, which would pass the
    resolved policy defaults of a config back as if they were set.
    """

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int
    rejection_sample_method: str = "standard"
    fly_window_size: int | None = None
    fly_entropy_threshold: float | None = None
    fly_entropy_top_k: int | None = None
    draft_sample_method: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    quantization: str | None = None
    typical_acceptance_sampler_posterior_threshold: float | None = None
    typical_acceptance_sampler_posterior_alpha: float | None = None
    lossless_prefix_tokens: int | None = None

    def __post_init__(self) -> None:
        # The one validation path: the constructor, from_dict and EngineConfig all come through here.
        if self.method is None and self.model is not None:
            self.method = "draft_model"
        _require_choice("method", self.method, _METHODS)
        if self.method == "draft_model":
            self._check_draft_model()
        else:
            self._check_ngram()
        _require_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        _require_choice("rejection_sample_method", self.rejection_sample_method, REJECTION_SAMPLE_METHODS)
        if self.draft_sample_method is not None:
            _require_choice("draft_sample_method", self.draft_sample_method, _DRAFT_SAMPLE_METHODS)
        self._check_verification()

    def _check_verification(self) -> None:
        policy = self.policy
        for other in POLICIES.values():
            if other is not policy:
                _reject_set(
                    self,
                    other.config_fields,
                    f"{other.title} settings only apply with rejection_sample_method={other.name!r} (they "
                    "would do nothing)",
                )
        values = {f: getattr(self, f) for f in policy.config_fields}
        for field, value in policy.resolve_config(values, self.num_speculative_tokens).items():
            setattr(self, field, value)
        if not policy.lossy:
            _reject_set(
                self,
                (LOSSLESS_PREFIX_FIELD,),
                f"a lossless prefix only applies with a lossy rejection_sample_method "
                f"({', '.join(repr(m) for m in LOSSY_METHODS)}); {policy.name!r} is lossless throughout",
            )
            return
        self.lossless_prefix_tokens = _default(self.lossless_prefix_tokens, 0)
        _require_int(LOSSLESS_PREFIX_FIELD, self.lossless_prefix_tokens, 0)

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
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known), key=str)
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {', '.join(repr(u) for u in unknown)}; "
                f"allowed keys: {', '.join(known)}"
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
        skip.update(f for f in POLICY_FIELDS if f not in self.policy.config_fields)
        if not self.lossless_prefix_tokens:
            skip.add(LOSSLESS_PREFIX_FIELD)
        if self.quantization is None:  # None follows the engine: not a setting of its own
            skip.add("quantization")
        return {key: value for key, value in dataclasses.asdict(self).items() if key not in skip}

    @property
    def policy(self) -> type[VerificationPolicy]:
        """The verification policy `rejection_sample_method` names (flyspec/spec_decode/policies/)."""
        return policy_named(self.rejection_sample_method)

    @property
    def is_lossy(self) -> bool:
        """True when verification may change the output distribution (FLy, typical acceptance)."""
        return self.policy.lossy

    @property
    def policy_settings(self) -> dict[str, Any]:
        """The configured policy's own fields, resolved (e.g. {"fly_window_size": 3, ...})."""
        return {f: getattr(self, f) for f in self.policy.config_fields}

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

    `kv_cache_memory_bytes` caps the KV cache of the target and the draft model together (None: what
    max_running requests of max_model_len need, at most a quarter of the machine's memory; it must hold
    one request of max_model_len). `enable_prefix_caching` shares the KV blocks of identical prompt
    prefixes between requests. `batch_invariant` computes every token the same way whatever else is in
    the batch, so a request's output does not depend on the other requests (docs/performance.md).
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


def log_lossy_warning(logger: logging.Logger, rejection_sample_method: str = _fly.FlyParams.name) -> None:
    """Log a lossy policy's warning (the engine calls this once when it starts with that policy)."""
    logger.warning(policy_named(rejection_sample_method).lossy_warning())
