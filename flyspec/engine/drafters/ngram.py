"""Prompt-lookup (n-gram) drafting: copy what followed an earlier occurrence of the request's last tokens.

It costs no model pass and keeps no state (it reads each request's tokens when it drafts), and it may
propose fewer than K tokens, or none.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import numpy as np
import torch

from flyspec.engine.drafters.base import Drafter, Proposal

if TYPE_CHECKING:
    from flyspec.engine.sequence import Sequence


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


class NgramDrafter(Drafter):
    """Prompt-lookup drafting over prompt + output (zero model cost, no draft probabilities)."""

    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def prefill(self, seqs: Seq[Sequence], rows: Seq[Seq[int]], starts: Seq[int]) -> None:
        """Nothing: the lookup reads the request's tokens when it drafts."""

    def propose(self, seqs: Seq[Sequence], uniform: torch.Tensor | None = None) -> Proposal:
        """Look up each request; rows without a match get K_b = 0 (they decode one token)."""
        k = self.num_speculative_tokens
        token_ids = torch.zeros((len(seqs), k), dtype=torch.int64)
        num_tokens = torch.zeros(len(seqs), dtype=torch.int64)
        for b, seq in enumerate(seqs):
            found = ngram_continuation(seq.token_ids, k, self.min_n, self.max_n)
            if found:
                token_ids[b, : len(found)] = torch.tensor(found, dtype=torch.int64)
                num_tokens[b] = len(found)
        return Proposal(token_ids=token_ids, num_tokens=num_tokens, probs=None)

    def commit(self, seqs: Seq[Sequence], num_accepted: Seq[int]) -> None:
        """Nothing: no state to roll back."""

    def release(self, seq: Sequence) -> None:
        """Nothing: no state to forget."""
