"""Per-request sampling parameters (vLLM's names and defaults), validated on construction.

Every value is checked into a range the engine computes safely in float32, and a bad value raises
ValueError naming the field, the value and the rule. The bounds are module constants so that the server
can quote the same numbers (docs/sampling.md explains each one).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from flyspec.checks import is_int
from flyspec.config import policy_names

TARGET_ONLY = "target_only"
"""`verification=TARGET_ONLY`: no drafts for this request; the target alone decodes it, one token per step
(lossless: the target's own distribution, as in an engine without speculation)."""
DRAFT_ONLY = "draft_only"
"""`verification=DRAFT_ONLY`: the draft model alone answers this request, every draft token kept, and the
target never runs for it: the limit of lossy verification (the control a quality gate must catch)."""
SPECULATION_MODES = (TARGET_ONLY, DRAFT_ONLY)
"""The per-request modes that change who decodes a request rather than how drafts are verified."""


def verification_choices() -> tuple[str, ...]:
    """A request's `verification`: "standard" (lossless), a registered policy's name (which the engine
    checks is its own), or one of SPECULATION_MODES."""
    return (*policy_names(), *SPECULATION_MODES)


TEMPERATURE_MIN = 0.01
"""Smallest non-zero temperature: logits / temperature must stay finite in float32 (1e-40 gives inf and
then NaN probabilities); at 0.01 a distribution is already greedy for every practical purpose."""
TEMPERATURE_MAX = 100.0
"""Largest temperature: beyond it the distribution is uniform to float32 precision (1e300 is inf there)."""
TOP_P_MIN = 1e-9
"""Smallest top_p: float32 flushes much smaller values to 0; any top_p <= 1/vocab keeps one token anyway."""
TOP_K_MAX = 2**31 - 1
"""Largest top_k: it fits every integer tensor the sampler builds; any top_k >= the vocabulary is off."""
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""Seeds are signed 64-bit integers, as vLLM accepts them."""
PENALTY_MAX = 2.0
"""presence_penalty and frequency_penalty lie in [-PENALTY_MAX, PENALTY_MAX] (OpenAI's range)."""
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.01, 100.0
"""repetition_penalty divides positive logits and multiplies negative ones: within these bounds a logit
changes by at most 100x, which float32 holds for any real logit (1 = off)."""
LOGIT_BIAS_MAX = 100.0
"""logit_bias values lie in [-LOGIT_BIAS_MAX, LOGIT_BIAS_MAX] (OpenAI's range)."""
MAX_LOGPROBS = 20
"""logprobs and prompt_logprobs ask for at most this many alternatives per position (vLLM's default)."""
MAX_N = 128
"""The most samples one request may ask for (OpenAI's limit for n)."""
MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS = 64, 1024
"""Stop strings are checked after every token, so their number and length are bounded."""
MAX_STOP_TOKEN_IDS = 1024


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number_in(name: str, value: object, low: float, high: float, rule: str) -> float:
    """value as a float when it is a number in [low, high], else ValueError naming the field."""
    if not _is_number(value) or not math.isfinite(value) or not low <= value <= high:  # type: ignore[arg-type]
        raise ValueError(f"{name}={value!r}: {rule}")
    return float(value)  # type: ignore[arg-type]


@dataclass
class StructuredOutputsParams:
    """A constraint on the output text, enforced by a grammar (vLLM's StructuredOutputsParams).

    Set exactly one of: json (a JSON schema, as a dict or its JSON text), json_object=True (any JSON
    object), regex (a regular expression the whole output matches), choice (the output is exactly one of
    these strings), grammar (a Lark grammar). JSON may have whitespace between its tokens (llguidance's
    and vLLM's default).
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name, value in (
                ("json", self.json),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: set exactly one of json, json_object, regex, choice, grammar (got "
                f"{given or 'none'})"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    self.json = json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json: not valid JSON ({exc})") from None
            if not isinstance(self.json, dict):
                raise ValueError(f"structured_outputs.json={self.json!r}: a JSON schema must be an object")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object={self.json_object!r}: must be true or false")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}={value!r}: must be a non-empty string")
        if self.choice is not None:
            if (
                not isinstance(self.choice, list | tuple)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError(
                    f"structured_outputs.choice={self.choice!r}: must be a non-empty list of non-empty "
                    "strings"
                )
            self.choice = list(self.choice)

    @classmethod
    def from_response_format(cls, response_format: dict[str, Any]) -> StructuredOutputsParams | None:
        """The constraint an OpenAI `response_format` asks for: None for {"type": "text"}, any JSON object
        for {"type": "json_object"}, the schema of {"type": "json_schema", "json_schema": {"schema": ...}}."""
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if schema is None:
                raise ValueError(
                    "response_format.json_schema.schema: a json_schema response format needs one"
                )
            return cls(json=schema)
        raise ValueError(
            f"response_format.type={kind!r}: must be one of 'text', 'json_object', 'json_schema'"
        )


@dataclass
class SamplingParams:
    """How one request is decoded.

    temperature: 0 means greedy; otherwise logits are divided by it before min-p / top-k / top-p; it must
    be 0 or within [0.01, 100]. top_p: nucleus mass in (0, 1]; 1.0 = off. top_k: keep the k most likely
    tokens; 0 (or -1) = off. min_p: drop tokens less likely than min_p times the most likely one; 0 = off.
    max_tokens: the most tokens to generate (0 is allowed only with prompt_logprobs: score the prompt and
    generate nothing). seed: the request's own random stream (None = engine seed plus the request's
    arrival index). stop: strings that end generation (excluded from the text). stop_token_ids: token ids
    that end generation (kept in token_ids). ignore_eos: keep going past end-of-sequence. verification:
    None = the engine's verifier; "standard" forces lossless verification for this request; a lossy
    policy's name ("fly", "typical") asks for that policy and needs an engine started with it;
    "target_only" decodes the request with the target alone, no drafts (lossless, in the same batches as
    speculative requests); "draft_only" answers it with the draft model alone, every draft token kept and
    no target pass (needs an engine with a draft model of the target's vocabulary; no penalties, logit
    bias, structured output or logprobs, which need the target's processing). docs/sampling.md.

    n: independent samples of the same prompt, returned as RequestOutput.outputs[0..n-1]; sample i uses
    seed + i (docs/sampling.md). presence_penalty / frequency_penalty (OpenAI, in [-2, 2]): subtracted
    from the logit of every token already generated, once / once per occurrence. repetition_penalty
    (vLLM / transformers, in [0.01, 100], 1 = off): the logit of every token in the prompt or the output
    is divided by it when positive and multiplied by it when negative. logit_bias: {token id: bias in
    [-100, 100]} added to the logits. logprobs: None, or k >= 0: report the log-probability of every
    generated token under the processed target distribution plus the k most likely alternatives.
    prompt_logprobs: None, or k >= 0: the same for every prompt token after the first, under the model's
    raw distribution. structured_outputs: a grammar the output must follow (StructuredOutputsParams).
    The order in which all of these shape the distribution is in docs/verification.md.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    verification: str | None = None
    n: int = 1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise ValueError(f"temperature={self.temperature!r}: must be a number >= 0")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature={self.temperature!r}: must be finite and >= 0 (0 = greedy)")
        if self.temperature != 0 and not TEMPERATURE_MIN <= self.temperature <= TEMPERATURE_MAX:
            raise ValueError(
                f"temperature={self.temperature!r}: use 0 for greedy or a value in [{TEMPERATURE_MIN}, "
                f"{TEMPERATURE_MAX:g}]; outside that range logits / temperature is not safe in float32"
            )
        self.temperature = float(self.temperature)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise ValueError(f"top_p={self.top_p!r}: must be a number in (0, 1]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1] (1.0 = off)")
        if self.top_p < TOP_P_MIN:
            raise ValueError(
                f"top_p={self.top_p!r}: must be at least {TOP_P_MIN:g} (smaller values round to 0 in "
                "float32; any top_p at or below 1/vocabulary keeps only the most likely token anyway)"
            )
        self.top_p = float(self.top_p)
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r}: must be an integer >= 0 (0 or -1 = off)")
        if self.top_k > TOP_K_MAX:
            raise ValueError(
                f"top_k={self.top_k!r}: must be at most {TOP_K_MAX} (any value >= the vocabulary is off)"
            )
        if self.top_k == -1:  # vLLM spells "off" as -1; accept it and keep one spelling inside
            self.top_k = 0
        self.min_p = _number_in("min_p", self.min_p, 0.0, 1.0, "must be a number in [0, 1] (0 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            rule = f"must be a number in [-{PENALTY_MAX:g}, {PENALTY_MAX:g}] (0 = off)"
            setattr(self, name, _number_in(name, getattr(self, name), -PENALTY_MAX, PENALTY_MAX, rule))
        self.repetition_penalty = _number_in(
            "repetition_penalty",
            self.repetition_penalty,
            REPETITION_PENALTY_MIN,
            REPETITION_PENALTY_MAX,
            f"must be a number in [{REPETITION_PENALTY_MIN}, {REPETITION_PENALTY_MAX:g}] (1 = off)",
        )
        self.logit_bias = self._check_logit_bias(self.logit_bias)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name}={value!r}: must be None or an integer in [0, {MAX_LOGPROBS}] (the number of "
                    "alternatives reported next to each token)"
                )
        if not is_int(self.max_tokens) or self.max_tokens < 0:
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be an integer >= 1")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError(
                "max_tokens=0: must be an integer >= 1 (0, which generates nothing, is allowed only "
                "together with prompt_logprobs, to score a prompt)"
            )
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed={self.seed!r}: must be None or an integer in [{SEED_MIN}, {SEED_MAX}]")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n={self.n!r}: must be an integer in [1, {MAX_N}]")
        self.stop = self._check_stop(self.stop)
        self.stop_token_ids = self._check_stop_token_ids(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos={self.ignore_eos!r}: must be true or false")
        # "standard" (lossless), a registered policy's name, or a mode that picks who decodes the request.
        choices = verification_choices()
        if self.verification is not None and self.verification not in choices:
            raise ValueError(f"verification={self.verification!r}: must be one of {choices} or None")
        self._check_draft_only()
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                f"structured_outputs={self.structured_outputs!r}: must be a StructuredOutputsParams or None"
            )

    def _check_draft_only(self) -> None:
        """A draft-only request is sampled by the drafter, which applies temperature, min-p, top-k and
        top-p but none of the target-side processing: asking for that processing is an error, not a
        setting silently dropped."""
        if self.verification != DRAFT_ONLY:
            return
        unsupported = [
            name
            for name, on in (
                ("presence_penalty / frequency_penalty / repetition_penalty", self.has_penalties),
                ("logit_bias", self.logit_bias is not None),
                ("structured_outputs", self.structured_outputs is not None),
                ("logprobs", self.logprobs is not None),
                ("prompt_logprobs", self.prompt_logprobs is not None),
            )
            if on
        ]
        if unsupported:
            raise ValueError(
                f"verification='draft_only' cannot be combined with {', '.join(unsupported)}: the draft "
                "model answers alone and only temperature, min_p, top_k and top_p shape its distribution"
            )

    @property
    def answered_by_draft(self) -> bool:
        """True for verification="draft_only": the draft model alone generates this request."""
        return self.verification == DRAFT_ONLY

    @property
    def may_draft(self) -> bool:
        """False for verification="target_only" and "draft_only": the target never verifies drafts for this
        request (it decodes it alone, or never sees it)."""
        return self.verification not in SPECULATION_MODES

    @staticmethod
    def _check_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, list | tuple) or not all(isinstance(s, str) and s for s in items):
            raise ValueError(f"stop={stop!r}: must be a non-empty string or a list of non-empty strings")
        if len(items) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_CHARS for s in items):
            shown = f"{len(items)} strings" if len(items) > MAX_STOP_STRINGS else "a string that long"
            raise ValueError(
                f"stop=<{shown}>: at most {MAX_STOP_STRINGS} stop strings of at most "
                f"{MAX_STOP_STRING_CHARS} characters each"
            )
        return list(items)

    @staticmethod
    def _check_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, list | tuple) or not all(is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids={ids!r}: must be a list of token ids (integers >= 0)")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids=<{len(ids)} ids>: at most {MAX_STOP_TOKEN_IDS} token ids")
        return list(ids)

    @staticmethod
    def _check_logit_bias(bias: object) -> dict[int, float] | None:
        if bias is None:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias={bias!r}: must be a mapping of token id to bias")
        checked: dict[int, float] = {}
        for key, value in bias.items():
            # JSON objects have string keys: "50256" is token 50256.
            token = int(key) if isinstance(key, str) and key.isdigit() else key
            if not is_int(token) or token < 0:  # type: ignore[operator]
                raise ValueError(f"logit_bias: key {key!r} is not a token id (an integer >= 0)")
            rule = f"the bias of token {token} must be a number in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]"
            checked[token] = _number_in("logit_bias", value, -LOGIT_BIAS_MAX, LOGIT_BIAS_MAX, rule)  # type: ignore[index]
        return checked or None

    @property
    def greedy(self) -> bool:
        """True when the request decodes greedily (temperature 0)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when a presence, frequency or repetition penalty is on."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def shapes_logits(self) -> bool:
        """True when the request needs logits processing beyond temperature / top-k / top-p / min-p
        (penalties, a logit bias or a grammar); the engine's fast path skips all of it otherwise."""
        return self.has_penalties or self.logit_bias is not None or self.structured_outputs is not None
