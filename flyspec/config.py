"""Engine and speculative-decoding configuration: defaults, validation and the lossy warning.

Every broken rule raises ValueError with a message that names the field, the value and the rule, e.g.
`fly_window_size=5 is invalid: it must satisfy 1 <= fly_window_size < num_speculative_tokens (4)`.
This module imports no torch, so the command line can validate configs cheaply.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flyspec.spec_decode.verify import FlyParams

__all__ = [
    "DEFAULT_FLY_ENTROPY_THRESHOLD",
    "DEFAULT_FLY_ENTROPY_TOP_K",
    "DEFAULT_FLY_WINDOW",
    "DEFAULT_PROMPT_LOOKUP_MAX",
    "DEFAULT_PROMPT_LOOKUP_MIN",
    "LOSSY_WARNING",
    "QUANTIZATION_METHODS",
    "EngineConfig",
    "SpeculativeConfig",
    "log_lossy_warning",
]

DEFAULT_FLY_WINDOW = 6
"""FLy window W when unset: min(DEFAULT_FLY_WINDOW, K - 1)."""
DEFAULT_FLY_ENTROPY_THRESHOLD = 0.3
DEFAULT_FLY_ENTROPY_TOP_K = 3
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 5

LOSSY_WARNING = (
    "FLy verification is lossy: outputs do not follow the target model's distribution "
    "and may be of lower quality."
)

_METHODS = ("draft_model", "ngram")
_REJECTION_METHODS = ("standard", "fly")
_DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
_FLY_FIELDS = ("fly_window_size", "fly_entropy_threshold", "fly_entropy_top_k")
_NGRAM_FIELDS = ("prompt_lookup_min", "prompt_lookup_max")
_DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION_METHODS = ("int8", "int4")
"""Weight quantization at load time (flyspec/models/quantization.py); None = the weights as loaded."""
_DRAFT_QUANTIZATION = (*QUANTIZATION_METHODS, "none")
_DEVICE_RE = re.compile(r"cpu|cuda|cuda:\d+")


def _invalid(field: str, value: Any, rule: str) -> ValueError:
    return ValueError(f"{field}={value!r} is invalid: {rule}")


def _is_int(value: Any) -> bool:
    # bool is an int subclass, but `num_speculative_tokens=True` is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(field: str, value: Any, minimum: int) -> None:
    if not _is_int(value) or value < minimum:
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


@dataclass(kw_only=True)
class SpeculativeConfig:
    """How to draft and verify (the rules are in docs/verification.md).

    A field left None is unset and takes its default; a field that would do nothing for this config (a
    FLy setting with standard verification, a prompt-lookup setting with a draft model) is an error when
    set, whatever its value. After construction every default is resolved except `fly_window_size`
    (None without FLy; with FLy, min(6, K - 1) when unset) and `draft_sample_method` (None: probabilistic
    drafting for requests that sample, greedy for greedy requests). `method` may be omitted when `model`
    is given (then it is "draft_model", as in vLLM). `quantization` is the draft model's weight
    quantization: None (the default) follows the engine's `quantization`, "int8" or "int4" quantizes
    the draft alone (or differently from the target), "none" keeps it unquantized; verification stays
    exact either way, only the drafts change.

    `to_dict()` is the canonical form: the settings that apply, defaults resolved, so that
    `SpeculativeConfig.from_dict(c.to_dict()) == c`. Build a variant from it
    (`from_dict({**c.to_dict(), ...})`) rather than with `dataclasses.replace`, which would pass the
    resolved FLy defaults of a standard config back as if they were set.
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
        _require_choice("rejection_sample_method", self.rejection_sample_method, _REJECTION_METHODS)
        if self.draft_sample_method is not None:
            _require_choice("draft_sample_method", self.draft_sample_method, _DRAFT_SAMPLE_METHODS)
        if self.rejection_sample_method == "standard":
            _reject_set(
                self,
                _FLY_FIELDS,
                "FLy settings only apply with rejection_sample_method='fly' (they would do nothing)",
            )
            self.fly_entropy_threshold = DEFAULT_FLY_ENTROPY_THRESHOLD
            self.fly_entropy_top_k = DEFAULT_FLY_ENTROPY_TOP_K
        else:
            self._check_fly()

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

    def _check_fly(self) -> None:
        k = self.num_speculative_tokens
        if k < 2:
            raise _invalid(
                "num_speculative_tokens",
                k,
                "rejection_sample_method='fly' needs num_speculative_tokens >= 2 (a window of at least one "
                "draft token must follow a forgiven position)",
            )
        w = self.fly_window_size = _default(self.fly_window_size, min(DEFAULT_FLY_WINDOW, k - 1))
        if not _is_int(w) or not 1 <= w < k:
            raise _invalid(
                "fly_window_size", w, f"it must satisfy 1 <= fly_window_size < num_speculative_tokens ({k})"
            )
        theta = _default(self.fly_entropy_threshold, DEFAULT_FLY_ENTROPY_THRESHOLD)
        if _is_int(theta):
            theta = float(theta)
        if not isinstance(theta, float) or not math.isfinite(theta) or theta < 0:
            raise _invalid("fly_entropy_threshold", theta, "it must be a finite number >= 0")
        self.fly_entropy_threshold = theta
        self.fly_entropy_top_k = _default(self.fly_entropy_top_k, DEFAULT_FLY_ENTROPY_TOP_K)
        _require_int("fly_entropy_top_k", self.fly_entropy_top_k, 1)

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
        """The settings that apply to this config, defaults resolved (round-trips through from_dict)."""
        skip = set(_NGRAM_FIELDS) if self.method == "draft_model" else {"model", "draft_sample_method"}
        if not self.is_lossy:
            skip.update(_FLY_FIELDS)
        if self.quantization is None:  # None follows the engine: not a setting of its own
            skip.add("quantization")
        return {key: value for key, value in dataclasses.asdict(self).items() if key not in skip}

    @property
    def is_lossy(self) -> bool:
        """True when verification may change the output distribution (FLy)."""
        return self.rejection_sample_method == "fly"

    def draft_quantization(self, engine_quantization: str | None) -> str | None:
        """The quantization the draft model loads with, given the engine's (None = unquantized)."""
        if self.quantization is None:
            return engine_quantization
        return None if self.quantization == "none" else self.quantization

    def fly_params(self, vocab_size: int) -> FlyParams | None:
        """The verifier's FLy parameters for a target vocabulary (top-k capped at it), or None."""
        if not self.is_lossy:
            return None
        from flyspec.spec_decode.verify import FlyParams

        _require_int("vocab_size", vocab_size, 1)
        # All three are resolved in __post_init__ when FLy is on.
        assert self.fly_window_size is not None and self.fly_entropy_threshold is not None
        assert self.fly_entropy_top_k is not None
        return FlyParams(
            window_size=self.fly_window_size,
            entropy_threshold=self.fly_entropy_threshold,
            entropy_top_k=min(self.fly_entropy_top_k, vocab_size),
        )


