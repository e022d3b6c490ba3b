"""The drafter interface: what the engine asks of every way of proposing draft tokens.

Per engine step the engine calls, in this order and once each: `prefill` after the target took this
step's prompt chunks, `propose` for the requests that decode, then `commit` with what verification kept;
`release` when a request finishes or is aborted. A drafter that `answers_alone` (a draft model of the
target's vocabulary) also answers requests with verification="draft_only" by itself: their prompt
chunks come through `answer_prefill` (which returns the logits of their first token), their proposals
are committed whole, and the target never sees them. A drafter owns all of its draft-side state (a draft
model's KV cache and how much of each request it holds, a request's text in another vocabulary), so the
engine never needs to know which drafter it runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flyspec.engine.sequence import Sequence


@dataclass
class Proposal:
    """Draft tokens for B rows.

    token_ids: [B, K] int64 on the CPU (positions >= num_tokens[b] are padding); num_tokens: [B] int64
    K_b on the CPU; probs: [B, K, V] on the model's device, the distributions the tokens were drawn from
    (one-hot for greedy drafting), or None for a drafter without probabilities (and for an all-greedy
    draft batch, which verification treats the same way).
    """

    token_ids: torch.Tensor
    num_tokens: torch.Tensor
    probs: torch.Tensor | None

    @classmethod
    def empty(cls, k: int) -> Proposal:
        """No rows."""
        return cls(torch.empty((0, k), dtype=torch.int64), torch.empty(0, dtype=torch.int64), None)

    def rows(self, start: int, stop: int | None) -> Proposal:
        """The proposal of rows start .. stop - 1 (to the end for None)."""
        probs = None if self.probs is None else self.probs[start:stop]
        return Proposal(self.token_ids[start:stop], self.num_tokens[start:stop], probs)


class Drafter(ABC):
    """Proposes up to `num_speculative_tokens` (K) draft tokens per request for the target to verify.

    All four methods are abstract so that each drafter says what it does at each point, even "nothing".
    """

    num_speculative_tokens: int
    answers_alone: bool = False
    """Whether the drafter can answer a request without the target (verification="draft_only"): its
    tokens are target tokens and it samples them as the request asks. Such a drafter implements
    `answer_prefill`."""

    @abstractmethod
    def prefill(self, seqs: Seq[Sequence], rows: Seq[Seq[int]], starts: Seq[int]) -> None:
        """The target just took prompt chunks: rows[b] of request seqs[b] at positions starts[b].. (a
        drafter with a cache of its own may take them in the same step; positions before starts[b] are
        already in the request's KV blocks, computed by an earlier chunk or shared from another request
        with the same prompt prefix)."""

    def answer_prefill(
        self, seqs: Seq[Sequence], rows: Seq[Seq[int]], starts: Seq[int], keep: Seq[Seq[int]]
    ) -> torch.Tensor:
        """`prefill`, also returning the draft's float32 logits [sum(len(keep[b])), V] of the positions
        keep[b] of rows[b] (the first token of a request the drafter answers alone)."""
        raise TypeError(f"{type(self).__name__} drafts for the target model and cannot answer alone")

    @abstractmethod
    def propose(self, seqs: Seq[Sequence], uniform: torch.Tensor) -> Proposal:
        """Draft tokens for each decoding request (all of them past their prompt).

        uniform: [B, K] float64 in (0, 1), each row the request's own numbers for sampling drafts.
        """

    @abstractmethod
    def commit(self, seqs: Seq[Sequence], num_accepted: Seq[int]) -> None:
        """Verification of the last proposal kept num_accepted[b] draft tokens of row b (one target token
        follows them); called after `propose`, before the next one."""

    @abstractmethod
    def release(self, seq: Sequence) -> None:
        """The request finished or was aborted: forget whatever is kept for it."""
