"""The server's KV cache metrics (vLLM's names with the flyspec: prefix): prefix cache queries and hits,
tokens per engine step, KV cache usage and preemptions, over a real uvicorn server on loopback."""

from __future__ import annotations

import httpx
import test_server_bounds
from prometheus_client.parser import text_string_to_metric_families
from test_server_bounds import MODEL, Server

from flyspec.engine.kv_blocks import BLOCK_SIZE

server = test_server_bounds.server  # one tiny server (n-gram drafting, K = 2) for this module


def _metrics(server: Server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("model_name") == MODEL and "le" not in s.labels
    }


def test_a_prompt_sent_twice_shows_prefix_cache_hits_and_step_tokens(server: Server) -> None:
    """The same 40-token prompt twice: the second request's lookup finds its first two blocks (32 tokens),
    both lookups count all 40 prompt tokens as queries, every step that computed tokens is one
    observation of iteration_tokens_total (whose sum is the prompt tokens prefilled plus the tokens
    generated), and when both have finished the KV cache holds no block for them and nothing was
    preempted."""
    prompt = [5 + i for i in range(40)]
    before = _metrics(server)
    for _ in range(2):
        r = server.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4})
        assert r.status_code == 200, r.text
    after = _metrics(server)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("flyspec:prefix_cache_queries_total") == 80
    assert delta("flyspec:prefix_cache_hits_total") == (40 - 1) // BLOCK_SIZE * BLOCK_SIZE == 32
    assert delta("flyspec:prompt_tokens_total") == 80 - 32
    assert delta("flyspec:iteration_tokens_total_sum") == 80 - 32 + 8
    assert delta("flyspec:iteration_tokens_total_count") >= 2
    assert after["flyspec:kv_cache_usage_perc"] == 0
    assert after["flyspec:num_preemptions_total"] == 0
