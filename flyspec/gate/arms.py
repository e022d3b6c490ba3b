"""Gate arms: the decoding configurations being compared, and the executors that answer questions.

Two kinds of arm (SPEC 11.2):

- ``{"kind": "engine", "model", "speculative_config", "dtype", "device", "max_num_seqs",
  "max_num_batched_tokens", "max_model_len", "seed"}``: this package's engine, in-process. Two engine
  arms that differ only in the verifier (standard vs FLy, same model, draft and dtype) share ONE engine
  started with FLy; the standard arm's requests ask for ``verification="standard"``, which is lossless.
- ``{"kind": "openai", "base_urls": [...], "model", "api_key", "extra_body": {...}, "concurrency",
  "timeout", "max_retries", "backoff"}``: any OpenAI-compatible server (vLLM, flyspec serve).
  ``concurrency`` requests are in flight per base URL; failed requests (connection errors, timeouts,
  HTTP 429/5xx) are retried with exponential backoff on the next base URL; after ``max_retries``
  retries the run stops with a clear error and every answer stored so far is kept.

``kind`` may be omitted: an arm with ``base_url(s)`` is an endpoint, otherwise an engine.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from flyspec.chat import render_chat
from flyspec.gate.datasets import Question

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
_ACCEPTANCE_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_forgiven_tokens")
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


class EndpointError(ConnectionError):
    """An endpoint stayed unreachable or failing after every retry."""


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
    """One question to answer by one arm in one repeat, with its per-question seed."""

    arm: str
    repeat: int
    question: Question
    seed: int

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.arm, self.repeat, self.question.dataset, self.question.id)


@dataclass(frozen=True)
class Completion:
    """What an arm produced for a job, before grading."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    source: str
    acceptance: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineArm:
    """An in-process engine arm; ``config`` holds EngineConfig's fields."""

    name: str
    config: dict[str, Any]

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

    def identity(self) -> dict[str, Any]:
        """What decides the arm's outputs, registered before the run. Where the server runs (URLs) and
        how it is called (concurrency, timeouts, key) may change between a run and its resume."""
        return {"kind": "openai", "model": self.model, "extra_body": self.extra_body}

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


def parse_arm(name: str, spec: dict[str, Any] | str | Path) -> Arm:
    """Validate an arm description; ValueError names the arm, the field, the value and the rule."""
    data = load_arm_spec(spec, name)
    kind = data.get("kind") or ("openai" if ("base_urls" in data or "base_url" in data) else "engine")
    if kind == "engine":
        unknown = sorted(set(data) - set(ENGINE_KEYS))
        if unknown:
            raise ValueError(
                f"arm {name!r}: unknown key(s) {', '.join(unknown)}; "
                f"engine arms take {', '.join(ENGINE_KEYS)}"
            )
        from flyspec.config import EngineConfig, SpeculativeConfig

        fields = {k: v for k, v in data.items() if k != "kind"}
        try:
            config = EngineConfig(**fields)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"arm {name!r}: {exc}") from None
        resolved = {
            "model": config.model,
            "speculative_config": (
                config.speculative_config.to_dict()
                if isinstance(config.speculative_config, SpeculativeConfig)
                else None
            ),
            "dtype": config.dtype,
            "device": config.device,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_model_len": config.max_model_len,
            "seed": config.seed,
        }
        return EngineArm(name, resolved)
    if kind != "openai":
        raise ValueError(f"arm {name!r}: kind={kind!r}: must be 'engine' or 'openai'")
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


OnDone = Callable[[Job, Completion], None]


# ---------------------------------------------------------------------------------------- engine arms


def _engine_key(config: dict[str, Any]) -> str:
    """Everything but the verifier: arms with equal keys can share one engine."""
    spec = config["speculative_config"]
    if spec is not None:
        spec = {k: v for k, v in spec.items() if k != "rejection_sample_method" and not k.startswith("fly_")}
    return json.dumps({**config, "speculative_config": spec}, sort_keys=True)


def _is_fly(config: dict[str, Any]) -> bool:
    spec = config["speculative_config"]
    return spec is not None and spec["rejection_sample_method"] == "fly"


