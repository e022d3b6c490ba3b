"""What the engine hands back for each request (mirrors vLLM's RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class RequestMetrics:
    """Per-request speculative-decoding counters and timestamps (seconds, time.monotonic()).

    num_drafts counts verification steps that had at least one draft token; forgiven tokens (FLy) are
    included in num_accepted_tokens and also counted in num_forgiven_tokens. forgiven_positions lists
    the indices into the generated token ids that FLy forgave.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_forgiven_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    forgiven_positions: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verification step: 1 + accepted / drafts (1.0 without drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Share of draft tokens kept (0.0 without drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass
class CompletionOutput:
    """One generated sequence: cumulative text and token ids so far."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None


@dataclass
class RequestOutput:
    """The state of one request after an engine step (cumulative, not a delta)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
