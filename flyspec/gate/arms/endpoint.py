"""Endpoint arms: answer gate jobs through an OpenAI-compatible server (vLLM, flyspec serve); docs/gate.md,
"Arms", says what an arm takes, how failed requests are retried and which served model is registered.

Per-request acceptance counters are read where the server reports them: flyspec serve's ``spec_decode``
object (all four counters), vLLM's ``metrics.speculative_decoding`` with
``--per-request-spec-decode-metrics`` (no forgiven count); otherwise they are stored as NULL and the
report says "not reported", never zero.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypedDict

import httpx

from flyspec.checks import is_int, is_number
from flyspec.gate.arms.base import (
    Completion,
    Emit,
    Job,
    NextJob,
    Sampling,
    Served,
    ServedModel,
    Settings,
    unknown_keys,
)
from flyspec.outputs import AcceptanceCounts

KIND = "openai"
KEYS = (
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
class OpenAIArm:
    """An OpenAI-compatible endpoint arm."""

    name: str
    base_urls: tuple[str, ...]
    model: str
    api_key: str | None = None
    extra_body: Settings = field(default_factory=dict)
    concurrency: int = 4
    timeout: float = 600.0
    max_retries: int = 4
    backoff: float = 1.0
    kind = KIND
    greedy_repeats = False  # a server may batch and sample differently each time
    settings_visible = False  # the server decides what it runs
    speculative_config = None

    def variant(self, name: str, speculative_config: Settings) -> OpenAIArm:
        """An endpoint runs what its server was started with: a setting needs its own server."""
        raise ValueError(
            f"arm {self.name!r} is an endpoint, whose server runs one speculative config: give each setting "
            'its own server, as {"arm": {...}, "speculative_config": {...}}'
        )

    def identity(self, served: ServedModel | None = None) -> Settings:
        """What decides the arm's outputs, registered before the run: the model name, the extra request
        fields and the served model's ``id`` and ``root`` as the server's /v1/models reports them. Where
        the server runs (URLs) and how it is called (concurrency, timeouts, key) may change on a resume
        and are kept in the run's notes instead."""
        out: Settings = {"kind": KIND, "model": self.model, "extra_body": self.extra_body}
        if served is not None:
            out["served_model"] = served
        return out

    def public_dict(self) -> Settings:
        """The arm's full settings; the API key is never written, only whether one is set."""
        return {
            "kind": KIND,
            "base_urls": list(self.base_urls),
            "model": self.model,
            "api_key": "<set>" if self.api_key else None,
            "extra_body": self.extra_body,
            "concurrency": self.concurrency,
            "timeout": self.timeout,
            "max_retries": self.max_retries,
            "backoff": self.backoff,
        }


def _normalise_url(url: object, name: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"arm {name!r}: base_url={url!r}: must be an http:// or https:// URL")
    url = url.rstrip("/")
    # OpenAI clients take the base URL including /v1; accept a bare host:port as well.
    return url if url.endswith("/v1") else url + "/v1"


def parse(name: str, data: Settings) -> OpenAIArm:
    """An endpoint arm from its JSON object; ValueError names the arm, the field and the rule."""
    unknown_keys(f"arm {name!r}", data, KEYS, "endpoint arms take")
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
    if not is_int(arm.concurrency, 1):
        raise ValueError(f"arm {name!r}: concurrency={arm.concurrency!r}: must be a positive integer")
    for key, value in (("timeout", arm.timeout), ("backoff", arm.backoff)):
        if not is_number(value, above=0):
            raise ValueError(f"arm {name!r}: {key}={value!r}: must be a positive number")
    if not is_int(arm.max_retries, 0):
        raise ValueError(f"arm {name!r}: max_retries={arm.max_retries!r}: must be an integer >= 0")
    return arm


# The response header in which flyspec serve names the request fields it ignored.
IGNORED_FIELDS_HEADER = "x-flyspec-ignored-fields"


class EndpointError(ConnectionError):
    """An endpoint stayed unreachable or failing after every retry."""