class EngineExecutor:
    """Answers jobs of one or more engine arms with one in-process LLMEngine, driven step by step so that
    each answer is handed over (and stored) the moment it finishes."""

    def __init__(self, config: dict[str, Any], arms: list[EngineArm]) -> None:
        self.config = config
        self.arms = {arm.name: arm for arm in arms}
        # A standard arm inside an engine started with FLy asks for lossless verification per request.
        self.verification = {
            arm.name: ("standard" if _is_fly(config) and not _is_fly(arm.config) else None) for arm in arms
        }
        self._engine: Any = None

    @property
    def shared(self) -> bool:
        return len(self.arms) > 1

    def describe(self) -> str:
        """One line for logs: what this executor runs, for which arms."""
        return f"engine {self.config['model']} for arm(s) {', '.join(self.arms)}"

    def prepare(self) -> Any:
        """Start the engine (load weights) now, so model loading is not timed as answering."""
        if self._engine is None:
            from flyspec.config import EngineConfig, SpeculativeConfig
            from flyspec.engine.engine import LLMEngine

            spec = self.config["speculative_config"]
            # The canonical dict lists every field (defaults resolved): build the dataclass directly, as
            # from_dict refuses keys that only another method would use.
            fields = {**self.config, "speculative_config": SpeculativeConfig(**spec) if spec else None}
            self._engine = LLMEngine(EngineConfig(**fields))
        return self._engine

    def _prompt_ids(self, engine: Any, job: Job) -> tuple[list[int] | str, str | None]:
        question = job.question
        if question.messages is None:
            assert question.prompt is not None
            return question.prompt, None
        try:
            ids, text = render_chat(engine.tokenizer, question.messages)
        except ValueError as exc:
            raise ValueError(
                f"arm {job.arm!r}: model {self.config['model']!r}, dataset {question.dataset!r} is "
                f"chat-formatted: {exc}"
            ) from None
        return ids, text

    def run(self, jobs: list[Job], sampling: Sampling, on_done: OnDone) -> None:
        """Answer ``jobs`` (all in flight at once, batched by the engine's scheduler)."""
        from flyspec.sampling_params import SamplingParams

        engine = self.prepare()
        pending: dict[str, Job] = {}
        try:
            for job in jobs:
                rid = "|".join(str(part) for part in job.key)
                params = SamplingParams(
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    max_tokens=sampling.max_tokens,
                    seed=job.seed,
                    verification=self.verification[job.arm],
                )
                prompt, prompt_text = self._prompt_ids(engine, job)
                try:
                    engine.add_request(rid, prompt, params, prompt_text=prompt_text)
                except ValueError as exc:
                    raise ValueError(
                        f"arm {job.arm!r}, question {job.question.dataset}/{job.question.id}: {exc}"
                    ) from None
                pending[rid] = job
            while pending:
                for out in engine.step():
                    if not out.finished or out.request_id not in pending:
                        continue
                    job = pending.pop(out.request_id)
                    metrics = out.metrics
                    finished = (
                        metrics.finished_time if metrics.finished_time is not None else time.monotonic()
                    )
                    completion = out.outputs[0]
                    on_done(
                        job,
                        Completion(
                            text=completion.text,
                            finish_reason=completion.finish_reason,
                            prompt_tokens=len(out.prompt_token_ids),
                            completion_tokens=len(completion.token_ids),
                            latency_s=max(0.0, finished - metrics.arrival_time),
                            source="engine",
                            acceptance={k: int(getattr(metrics, k)) for k in _ACCEPTANCE_KEYS},
                        ),
                    )
        finally:
            for rid in pending:
                engine.abort_request(rid)


def engine_executors(arms: list[EngineArm]) -> list[EngineExecutor]:
    """Group engine arms into as few engines as possible (SPEC 11.2: share when only the verifier differs)."""
    groups: dict[str, list[EngineArm]] = {}
    for arm in arms:
        groups.setdefault(_engine_key(arm.config), []).append(arm)
    executors: list[EngineExecutor] = []
    for members in groups.values():
        fly_configs = {json.dumps(a.config, sort_keys=True) for a in members if _is_fly(a.config)}
        if len(fly_configs) > 1:
            # Arms with different FLy settings cannot share one engine: give each its own.
            executors.extend(EngineExecutor(a.config, [a]) for a in members)
            continue
        lead = next((a for a in members if _is_fly(a.config)), members[0])
        executors.append(EngineExecutor(lead.config, members))
    return executors


# -------------------------------------------------------------------------------------- endpoint arms


