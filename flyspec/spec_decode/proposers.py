"""Drafters: propose up to K tokens per running request for the target to verify.

`DraftModelProposer` runs a small model K times (one batched forward per draft position); the first pass
also catches up the tokens the draft has not seen yet (the previous step's accepted and final tokens),
so rows are ragged. `CrossVocabProposer` does the same with a draft model of another vocabulary through
Token-Level Intersection (see vocab_map.py). `NgramProposer` (prompt lookup) copies the continuation of an
earlier occurrence of the sequence's last n tokens; it costs no model pass and may propose fewer than K
tokens, or none.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

import numpy as np
import torch

from flyspec.engine.model_runner import ModelRunner, logits_to_probs
from flyspec.spec_decode.sampling import inverse_cdf_sample
from flyspec.spec_decode.vocab_map import DraftView, VocabMap, target_tokens_since

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


@dataclass
class _CrossVocabState:
    """One request's draft-side state: its text in draft tokens, and the draft ids its cache holds."""

    view: DraftView
    cached: list[int] = field(default_factory=list)


class CrossVocabProposer:
    """Greedy drafting with a draft model of another vocabulary (Token-Level Intersection).

    Each step, each request's `DraftView` takes in the newly committed target tokens; the draft cache
    keeps its longest prefix that still matches the view and the rest is fed again (catch-up, in chunks
    of at most `catch_up_chunk` tokens per row); then K passes draft argmax tokens restricted to the
    intersection, mapped to target ids. A request whose text ends inside a UTF-8 character, or whose
    view would outgrow the draft cache, drafts nothing for that step. No probabilities: greedy drafts
    are one-hot, which verification handles without them.
    """

    def __init__(
        self, runner: ModelRunner, num_speculative_tokens: int, vocab_map: VocabMap, catch_up_chunk: int = 512
    ) -> None:
        self.runner = runner
        self.k = num_speculative_tokens
        self.map = vocab_map
        self.catch_up_chunk = catch_up_chunk
        self._allowed = vocab_map.allowed.to(runner.device)
        self._to_target = vocab_map.draft_to_target.to(runner.device)
        # Per request; an entry goes away with its finished Sequence.
        self._states: WeakKeyDictionary[Sequence, _CrossVocabState] = WeakKeyDictionary()

    def _catch_up(self, seq: Sequence) -> list[int] | None:
        """Bring the request's view up to date and trim its draft cache to the longest prefix that still
        matches; return the draft ids to feed from there (at least the newest), or None to draft nothing."""
        state = self._states.get(seq)
        if state is None:
            state = self._states[seq] = _CrossVocabState(DraftView(self.map))
        view, cached = state.view, state.cached
        stable = view.append(target_tokens_since(seq.prompt_token_ids, seq.output_token_ids, view.num_target))
        ids = view.ids
        # The cache holds a prefix of the previous view plus drafts; ids before `stable` did not change.
        common = min(stable, len(cached))
        while common < min(len(cached), len(ids)) and cached[common] == ids[common]:
            common += 1
        del cached[common:]
        if not view.ready or not ids or len(ids) + self.k > self.runner.cache.max_len:
            return None
        if len(cached) == len(ids):
            cached.pop()  # the newest id is fed again: its logits start the draft
        return ids[len(cached) :]

    def propose(self, seqs: Seq[Sequence], uniform: torch.Tensor | None = None) -> Proposal:
        """Draft up to K target tokens per sequence (K_b = 0 for rows that cannot draft this step)."""
        token_ids = torch.zeros((len(seqs), self.k), dtype=torch.int64)
        num_tokens = torch.zeros(len(seqs), dtype=torch.int64)
        todo = [self._catch_up(seq) for seq in seqs]
        active = [b for b, row in enumerate(todo) if row is not None]
        if not active:
            return Proposal(token_ids, num_tokens, None)
        states = [self._states[seqs[b]] for b in active]
        rows = [row for row in todo if row is not None]
        slots = [seqs[b].slot for b in active]
        starts = [len(state.cached) for state in states]
        # Long catch-ups (a new prompt) go in bounded chunks first, so one pass never gets very wide.
        while True:
            long = [i for i, row in enumerate(rows) if len(row) > self.catch_up_chunk]
            if not long:
                break
            chunk = self.catch_up_chunk
            self.runner.forward(
                [rows[i][:chunk] for i in long], [slots[i] for i in long], [starts[i] for i in long]
            )
            for i in long:
                states[i].cached.extend(rows[i][:chunk])
                rows[i], starts[i] = rows[i][chunk:], starts[i] + chunk
        picked_rows: list[torch.Tensor] = []
        for _ in range(self.k):
            logits = self.runner.forward(rows, slots, starts, keep=[[len(r) - 1] for r in rows])
            assert logits is not None
            picked = self.map.greedy_pick(logits, self._allowed)
            picked_rows.append(picked)
            # What this pass fed is now in the cache; the next pass feeds the draft just picked (so the
            # cache ends up holding the view plus the first K - 1 drafts).
            fed = picked.tolist()
            for i, state in enumerate(states):
                state.cached.extend(rows[i])
                rows[i] = [fed[i]]
                starts[i] = len(state.cached)
        drafted = torch.stack(picked_rows, dim=1)
        index = torch.tensor(active, dtype=torch.int64)
        token_ids[index] = self._to_target[drafted].cpu()
        num_tokens[index] = self.k
        return Proposal(token_ids, num_tokens, None)


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
