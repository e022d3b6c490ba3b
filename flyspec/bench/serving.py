"""The serving benchmark's client: one load generator for every OpenAI-compatible server.

Every request is the same for every server: the prompt as token ids on /v1/completions (so no server's
own chat template or tokenizer changes the input), streamed, greedy, `max_tokens` new tokens with
`ignore_eos` (vLLM's and llama.cpp's name for it, and flyspec's), and usage in the last chunk. A server
that ignores `ignore_eos` and stops early is not padded: its requests are counted as `short` and its
tokens/s use the tokens it really sent. `concurrency` workers keep that many requests in flight until
the level's requests are done. Timings follow `vllm bench serve`: time to first token (TTFT), the gaps
between streamed chunks (ITL; a speculative server may send several tokens in one chunk), time per
output token after the first (TPOT), end-to-end latency, and aggregate output tokens/s over the wall
time of the level.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

# A request may wait behind a full batch (32 prompts on 2 cores): long, but never endless.
READ_TIMEOUT_S = 1800.0


@dataclass
class RequestResult:
    """What one streamed request measured; `error` is set (and the timings are partial) when it failed."""

    prompt_tokens: int
    max_tokens: int
    sent_at_s: float = 0.0  # from the start of its level
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    chunk_gaps_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    tokens_from_usage: bool = False
    error: str | None = None


@dataclass
class LevelResult:
    """All requests of one (arm, concurrency) run and the wall time from the first send to the last end."""

    concurrency: int
    wall_s: float
    requests: list[RequestResult]


def completion_body(
    model: str, prompt_ids: list[int], max_tokens: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The /v1/completions request every server gets: token-id prompt, greedy, fixed length, streamed."""
    return {
        "model": model,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }


async def stream_one(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    level_start: float | None = None,
) -> RequestResult:
    """Send one streamed completion and time it; server and transport errors land in `error`."""
    start = time.perf_counter()
    result = RequestResult(
        prompt_tokens=len(body["prompt"]),
        max_tokens=body["max_tokens"],
        sent_at_s=start - (start if level_start is None else level_start),
    )
    chunks = 0
    last: float | None = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])[:300]
                    break
                now = time.perf_counter()
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        if last is None:
                            result.ttft_s = now - start
                        else:
                            result.chunk_gaps_s.append(now - last)
                        last = now
                        chunks += 1
                    if choice.get("finish_reason"):
                        result.finish_reason = choice["finish_reason"]
                usage = event.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    result.output_tokens = int(usage["completion_tokens"])
                    result.tokens_from_usage = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.e2e_s = time.perf_counter() - start
    if not result.tokens_from_usage:
        result.output_tokens = chunks  # a lower bound when a chunk carries several tokens
    return result


async def run_level(
    url: str,
    model: str,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    extra_body: dict[str, Any] | None = None,
    api_key: str | None = None,
) -> LevelResult:
    """Send one request per prompt with `concurrency` in flight at a time, in prompt order."""
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency}: must be >= 1")
    if not prompts:
        raise ValueError("the prompt list is empty")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(prompts)):
        queue.put_nowait(i)
    results: list[RequestResult | None] = [None] * len(prompts)
    timeout = httpx.Timeout(30.0, read=READ_TIMEOUT_S)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                body = completion_body(model, prompts[i], max_tokens, extra_body)
                results[i] = await stream_one(client, url, body, headers, start)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
        wall = time.perf_counter() - start
    return LevelResult(concurrency, wall, [r for r in results if r is not None])


def run_level_sync(*args: Any, **kwargs: Any) -> LevelResult:
    """`run_level` from synchronous code (its own event loop)."""
    return asyncio.run(run_level(*args, **kwargs))


def served_model(url: str, api_key: str | None = None) -> str:
    """The first model id the server lists at /v1/models (the name requests must carry)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    response = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    data = response.json().get("data") or []
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model")
    return str(data[0]["id"])


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(level: LevelResult) -> dict[str, Any]:
    """Aggregate and per-request figures of one level (only successful requests count in timings)."""
    ok = [r for r in level.requests if r.error is None]
    tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok]
    gaps = [g for r in ok for g in r.chunk_gaps_s]
    tpot = [
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)
        for r in ok
        if r.ttft_s is not None and r.output_tokens > 1
    ]
    per_request = [r.output_tokens / r.e2e_s for r in ok if r.e2e_s > 0]
    chunks = sum(len(r.chunk_gaps_s) + (r.ttft_s is not None) for r in ok)
    return {
        "concurrency": level.concurrency,
        "requests": len(level.requests),
        "errors": len(level.requests) - len(ok),
        "first_error": next((r.error for r in level.requests if r.error), None),
        "short_requests": sum(r.output_tokens < r.max_tokens for r in ok),
        "tokens_counted_from": "usage" if ok and all(r.tokens_from_usage for r in ok) else "chunks",
        "output_tokens": tokens,
        "wall_s": level.wall_s,
        "tokens_per_s": tokens / level.wall_s if level.wall_s > 0 else None,
        "per_request_tokens_per_s": _mean(per_request),
        "tokens_per_chunk": tokens / chunks if chunks else None,
        "ttft_mean_s": _mean(ttft),
        "ttft_median_s": _percentile(ttft, 0.5),
        "ttft_p99_s": _percentile(ttft, 0.99),
        "itl_mean_s": _mean(gaps),
        "itl_p99_s": _percentile(gaps, 0.99),
        "tpot_mean_s": _mean(tpot),
        "e2e_mean_s": _mean(e2e),
        "e2e_p99_s": _percentile(e2e, 0.99),
    }


def level_json(level: LevelResult) -> dict[str, Any]:
    """The level's summary plus every request's measurements (chunk gaps as a count, to keep it small)."""

    def one(r: RequestResult) -> dict[str, Any]:
        fields = asdict(r)
        fields["chunks"] = len(fields.pop("chunk_gaps_s")) + (r.ttft_s is not None)
        return fields

    return {**summarize(level), "per_request": [one(r) for r in level.requests]}


_SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_counters(url: str) -> dict[str, float] | None:
    """The server's speculative-decoding counters from /metrics, summed over labels (flyspec's
    `flyspec:spec_decode_*` and vLLM's `vllm:spec_decode_*` share the names); None when it exports none."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = httpx.get(f"{url}/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                for name in _SPEC_COUNTERS:
                    if sample.name.endswith(f"spec_decode_{name}_total"):
                        totals[name] = totals.get(name, 0.0) + sample.value
    except ValueError:  # a /metrics page that is not Prometheus text
        return None
    return totals or None


def acceptance(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float | None]:
    """Mean acceptance length (1 + accepted per draft) and acceptance rate over a level, from the
    counters before and after it; None where the server does not count."""
    if not before or not after:
        return {"mean_acceptance_length": None, "acceptance_rate": None}
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _SPEC_COUNTERS}
    drafts, drafted, accepted = delta["num_drafts"], delta["num_draft_tokens"], delta["num_accepted_tokens"]
    return {
        "mean_acceptance_length": 1 + accepted / drafts if drafts > 0 else None,
        "acceptance_rate": accepted / drafted if drafted > 0 else None,
    }