@dataclass
class EngineConfig:
    """Everything the engine needs to start: target model, speculation, dtype, device, quantization and
    budgets.

    `speculative_config` may be given as a dict (e.g. parsed JSON); it is converted here, the one place
    that does so, and is always a SpeculativeConfig or None after construction. `quantization` ("int8",
    "int4" or None, as vLLM's argument of that name) quantizes the target's weights at load time, and the
    draft model's unless the speculative config says otherwise (docs/performance.md); CPU only.

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
            _require_choice("quantization", self.quantization, QUANTIZATION_METHODS)
        for field, value in (
            ("quantization", self.quantization),
            ("draft quantization", self.draft_quantization),
        ):
            if value is not None and self.device != "cpu":
                raise _invalid(
                    field, value, f"it runs on device='cpu' only (CPU kernels), not {self.device!r}"
                )
        _require_int("max_num_seqs", self.max_num_seqs, 1)
        _require_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            _require_int("max_model_len", self.max_model_len, 1)
        if not _is_int(self.seed) or not 0 <= self.seed < 2**63:
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
        """True when the engine runs FLy verification."""
        spec = self.speculative_config
        return spec is not None and spec.is_lossy

    @property
    def draft_quantization(self) -> str | None:
        """The draft model's quantization (None without a draft model, or when it is not quantized)."""
        spec = self.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        return spec.draft_quantization(self.quantization)


def log_lossy_warning(logger: logging.Logger) -> None:
    """Log the lossy-verification warning (the engine calls this once when it starts)."""
    logger.warning(LOSSY_WARNING)