def retry_reason(response: httpx.Response, url: str, who: str, where: str) -> str | None:
    """The one retry policy of every endpoint call (arms and judge): a reason to retry for 429 and 5xx,
    None for 200, and a ValueError naming `who` and `where` for any other status (a request the server
    will never accept, so retrying would only repeat it)."""
    if response.status_code == 429 or response.status_code >= 500:
        return f"{url}: HTTP {response.status_code}: {response.text[:200]}"
    if response.status_code != 200:
        raise ValueError(
            f"{who}: {where} rejected the request with HTTP {response.status_code}: {response.text[:500]}"
        )
    return None


_VLLM_COUNTERS = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens")


def read_acceptance(data: Mapping[str, object]) -> tuple[AcceptanceCounts | None, bool]:
    """Acceptance counters of one response and whether the forgiven count was among them."""
    extension = data.get("spec_decode")
    if isinstance(extension, dict):
        counts = AcceptanceCounts.from_mapping(extension)
        if counts is not None:
            return counts, True
    metrics = data.get("metrics")
    spec = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if isinstance(spec, dict):
        values = [spec.get(k) for k in _VLLM_COUNTERS]
        if all(is_int(v) for v in values):
            steps, drafted, accepted = values
            return AcceptanceCounts(steps, drafted, accepted, 0), False  # type: ignore[arg-type]
    return None, False


class ModelCard(TypedDict):
    """One base URL's /v1/models card of the arm's model: its ``id`` and ``root`` as the server wrote them,
    and whether the server reports its models at all (``reported``)."""

    id: object
    root: object
    reported: bool


