"""Drafting with a small model that shares the target's vocabulary.

K sequential batched forward passes of the draft model, one per draft position. The first pass also
catches up the tokens the draft has not seen yet (the previous step's kept drafts that it did not cache,
and the target's final token), so its rows are ragged.

The draft's KV cache has as many blocks as the target's, and a request's block table serves both (each
block holds the target's and the draft's keys and values for the same positions), so blocks come and go
with the target's, and a prompt prefix shared between requests is shared by the draft too.

Draft cache lengths (one per request, owned here): after a prompt chunk, the draft holds what the
target holds. `propose` leaves every current token of the request plus the first K - 1 drafts in the
cache; `commit` keeps the current tokens and the min(a, K - 1) accepted drafts that are cached, so the
rejected ones are rolled back by a smaller length (they are overwritten later, never copied). The
target's blocks always cover these positions: they cover its own, K + 1 past its newest kept token.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from flyspec.engine.drafters.base import Drafter, Proposal
from flyspec.engine.model_runner import ModelRunner, logits_to_probs
from flyspec.spec_decode.sampling import first_argmax, inverse_cdf_sample

if TYPE_CHECKING:
    from flyspec.engine.sequence import Sequence


class DraftModelDrafter(Drafter):
    """A draft model of the target's vocabulary.

    sample_method: "greedy" (argmax), "probabilistic" (inverse CDF of the request's processed draft
    distribution with the request's own uniforms), or None (probabilistic for requests that sample,
    greedy for greedy requests).
    """

    answers_alone = True

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int, sample_method: str | None) -> None:
        self.runner = runner
        self.num_speculative_tokens = num_speculative_tokens
        self.sample_method = sample_method
        # Tokens of each request held by the draft cache.
        self._cached: dict[str, int] = {}

    def drafts_greedily(self, seq: Sequence) -> bool:
        """Whether this request's drafts are argmax tokens (a request the draft answers alone samples as
        it asks, whatever draft_sample_method says: its drafts are its output)."""
        if self.sample_method is None or seq.params.answered_by_draft:
            return seq.params.greedy
        return self.sample_method == "greedy"

    def prefill(self, seqs: Seq[Sequence], rows: Seq[Seq[int]], starts: Seq[int]) -> None:
        """Run the prompt chunks through the draft model too, so the first proposal has little to catch up."""
        self.answer_prefill(seqs, rows, starts, [[]] * len(seqs))

    def answer_prefill(
        self, seqs: Seq[Sequence], rows: Seq[Seq[int]], starts: Seq[int], keep: Seq[Seq[int]]
    ) -> torch.Tensor:
        """`prefill`, returning the draft logits of the kept positions."""
        logits = self.runner.forward(rows, [s.block_table for s in seqs], starts, keep, prefill=True)
        for seq, row, start in zip(seqs, rows, starts, strict=True):
            self._cached[seq.request_id] = start + len(row)
        return logits

    def propose(self, seqs: Seq[Sequence], uniform: torch.Tensor) -> Proposal:
        """K draft tokens per request; `uniform` [B, K] float64 holds each row's own numbers."""
        k = self.num_speculative_tokens
        device = self.runner.device
        greedy = torch.tensor([self.drafts_greedily(s) for s in seqs], dtype=torch.bool, device=device)
        # A greedy draft is deterministic: its q is one-hot at the drafted token, which verification
        # treats exactly like a drafter without probabilities. So an all-greedy batch skips q entirely.
        all_greedy = bool(greedy.all())
        params = [s.params for s in seqs]
        tables = [s.block_table for s in seqs]
        starts = [self._cached[s.request_id] for s in seqs]
        rows = [s.token_ids[start:] for s, start in zip(seqs, starts, strict=True)]
        tokens, probs = [], []
        for j in range(k):
            logits = self.runner.forward(rows, tables, starts, keep=[[len(r) - 1] for r in rows], reuse=True)
            picked = first_argmax(logits)
            if not all_greedy:
                q = logits_to_probs(logits, params)
                picked = torch.where(greedy, picked, inverse_cdf_sample(q, uniform[:, j].to(device)))
                one_hot = torch.zeros_like(q).scatter_(1, picked.unsqueeze(1), 1.0)
                probs.append(torch.where(greedy.unsqueeze(1), one_hot, q))
            tokens.append(picked)
            if j + 1 < k:
                rows = [[t] for t in picked.tolist()]
                starts = [s.num_tokens + j for s in seqs]
        for s in seqs:
            self._cached[s.request_id] = s.num_tokens  # the K - 1 drafts fed back count once kept (`commit`)
        token_ids = torch.stack(tokens, dim=1).cpu()  # the engine builds its rows on the CPU
        num_tokens = torch.full((len(seqs),), k, dtype=torch.int64)
        return Proposal(token_ids, num_tokens, None if all_greedy else torch.stack(probs, dim=1))

    def commit(self, seqs: Seq[Sequence], num_accepted: Seq[int]) -> None:
        """Keep the accepted drafts that are cached; the rest of the proposal is rolled back."""
        cached_drafts = self.num_speculative_tokens - 1
        for seq, a in zip(seqs, num_accepted, strict=True):
            self._cached[seq.request_id] += min(a, cached_drafts)

    def release(self, seq: Sequence) -> None:
        """Forget the request's draft cache length (its blocks go back with the target's)."""
        self._cached.pop(seq.request_id, None)
