"""What the engine hands back for each request (mirrors vLLM's RequestOutput)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from flyspec.checks import is_int

FinishReason = Literal["stop", "length", "abort", "error"]
"""Why a sequence ended: a stop condition, a length limit, an abort, or an error in this request alone
(RequestOutput.error says what; the other requests of the batch are unaffected)."""

ACCEPTANCE_FIELDS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_forgiven_tokens")


@dataclass(frozen=True)
class AcceptanceCounts:
    """Speculative-decoding counters of one request, one arm or one engine, and the rates built on them.

    num_drafts counts verification steps that had at least one draft token; tokens a lossy policy forgave are
    included in num_accepted_tokens and also counted in num_forgiven_tokens. Counts add up (`a + b`).
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_forgiven_tokens: int = 0

    def __add__(self, other: AcceptanceCounts) -> AcceptanceCounts:
        return AcceptanceCounts(*(getattr(self, f) + getattr(other, f) for f in ACCEPTANCE_FIELDS))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verification step: 1 + accepted / drafts (1.0 without drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        """Share of draft tokens kept (0.0 without drafts)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def forgiven_share(self) -> float:
        """Share of kept draft tokens that only a lossy policy's rule kept (0.0 when none were kept)."""
        return self.num_forgiven_tokens / self.num_accepted_tokens if self.num_accepted_tokens else 0.0

    def to_dict(self) -> dict[str, int]:
        """The four counters by name."""
        return {f: getattr(self, f) for f in ACCEPTANCE_FIELDS}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> AcceptanceCounts | None:
        """Counters read from a mapping that holds all four as integers (e.g. a server's response), else
        None: a source that does not report them must not read as zero acceptance."""
        values = [data.get(f) for f in ACCEPTANCE_FIELDS]
        if not all(is_int(v) for v in values):
            return None
        return cls(*values)  # type: ignore[arg-type]


class AcceptanceRates:
    """`counts` and its rates for a record that keeps the four counters as plain integer attributes (so an
    engine step bumps integers and builds no object; the typed value is made when someone reads it)."""

    @property
    def counts(self) -> AcceptanceCounts:
        """The four acceptance counters as one value."""
        return AcceptanceCounts(*(getattr(self, f) for f in ACCEPTANCE_FIELDS))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per verification step: 1 + accepted / drafts (1.0 without drafts)."""
        return self.counts.mean_acceptance_length

    @property
    def acceptance_rate(self) -> float:
        """Share of draft tokens kept (0.0 without drafts)."""
        return self.counts.acceptance_rate


@dataclass
class RequestMetrics(AcceptanceRates):
    """Per-request speculative-decoding counters and timestamps (seconds, time.monotonic()).

    num_drafts counts verification steps that had at least one draft token; tokens a lossy policy forgave are
    included in num_accepted_tokens and also counted in num_forgiven_tokens. forgiven_positions lists
    the indices into the generated token ids that the lossy policy forgave.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_forgiven_tokens: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    forgiven_positions: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Logprob:
    """The log-probability of one token at one position (vLLM's Logprob).

    logprob: natural log, -inf for a token the processed distribution excludes (filtered by top-k, top-p,
    min-p or a grammar). rank: 1 + the number of tokens strictly more likely at that position (the most
    likely token has rank 1). decoded_token: the token decoded on its own.
    """

    logprob: float
    rank: int
    decoded_token: str


PositionLogprobs = dict[int, Logprob]
"""One position: the chosen token first, then the top-k alternatives by rank (k or k + 1 entries)."""


@dataclass
class CompletionOutput:
    """One generated sequence: cumulative text and token ids so far.

    logprobs: with SamplingParams(logprobs=k), one PositionLogprobs per token id, under the processed
    target distribution the token was verified or sampled with (docs/sampling.md); else None.
    cumulative_logprob: their sum (None without logprobs). metrics: this sample's own counters (for n > 1
    the request's metrics add them up).
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    metrics: RequestMetrics | None = None


@dataclass
class RequestOutput:
    """The state of one request after an engine step (cumulative, not a delta).

    outputs: one CompletionOutput per sample (SamplingParams.n), indices 0..n-1. prompt_logprobs: with
    SamplingParams(prompt_logprobs=k), one entry per prompt token: None for the first, then the
    PositionLogprobs of that token given the tokens before it (the model's raw distribution); else None.
    error: why this request failed alone (finish_reason "error"), else None. metrics: the request's
    counters (summed over samples when n > 1; per-sample forgiven positions are then in
    outputs[i].metrics).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: str | None = None