class OpenAIExecutor:
    """Answers the jobs of one endpoint arm over HTTP with bounded concurrency per base URL (a
    ``ConcurrentExecutor``: flyspec/gate/arms/base.py)."""

    drive = "concurrently"

    def __init__(self, arm: OpenAIArm) -> None:
        self.arm = arm
        self.arms = {arm.name: arm}
        self.shared = False
        self.served: dict[str, ModelCard] = {}

    def describe(self) -> str:
        return f"endpoint {', '.join(self.arm.base_urls)} (model {self.arm.model}) for arm {self.arm.name}"

    @property
    def max_in_flight(self) -> int:
        return self.arm.concurrency * len(self.arm.base_urls)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.arm.api_key}"} if self.arm.api_key else {}

    def served_models(self) -> Served:
        """The arm's served model (``id`` and ``root``), read now from every base URL's /v1/models card;
        ValueError when a URL does not serve the arm's model or two URLs serve different models."""
        with httpx.Client(timeout=min(self.arm.timeout, 30.0), headers=self._headers()) as client:
            for url in self.arm.base_urls:
                self.served[url] = self._model_card(client, url)
        cards = {(c["id"], c["root"]) for c in self.served.values()}
        if len(cards) > 1:
            listing = "; ".join(f"{u}: id {c['id']}, root {c['root']}" for u, c in self.served.items())
            raise ValueError(f"arm {self.arm.name!r}: its base URLs serve different models ({listing})")
        (served_id, root), *_ = cards
        return {self.arm.name: {"id": served_id, "root": root}}

    def _model_card(self, client: httpx.Client, url: str) -> ModelCard:
        last_error = ""
        for attempt in range(self.arm.max_retries + 1):
            if attempt:
                time.sleep(self.arm.backoff * 2 ** (attempt - 1))
            try:
                response = client.get(url + "/models")
            except httpx.TransportError as exc:
                last_error = f"{type(exc).__name__}: {exc or 'no detail'}"
                continue
            if response.status_code == 429 or response.status_code >= 500:
                last_error = f"HTTP {response.status_code}"
                continue
            return self._card_from(url, response)
        raise EndpointError(
            f"arm {self.arm.name!r}: {url}/models unreachable after {self.arm.max_retries + 1} attempt(s) "
            f"({last_error}); start the server or fix base_url"
        )

    def _card_from(self, url: str, response: httpx.Response) -> ModelCard:
        try:
            cards = response.json()["data"] if response.status_code == 200 else None
        except (ValueError, KeyError, TypeError):
            cards = None
        if not isinstance(cards, list):  # a server without /v1/models: the arm is known by name only
            return {"id": None, "root": None, "reported": False}
        ids = [c.get("id") for c in cards if isinstance(c, dict)]
        card = next((c for c in cards if isinstance(c, dict) and c.get("id") == self.arm.model), None)
        if card is None:
            raise ValueError(
                f"arm {self.arm.name!r}: {url} serves model(s) {', '.join(map(str, ids)) or 'none'}, "
                f"not {self.arm.model!r}; set the arm's model to one of them"
            )
        return {"id": card.get("id"), "root": card.get("root"), "reported": True}

    def start(self) -> None:
        """Nothing to load: the server is running."""

    def take_prefix_cache(self) -> None:
        """A server's prefix cache is its own business (see its /metrics)."""
        return None

    def facts(self) -> dict[str, object]:
        return {
            "kind": KIND,
            "arms": [self.arm.name],
            "base_urls": list(self.arm.base_urls),
            "models": self.served,
            "max_in_flight": self.max_in_flight,
        }

    # ------------------------------------------------------------------------------------- answering

    def _body(self, job: Job, sampling: Sampling) -> tuple[str, Settings]:
        question = job.question
        body: Settings = {
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
            reason = retry_reason(response, url, f"arm {self.arm.name!r}", url + route)
            if reason is not None:
                last_error = reason
                continue
            self._refuse_ignored_settings(response, url, route)
            return self._parse(response, url, route, time.monotonic() - start)
        raise EndpointError(
            f"arm {self.arm.name!r}: no answer for question {job.question.dataset}/{job.question.id} after "
            f"{self.arm.max_retries + 1} attempt(s); last error: {last_error}. Answers stored so far are "
            "kept; rerun the same command to resume."
        )

    def _refuse_ignored_settings(self, response: httpx.Response, url: str, route: str) -> None:
        """Stop when the server ignored one of this arm's extra_body settings.

        Servers ignore unknown fields (vLLM and flyspec alike), so a misspelt setting such as
        `verfication` would silently run a different configuration than the one registered. flyspec serve
        names what it ignored in a response header; vLLM only logs it, so there the check cannot run.
        """
        header = response.headers.get(IGNORED_FIELDS_HEADER)
        if not header:
            return
        ignored = {name.strip() for name in header.split(",")}
        mine = sorted(key for key in self.arm.extra_body if key in ignored)
        if mine:
            raise ValueError(
                f"arm {self.arm.name!r}: {url}{route} ignored the arm's extra_body setting(s) "
                f"{', '.join(mine)} (unknown to it, or without effect there), so the arm would not run the "
                "configuration that was registered; fix the spelling or remove them"
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
        acceptance, forgiven_reported = read_acceptance(data)
        fingerprint = data.get("system_fingerprint")
        return Completion(
            text=text or "",
            finish_reason=choice.get("finish_reason"),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            latency_s=latency,
            source=url,
            acceptance=acceptance,
            forgiven_reported=forgiven_reported,
            system_fingerprint=fingerprint if isinstance(fingerprint, str) else None,
        )

    async def serve(self, next_job: NextJob, sampling: Sampling, emit: Emit) -> None:
        """Answer jobs until ``next_job`` returns None; every answer goes to ``emit`` as it arrives.

        ``concurrency`` workers per base URL each take the next job when their last one is answered, so
        the server always has that many requests; an error stops this arm after the other workers have
        finished (and emitted) the requests they already sent.
        """
        slots = self.max_in_flight
        limits = httpx.Limits(max_connections=slots, max_keepalive_connections=slots)
        url_slots = [asyncio.Semaphore(self.arm.concurrency) for _ in self.arm.base_urls]
        failures: list[BaseException] = []
        async with httpx.AsyncClient(
            timeout=self.arm.timeout, headers=self._headers(), limits=limits
        ) as client:

            async def worker(url_index: int) -> None:
                while not failures and (job := await next_job()) is not None:
                    try:
                        completion = await self._request(client, job, sampling, url_index, url_slots)
                    except Exception as exc:  # handed to the run, which stops every arm cleanly
                        failures.append(exc)
                        return
                    emit(job, completion)

            await asyncio.gather(
                *(worker(i) for i in range(len(self.arm.base_urls)) for _ in range(self.arm.concurrency))
            )
        if failures:
            raise failures[0]


def executors(arms: list[OpenAIArm]) -> list[OpenAIExecutor]:
    """One executor per endpoint arm."""
    return [OpenAIExecutor(arm) for arm in arms]