class OpenAIExecutor:
    """Answers jobs of one endpoint arm over HTTP with bounded concurrency per base URL."""

    def __init__(self, arm: OpenAIArm) -> None:
        self.arm = arm
        self.arms = {arm.name: arm}
        self.shared = False

    def prepare(self) -> None:
        """Nothing to start for an endpoint."""

    def describe(self) -> str:
        """One line for logs: what this executor runs, for which arm."""
        return f"endpoint {', '.join(self.arm.base_urls)} (model {self.arm.model}) for arm {self.arm.name}"

    def _body(self, job: Job, sampling: Sampling) -> tuple[str, dict[str, Any]]:
        question = job.question
        body: dict[str, Any] = {
            "model": self.arm.model,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
            "seed": job.seed,
            **self.arm.extra_body,
        }
        if question.messages is not None:
            return "/chat/completions", {**body, "messages": question.messages}
        return "/completions", {**body, "prompt": question.prompt}

    async def _request(
        self,
        client: httpx.AsyncClient,
        job: Job,
        sampling: Sampling,
        first_url: int,
        url_slots: list[asyncio.Semaphore],
    ) -> Completion:
        route, body = self._body(job, sampling)
        urls = self.arm.base_urls
        last_error = ""
        for attempt in range(self.arm.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.arm.backoff * 2 ** (attempt - 1))
            index = (first_url + attempt) % len(urls)
            url = urls[index]
            try:
                # A retry moves to another URL: its own bound applies there too.
                async with url_slots[index]:
                    start = time.monotonic()
                    response = await client.post(url + route, json=body)
            except httpx.TransportError as exc:  # connection refused, reset, DNS, timeouts
                last_error = f"{url}: {type(exc).__name__}: {exc or 'no detail'}"
                continue
            if response.status_code == 429 or response.status_code >= 500:
                last_error = f"{url}: HTTP {response.status_code}: {response.text[:200]}"
                continue
            if response.status_code != 200:
                raise ValueError(
                    f"arm {self.arm.name!r}: {url}{route} rejected the request with HTTP "
                    f"{response.status_code}: {response.text[:500]}"
                )
            return self._parse(response, url, route, time.monotonic() - start)
        raise EndpointError(
            f"arm {self.arm.name!r}: no answer for question {job.question.dataset}/{job.question.id} after "
            f"{self.arm.max_retries + 1} attempt(s); last error: {last_error}. Answers stored so far are "
            "kept; rerun the same command to resume."
        )

    def _parse(self, response: httpx.Response, url: str, route: str, latency: float) -> Completion:
        try:
            data = response.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] if route == "/chat/completions" else choice["text"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(
                f"arm {self.arm.name!r}: {url}{route} returned a body that is not an OpenAI completion "
                f"({type(exc).__name__}: {exc}): {response.text[:300]}"
            ) from None
        usage = data.get("usage") or {}
        # flyspec serve returns acceptance counters in `spec_decode`; accept them in `usage` too.
        extension = data.get("spec_decode") or usage
        acceptance = {k: int(extension[k]) for k in _ACCEPTANCE_KEYS if isinstance(extension.get(k), int)}
        return Completion(
            text=text or "",
            finish_reason=choice.get("finish_reason"),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            latency_s=latency,
            source=url,
            acceptance=acceptance,
        )

    async def _run(self, jobs: list[Job], sampling: Sampling, on_done: OnDone) -> None:
        queue: asyncio.Queue[Job] = asyncio.Queue()
        for job in jobs:
            queue.put_nowait(job)
        headers = {"Authorization": f"Bearer {self.arm.api_key}"} if self.arm.api_key else {}
        slots = self.arm.concurrency * len(self.arm.base_urls)
        limits = httpx.Limits(max_connections=slots, max_keepalive_connections=slots)
        url_slots = [asyncio.Semaphore(self.arm.concurrency) for _ in self.arm.base_urls]
        async with httpx.AsyncClient(timeout=self.arm.timeout, headers=headers, limits=limits) as client:

            async def worker(url_index: int) -> None:
                while not queue.empty():
                    job = queue.get_nowait()
                    completion = await self._request(client, job, sampling, url_index, url_slots)
                    # Runs on the event loop, i.e. in the main thread, where graders may use SIGALRM.
                    on_done(job, completion)

            tasks = [
                asyncio.create_task(worker(i))
                for i in range(len(self.arm.base_urls))
                for _ in range(self.arm.concurrency)
            ]
            try:
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    def run(self, jobs: list[Job], sampling: Sampling, on_done: OnDone) -> None:
        """Answer ``jobs``; each answer is handed to ``on_done`` as it arrives (in the main thread)."""
        asyncio.run(self._run(jobs, sampling, on_done))


Executor = EngineExecutor | OpenAIExecutor


def make_executors(arms: list[Arm]) -> list[Executor]:
    """One executor per endpoint arm; engine arms grouped into as few in-process engines as possible."""
    engines = engine_executors([a for a in arms if isinstance(a, EngineArm)])
    endpoints = [OpenAIExecutor(a) for a in arms if isinstance(a, OpenAIArm)]
    return [*engines, *endpoints]
