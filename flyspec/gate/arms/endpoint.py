"""Endpoint arms: OpenAI-compatible servers (vLLM, flyspec serve), asked through ``EndpointClient`` (the
judge's requests too); docs/gate.md, "Arms". Acceptance counters are read where the server reports them per
request (flyspec serve's ``spec_decode``, vLLM's ``metrics.speculative_decoding``), otherwise stored as
NULL: "not reported", never zero.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from contextlib import aclosing
from dataclasses import dataclass, field, fields, replace

import httpx

from flyspec.checks import is_int, is_number
from flyspec.gate.arms.base import (
    Completion,
    Emit,
    NextJob,
    Sampling,
    Served,
    ServedModel,
    Settings,
    unknown_keys,
)
from flyspec.outputs import AcceptanceCounts

KIND = "openai"
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
# The response header in which flyspec serve names the request fields it ignored.
IGNORED_FIELDS_HEADER = "x-flyspec-ignored-fields"


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
        """The model name, the extra request fields and the served model's ``id`` and ``root``. Where the
        server runs (URLs) and how it is called may change on a resume and are kept in the notes."""
        out: Settings = {"kind": KIND, "model": self.model, "extra_body": self.extra_body}
        if served is not None:
            out["served_model"] = served
        return out

    def public_dict(self) -> Settings:
        """The arm's full settings; the API key is never written, only whether one is set."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "name"}
        return {
            "kind": KIND,
            **values,
            "base_urls": list(self.base_urls),
            "api_key": "<set>" if self.api_key else None,
        }


KEYS = ("kind", "base_url", *(f.name for f in fields(OpenAIArm) if f.name != "name"))


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
    calls = {k: data[k] for k in ("concurrency", "timeout", "max_retries", "backoff") if k in data}
    arm = OpenAIArm(name, tuple(_normalise_url(u, name) for u in urls), model, api_key, extra, **calls)
    if not is_int(arm.concurrency, 1):
        raise ValueError(f"arm {name!r}: concurrency={arm.concurrency!r}: must be a positive integer")
    for key, value in (("timeout", arm.timeout), ("backoff", arm.backoff)):
        if not is_number(value, above=0):
            raise ValueError(f"arm {name!r}: {key}={value!r}: must be a positive number")
    if not is_int(arm.max_retries, 0):
        raise ValueError(f"arm {name!r}: max_retries={arm.max_retries!r}: must be an integer >= 0")
    return arm


