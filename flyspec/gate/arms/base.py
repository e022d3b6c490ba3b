"""Gate arms: the decoding configurations being compared, and how they are grouped into executors.

Two kinds of arm (docs/gate.md, "Running the gate"):

- ``{"kind": "engine", "model", "speculative_config", "dtype", "device", "max_num_seqs",
  "max_num_batched_tokens", "max_model_len", "seed", "quantization"}``: this package's engine, in-process.
  Its identity records the verification policy: the canonical ``speculative_config`` names it
  (``rejection_sample_method``) with every setting of it (FLy's or typical acceptance's fields, a lossless
  prefix when there is one). Two engine arms that differ only in the verifier (standard vs a lossy
  policy, same model, draft, dtype and quantization) share ONE engine started with the lossy policy; the
  standard arm's requests ask for ``verification="standard"``, which is lossless.
- ``{"kind": "openai", "base_urls": [...], "model", "api_key", "extra_body": {...}, "concurrency",
  "timeout", "max_retries", "backoff"}``: any OpenAI-compatible server (vLLM, flyspec serve).
  ``concurrency`` requests are in flight per base URL; failed requests (connection errors, timeouts,
  HTTP 429/5xx) are retried with exponential backoff on the next base URL; after ``max_retries``
  retries the run stops with a clear error and every answer stored so far is kept.

``kind`` may be omitted: an arm with ``base_url(s)`` is an endpoint, otherwise an engine.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flyspec.gate.data.datasets import Question
from flyspec.outputs import AcceptanceCounts

if TYPE_CHECKING:
    from flyspec.config import EngineConfig
    from flyspec.gate.arms.endpoint import OpenAIExecutor
    from flyspec.gate.arms.engine import EngineExecutor

ENGINE_KEYS = (
    "kind",
    "model",
    "speculative_config",
    "dtype",
    "device",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "seed",
    "quantization",
)
OPENAI_KEYS = (
    "kind",
    "base_urls",
    "base_url",
    "model",
    "api_key",
    "extra_body",
    "concurrency",
    "timeout",
    "max_retries",
    "backoff",
)
# Sampling is set once per run for every arm; an arm's extra_body must not change it behind the gate's back.
_RESERVED_BODY_KEYS = (
    "model",
    "messages",
    "prompt",
    "temperature",
    "top_p",
    "max_tokens",
    "seed",
    "stream",
    "n",
)


@dataclass(frozen=True)
class Sampling:
    """Sampling shared by every arm of a run."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512

    def __post_init__(self) -> None:
        t, p, m = self.temperature, self.top_p, self.max_tokens
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature={t!r}: must be a finite number >= 0 (0 = greedy)")
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
            raise ValueError(f"top_p={p!r}: must be in (0, 1]")
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"max_tokens={m!r}: must be an integer >= 1")


@dataclass(frozen=True)
class Job:
    """One question to answer by one arm in one repeat, with its per-question seed and its position in
    the run's order (0-based)."""

    arm: str
    repeat: int
    question: Question
    seed: int
    position: int

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.arm, self.repeat, self.question.dataset, self.question.id)

    @property
    def request_id(self) -> str:
        return "|".join(str(part) for part in self.key)


@dataclass(frozen=True)
class Completion:
    """What an arm produced for a job, before grading.

    ``acceptance`` is None when the source does not report speculative-decoding counters (never zeros);
    ``forgiven_reported`` is False when it reports the other counters but not the forgiven count (vLLM).
    ``system_fingerprint`` is what an endpoint's response carried (None for the engine).
    """

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    source: str
    acceptance: AcceptanceCounts | None = None
    forgiven_reported: bool = True
    system_fingerprint: str | None = None


@dataclass(frozen=True)
class EngineArm:
    """An in-process engine arm: its validated EngineConfig and that config as a canonical dict."""

    name: str
    config: dict[str, Any]
    engine_config: EngineConfig = field(compare=False, repr=False)

    def public_dict(self) -> dict[str, Any]:
        """The arm's full settings (canonical: defaults resolved)."""
        return {"kind": "engine", **self.config}

    def identity(self) -> dict[str, Any]:
        """What decides the arm's outputs, registered before the run: here, every setting."""
        return self.public_dict()


