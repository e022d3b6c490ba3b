"""Response bodies in the OpenAI wire format, with vLLM's `stop_reason` and one flyspec extension,
`spec_decode`, carrying the request's acceptance counters."""

from __future__ import annotations

import time
from typing import Any

from flyspec.outputs import CompletionOutput, RequestMetrics, RequestOutput


def stop_reason(
    output: CompletionOutput, stop: list[str], stop_token_ids: list[int], decoded: str | None
) -> str | int | None:
    """What ended a choice with finish_reason "stop", as vLLM reports it: the stop string that matched, the
    stop token id, or None (end-of-sequence, or any other finish reason).

    `decoded` is the text of all generated token ids: the engine cuts a matched stop string from the text
    but keeps its tokens, so the stop string is what follows the text there. None when no stop string was
    asked for.
    """
    if output.finish_reason != "stop":
        return None
    if decoded is not None and decoded.startswith(output.text):
        rest = decoded[len(output.text) :]
        matched = [s for s in stop if rest.startswith(s)]
        if matched:
            return max(matched, key=len)
    if output.token_ids and output.token_ids[-1] in stop_token_ids:
        return output.token_ids[-1]
    return None


def spec_decode_json(metrics: RequestMetrics | list[RequestMetrics]) -> dict[str, int]:
    """The `spec_decode` response extension: acceptance counters summed over the request's choices."""
    items = metrics if isinstance(metrics, list) else [metrics]
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_forgiven_tokens")
    return {k: sum(int(getattr(m, k)) for m in items) for k in keys}


def usage_json(outputs: list[RequestOutput]) -> dict[str, int]:
    """The OpenAI `usage` object over the final outputs: each prompt counted once, every sample's tokens."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_json(
    request_id: str,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, int],
    spec_decode: dict[str, int],
    system_fingerprint: str,
) -> dict[str, Any]:
    """A non-streaming /v1/completions response."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": system_fingerprint,
        "choices": choices,
        "usage": usage,
        "spec_decode": spec_decode,
    }


def chat_json(
    request_id: str,
    model: str,
    choices: list[dict[str, Any]],
    usage: dict[str, int],
    spec_decode: dict[str, int],
    system_fingerprint: str,
    prompt_logprobs: list[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """A non-streaming /v1/chat/completions response (vLLM's `prompt_logprobs` when asked)."""
    body = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": system_fingerprint,
        "choices": choices,
        "usage": usage,
        "spec_decode": spec_decode,
    }
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    return body
