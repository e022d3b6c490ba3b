"""Engine-wide counters: acceptance, tokens, prefix cache, preemptions (read by the server's /metrics, the
benchmarks and `LLM.stats`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from flyspec.outputs import AcceptanceRates


@dataclass
class SpecDecodeStats(AcceptanceRates):
    """Cumulative counters since the engine started (plain integers, bumped once per verified row; the
    server's /metrics reads and diffs them by name).

    accepted_per_position[i] counts verification steps whose i-th draft token was kept (forgiven
    tokens included); its length is K (0 without speculation).

    prefix_cache_queries / prefix_cache_hits: prompt tokens of admitted requests looked up in the prefix
    cache, and those found there (vLLM's counters, in tokens): each hit is a prompt token whose K/V was
    shared, so the target (and a same-vocabulary draft) did not prefill it. num_preemptions: running
    requests sent back to the queue for lack of KV blocks. kv_cache_usage: fraction of the KV cache's
    blocks held by requests after the last step (a gauge, not a counter).
    """

    num_speculative_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_forgiven_tokens: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    kv_cache_usage: float = 0.0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record_verification(self, num_draft_tokens: int, num_accepted: int, num_forgiven: int) -> None:
        """Count one request's verification step (called once per row; rows without drafts too)."""
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_forgiven_tokens += num_forgiven
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1