@dataclass(frozen=True)
class OpenAIArm:
    """An OpenAI-compatible endpoint arm."""

    name: str
    base_urls: tuple[str, ...]
    model: str
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    concurrency: int = 4
    timeout: float = 600.0
    max_retries: int = 4
    backoff: float = 1.0

    def identity(self, served: dict[str, Any] | None = None) -> dict[str, Any]:
        """What decides the arm's outputs, registered before the run: the model name, the extra request
        fields and the served model's ``id`` and ``root`` as the server's /v1/models reports them. Where
        the server runs (URLs) and how it is called (concurrency, timeouts, key) may change on a resume
        and are kept in the run's notes instead."""
        out: dict[str, Any] = {"kind": "openai", "model": self.model, "extra_body": self.extra_body}
        if served is not None:
            out["served_model"] = served
        return out

    def public_dict(self) -> dict[str, Any]:
        """The arm's full settings; the API key is never written, only whether one is set."""
        return {
            "kind": "openai",
            "base_urls": list(self.base_urls),
            "model": self.model,
            "api_key": "<set>" if self.api_key else None,
            "extra_body": self.extra_body,
            "concurrency": self.concurrency,
            "timeout": self.timeout,
            "max_retries": self.max_retries,
            "backoff": self.backoff,
        }


Arm = EngineArm | OpenAIArm


def _normalise_url(url: Any, name: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"arm {name!r}: base_url={url!r}: must be an http:// or https:// URL")
    url = url.rstrip("/")
    # OpenAI clients take the base URL including /v1; accept a bare host:port as well.
    return url if url.endswith("/v1") else url + "/v1"


def _positive(name: str, key: str, value: Any, *, integer: bool) -> None:
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type or not value > 0 or not math.isfinite(value):
        kind = "integer" if integer else "number"
        raise ValueError(f"arm {name!r}: {key}={value!r}: must be a positive {kind}")


def load_arm_spec(spec: dict[str, Any] | str | Path, name: str) -> dict[str, Any]:
    """An arm given as a dict, a JSON object string, or the path of a JSON file, as a dict."""
    if isinstance(spec, dict):
        return dict(spec)
    text = str(spec).strip()
    if not text.startswith("{"):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(f"arm {name!r}: {text!r} is neither a JSON object nor an existing JSON file")
        text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"arm {name!r}: invalid JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(data, dict):
        raise ValueError(f"arm {name!r}: must be a JSON object, got {type(data).__name__}")
    return data


def _parse_engine_arm(name: str, data: dict[str, Any]) -> EngineArm:
    unknown = sorted(set(data) - set(ENGINE_KEYS))
    if unknown:
        raise ValueError(
            f"arm {name!r}: unknown key(s) {', '.join(unknown)}; engine arms take {', '.join(ENGINE_KEYS)}"
        )
    from flyspec.config import EngineConfig, SpeculativeConfig

    fields = {k: v for k, v in data.items() if k != "kind"}
    # Unset means "auto", the fastest weight format this CPU runs (an explicit null keeps the weights as
    # loaded); the arm's settings record it, so the run's registration says which was asked for.
    fields.setdefault("quantization", "auto")
    try:
        config = EngineConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"arm {name!r}: {exc}") from None
    spec = config.speculative_config
    resolved = {
        "model": config.model,
        "speculative_config": spec.to_dict() if isinstance(spec, SpeculativeConfig) else None,
        "dtype": config.dtype,
        "device": config.device,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_model_len": config.max_model_len,
        "seed": config.seed,
    }
    # Only when set, so an arm with an explicit null has the settings (and hence the run) it had before
    # quantization existed.
    if config.quantization is not None:
        resolved["quantization"] = config.quantization
    return EngineArm(name, resolved, config)