class EndpointError(ConnectionError):
    """An endpoint stayed unreachable or failing after every retry."""


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
        values = [spec.get(k) for k in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens")]
        if all(is_int(v) for v in values):
            steps, drafted, accepted = values
            return AcceptanceCounts(steps, drafted, accepted, 0), False  # type: ignore[arg-type]
    return None, False


class EndpointClient:
    """The requests of one endpoint (``who``: ``arm 'x'`` or ``judge``) on one event loop: at most
    ``concurrency`` in flight per base URL; connection errors, timeouts, HTTP 429 and 5xx are retried with
    backoff on the next URL."""

    def __init__(self, arm: OpenAIArm, who: str) -> None:
        self.arm = arm
        self.who = who
        slots = arm.concurrency * len(arm.base_urls)
        self.http = httpx.AsyncClient(
            timeout=arm.timeout,
            headers={"Authorization": f"Bearer {arm.api_key}"} if arm.api_key else {},
            limits=httpx.Limits(max_connections=slots, max_keepalive_connections=slots),
        )
        self.url_slots = [asyncio.Semaphore(arm.concurrency) for _ in arm.base_urls]

    async def aclose(self) -> None:
        await self.http.aclose()

    async def send(
        self, route: str, body: Settings | None, first: int, failure: str
    ) -> tuple[str, httpx.Response, float]:
        """The URL, response and latency of the first attempt not to be retried: a POST of ``body`` (a GET
        when None) to base URL ``first``, a retry to the next one. EndpointError says ``failure`` when every
        attempt failed."""
        urls = self.arm.base_urls
        last_error = ""
        for attempt in range(self.arm.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.arm.backoff * 2 ** (attempt - 1))
            index = (first + attempt) % len(urls)
            url = urls[index]
            try:
                async with self.url_slots[index]:
                    start = time.monotonic()
                    response = await self.http.request(
                        "GET" if body is None else "POST", url + route, json=body
                    )
            except httpx.TransportError as exc:  # connection refused, reset, DNS, timeouts
                last_error = f"{url}: {type(exc).__name__}: {exc or 'no detail'}"
                continue
            if response.status_code == 429 or response.status_code >= 500:
                last_error = f"{url}: HTTP {response.status_code}: {response.text[:200]}"
                continue
            return url, response, time.monotonic() - start
        raise EndpointError(
            f"{self.who}: {failure} after {self.arm.max_retries + 1} attempt(s); last error: {last_error}. "
            "What is stored so far is kept; start the server or fix base_url, then rerun the same command "
            "to resume."
        )

    async def complete(self, route: str, body: Settings, first: int, failure: str) -> Completion:
        """``send``, read as a completion; ValueError for a status the server will never accept (retrying
        would only repeat it), a body that is not a completion, or an ``extra_body`` setting the server
        ignored."""
        url, response, latency = await self.send(route, body, first, failure)
        if response.status_code != 200:
            raise ValueError(
                f"{self.who}: {url}{route} rejected the request with HTTP {response.status_code}: "
                f"{response.text[:500]}"
            )
        # Servers ignore unknown fields, so a misspelt setting would silently run another configuration
        # than the one registered; flyspec serve names them in a header (vLLM only logs them).
        ignored = {name.strip() for name in response.headers.get(IGNORED_FIELDS_HEADER, "").split(",")}
        mine = sorted(key for key in self.arm.extra_body if key in ignored)
        if mine:
            raise ValueError(
                f"{self.who}: {url}{route} ignored the extra_body setting(s) {', '.join(mine)} (unknown to "
                "it, or without effect there), so it would not run the configuration that was registered; "
                "fix the spelling or remove them"
            )
        try:
            data = response.json()
            choice = data["choices"][0]
            text = choice["message"]["content"] if route == "/chat/completions" else choice["text"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(
                f"{self.who}: {url}{route} returned a body that is not an OpenAI completion "
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


class OpenAIExecutor:
    """Answers the jobs of one endpoint arm (a ``ConcurrentExecutor``: flyspec/gate/arms/base.py)."""

    drive = "concurrently"
    shared = False

    def __init__(self, arm: OpenAIArm) -> None:
        self.arm = arm
        self.arms = {arm.name: arm}
        self.served: dict[str, Settings] = {}

    def describe(self) -> str:
        return f"endpoint {', '.join(self.arm.base_urls)} (model {self.arm.model}) for arm {self.arm.name}"

    @property
    def max_in_flight(self) -> int:
        return self.arm.concurrency * len(self.arm.base_urls)

    def served_models(self) -> Served:
        """The arm's served model (``id`` and ``root``), read now from every base URL's /v1/models card;
        ValueError when a URL does not serve the arm's model or two URLs serve different models."""
        self.served = asyncio.run(self._model_cards())
        cards = {(c["id"], c["root"]) for c in self.served.values()}
        if len(cards) > 1:
            listing = "; ".join(f"{u}: id {c['id']}, root {c['root']}" for u, c in self.served.items())
            raise ValueError(f"arm {self.arm.name!r}: its base URLs serve different models ({listing})")
        (served_id, root), *_ = cards
        return {self.arm.name: {"id": served_id, "root": root}}

    async def _model_cards(self) -> dict[str, Settings]:
        """Each base URL's card of the arm's model: ``id`` and ``root`` as the server wrote them, and
        whether it reports its models at all (``reported``)."""
        cards: dict[str, Settings] = {}
        for url in self.arm.base_urls:  # each URL asked itself: a retry must not read another's card
            arm = replace(self.arm, base_urls=(url,), timeout=min(self.arm.timeout, 30.0))
            async with aclosing(EndpointClient(arm, f"arm {arm.name!r}")) as client:
                _, response, _ = await client.send("/models", None, 0, f"{url}/models unreachable")
            try:
                listed = response.json()["data"] if response.status_code == 200 else None
            except (ValueError, KeyError, TypeError):
                listed = None
            if not isinstance(listed, list):  # no /v1/models: the arm is known by name only
                cards[url] = {"id": None, "root": None, "reported": False}
                continue
            card = next((c for c in listed if isinstance(c, dict) and c.get("id") == arm.model), None)
            if card is None:
                ids = ", ".join(str(c.get("id")) for c in listed if isinstance(c, dict)) or "none"
                raise ValueError(
                    f"arm {arm.name!r}: {url} serves model(s) {ids}, not {arm.model!r}; set the arm's model "
                    "to one of them"
                )
            cards[url] = {"id": card.get("id"), "root": card.get("root"), "reported": True}
        return cards

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

    async def serve(self, next_job: NextJob, sampling: Sampling, emit: Emit) -> None:
        """``concurrency`` workers per base URL each take the next job when their last one is answered, so
        the server always has that many requests; an error stops this arm after the other workers have
        finished (and emitted) the requests they already sent."""
        failures: list[BaseException] = []
        async with aclosing(EndpointClient(self.arm, f"arm {self.arm.name!r}")) as client:

            async def worker(url_index: int) -> None:
                while not failures and (job := await next_job()) is not None:
                    body: Settings = {
                        "model": self.arm.model,
                        "temperature": sampling.temperature,
                        "top_p": sampling.top_p,
                        "max_tokens": sampling.max_tokens,
                        "seed": job.seed,
                        **self.arm.extra_body,
                    }
                    q = job.question
                    route, body = (
                        ("/chat/completions", {**body, "messages": q.messages})
                        if q.messages is not None
                        else ("/completions", {**body, "prompt": q.prompt})
                    )
                    try:
                        completion = await client.complete(
                            route, body, url_index, f"no answer for question {q.dataset}/{q.id}"
                        )
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
