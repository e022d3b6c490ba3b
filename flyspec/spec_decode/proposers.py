"""Drafters: propose up to K tokens per running request for the target to verify.

`DraftModelProposer` runs a small model K times (one batched forward per draft position); the first pass
also catches up the tokens the draft has not seen yet (the previous step's accepted and final tokens),
so rows are ragged. `NgramProposer` (prompt lookup) copies the continuation of an earlier occurrence of
the sequence's last n tokens; it costs no model pass and may propose fewer than K tokens, or none.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from flyspec.engine.model_runner import ModelRunner, logits_to_probs
from flyspec.spec_decode.sampling import inverse_cdf_sample

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


class DraftModelProposer:
    """K sequential batched forward passes of a draft model sharing the target's vocabulary.

    sample_method: "greedy" (argmax), "probabilistic" (inverse CDF of the request's processed draft
    distribution with the request's own uniforms), or None (probabilistic for requests that sample,
    greedy for greedy requests).
    """

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int, sample_method: str | None) -> None:
        self.runner = runner
        self.k = num_speculative_tokens
        self.sample_method = sample_method

    def drafts_greedily(self, seq: Sequence) -> bool:
        """Whether this request's drafts are argmax tokens."""
        if self.sample_method is None:
            return seq.params.greedy
        return self.sample_method == "greedy"

    def propose(self, seqs: Seq[Sequence], uniform: torch.Tensor) -> Proposal:
        """Draft K tokens for each sequence; `uniform` [B, K] float64 holds each row's own numbers.

        Afterwards each sequence's draft cache holds all its current tokens (`draft_len` = num_tokens)
        plus the first K - 1 draft tokens; the engine trims `draft_len` to what verification kept.
        """
        device = self.runner.device
        greedy = torch.tensor([self.drafts_greedily(s) for s in seqs], dtype=torch.bool, device=device)
        # A greedy draft is deterministic: its q is one-hot at the drafted token, which verification
        # treats exactly like a drafter without probabilities. So an all-greedy batch skips q entirely.
        all_greedy = bool(greedy.all())
        params = [s.params for s in seqs]
        slots = [s.slot for s in seqs]
        rows = [s.token_ids[s.draft_len :] for s in seqs]
        starts = [s.draft_len for s in seqs]
        tokens, probs = [], []
        for j in range(self.k):
            logits = self.runner.forward(rows, slots, starts, keep=[[len(r) - 1] for r in rows])
            picked = logits.argmax(dim=-1)
            if not all_greedy:
                q = logits_to_probs(logits, params)
                picked = torch.where(greedy, picked, inverse_cdf_sample(q, uniform[:, j].to(device)))
                one_hot = torch.zeros_like(q).scatter_(1, picked.unsqueeze(1), 1.0)
                probs.append(torch.where(greedy.unsqueeze(1), one_hot, q))
            tokens.append(picked)
            if j == 0:
                for s in seqs:
                    s.draft_len = s.num_tokens
            if j + 1 < self.k:
                rows = [[t] for t in picked.tolist()]
                starts = [s.num_tokens + j for s in seqs]
        token_ids = torch.stack(tokens, dim=1).cpu()  # the engine builds its rows on the CPU
        num_tokens = torch.full((len(seqs),), self.k, dtype=torch.int64)
        return Proposal(token_ids, num_tokens, None if all_greedy else torch.stack(probs, dim=1))


def ngram_continuation(tokens: Seq[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup: up to k tokens that followed the earliest earlier occurrence of the last n tokens.

    n is tried from max_n down to min_n (longest match first); an empty list when nothing matches.
    """
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = arr[length - n :]
        # Windows start at 0..length-n-1, so every match has at least one token after it and is not
        # the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return arr[start : start + k].tolist()
    return []


class NgramProposer:
    """Prompt-lookup drafting over prompt + output (zero model cost, no draft probabilities)."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seqs: Seq[Sequence], uniform: torch.Tensor | None = None) -> Proposal:
        """Look up each sequence; rows without a match get K_b = 0 (they decode one token)."""
        token_ids = torch.zeros((len(seqs), self.k), dtype=torch.int64)
        num_tokens = torch.zeros(len(seqs), dtype=torch.int64)
        for b, seq in enumerate(seqs):
            found = ngram_continuation(seq.token_ids, self.k, self.min_n, self.max_n)
            if found:
                token_ids[b, : len(found)] = torch.tensor(found, dtype=torch.int64)
                num_tokens[b] = len(found)
        return Proposal(token_ids=token_ids, num_tokens=num_tokens, probs=None)