def _parse_openai_arm(name: str, data: dict[str, Any]) -> OpenAIArm:
    unknown = sorted(set(data) - set(OPENAI_KEYS))
    if unknown:
        raise ValueError(
            f"arm {name!r}: unknown key(s) {', '.join(unknown)}; endpoint arms take {', '.join(OPENAI_KEYS)}"
        )
    if ("base_urls" in data) == ("base_url" in data):
        raise ValueError(f"arm {name!r}: give exactly one of base_url (a URL) or base_urls (a list of URLs)")
    urls = data["base_urls"] if "base_urls" in data else [data["base_url"]]
    if not isinstance(urls, list) or not urls:
        raise ValueError(f"arm {name!r}: base_urls={urls!r}: must be a non-empty list of URLs")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError(f"arm {name!r}: model={model!r}: an endpoint arm needs the served model name")
    extra = data.get("extra_body", {})
    if not isinstance(extra, dict):
        raise ValueError(f"arm {name!r}: extra_body={extra!r}: must be a JSON object")
    reserved = sorted(set(extra) & set(_RESERVED_BODY_KEYS))
    if reserved:
        raise ValueError(
            f"arm {name!r}: extra_body sets {', '.join(reserved)}, which the gate sets identically for every "
            "arm (use --temperature/--top-p/--max-tokens/--seed)"
        )
    api_key = data.get("api_key")
    if api_key is not None and not isinstance(api_key, str):
        raise ValueError(f"arm {name!r}: api_key must be a string")
    arm = OpenAIArm(
        name=name,
        base_urls=tuple(_normalise_url(u, name) for u in urls),
        model=model,
        api_key=api_key,
        extra_body=extra,
        concurrency=data.get("concurrency", 4),
        timeout=data.get("timeout", 600.0),
        max_retries=data.get("max_retries", 4),
        backoff=data.get("backoff", 1.0),
    )
    _positive(name, "concurrency", arm.concurrency, integer=True)
    _positive(name, "timeout", arm.timeout, integer=False)
    _positive(name, "backoff", arm.backoff, integer=False)
    if isinstance(arm.max_retries, bool) or not isinstance(arm.max_retries, int) or arm.max_retries < 0:
        raise ValueError(f"arm {name!r}: max_retries={arm.max_retries!r}: must be an integer >= 0")
    return arm


def parse_arm(name: str, spec: dict[str, Any] | str | Path) -> Arm:
    """Validate an arm description; ValueError names the arm, the field, the value and the rule."""
    data = load_arm_spec(spec, name)
    kind = data.get("kind") or ("openai" if ("base_urls" in data or "base_url" in data) else "engine")
    if kind == "engine":
        return _parse_engine_arm(name, data)
    if kind != "openai":
        raise ValueError(f"arm {name!r}: kind={kind!r}: must be 'engine' or 'openai'")
    return _parse_openai_arm(name, data)


# ------------------------------------------------------------------------------ grouping into executors


def _engine_key(config: dict[str, Any]) -> str:
    """Everything but the verifier: arms with equal keys can share one engine."""
    from flyspec.config import VERIFICATION_FIELDS

    spec = config["speculative_config"]
    if spec is not None:
        spec = {k: v for k, v in spec.items() if k not in VERIFICATION_FIELDS}
    return json.dumps({**config, "speculative_config": spec}, sort_keys=True)


def is_lossy(config: dict[str, Any]) -> bool:
    """Whether a canonical engine config verifies with a lossy policy (its policy says so)."""
    from flyspec.config import verification_policy

    spec = config["speculative_config"]
    return spec is not None and verification_policy(spec["rejection_sample_method"]).lossy


def engine_groups(arms: list[EngineArm]) -> list[list[EngineArm]]:
    """Group engine arms into as few engines as possible: arms that differ only in the verifier share one
    engine started with the lossy arm's settings (arms with two different lossy settings cannot). The
    first arm of each group is the one whose config starts the engine."""
    groups: dict[str, list[EngineArm]] = {}
    for arm in arms:
        groups.setdefault(_engine_key(arm.config), []).append(arm)
    out: list[list[EngineArm]] = []
    for members in groups.values():
        lossy_configs = {json.dumps(a.config, sort_keys=True) for a in members if is_lossy(a.config)}
        if len(lossy_configs) > 1:
            out.extend([a] for a in members)
            continue
        lead = next((a for a in members if is_lossy(a.config)), members[0])
        out.append([lead, *(a for a in members if a is not lead)])
    return out


def make_executors(arms: list[Arm]) -> list[EngineExecutor | OpenAIExecutor]:
    """One executor per endpoint arm; engine arms grouped into as few in-process engines as possible."""
    from flyspec.gate.arms.endpoint import OpenAIExecutor
    from flyspec.gate.arms.engine import EngineExecutor

    engines = [
        EngineExecutor(group) for group in engine_groups([a for a in arms if isinstance(a, EngineArm)])
    ]
    endpoints = [OpenAIExecutor(a) for a in arms if isinstance(a, OpenAIArm)]
    return [*engines, *endpoints]
