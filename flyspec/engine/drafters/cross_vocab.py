"""Greedy drafting with a draft model of another vocabulary (Token-Level Intersection, see vocab_map.py).

Each step, each request's `DraftView` takes in the newly committed target tokens; the draft cache keeps
its longest prefix that still matches the view and the rest is fed again (catch-up, in chunks of at most
`catch_up_chunk` tokens per row); then K passes draft argmax tokens restricted to the intersection,
mapped to target ids. A rejection by the target and a re-tokenisation at the end of the text are thus the
same rollback, found when drafting, so `prefill` and `commit` have nothing to do. The draft cache's
blocks are the drafter's own (its positions are not the target's): a request gets blocks as its view
grows and gives them back when it ends. A request whose text ends inside a UTF-8 character, whose view
would outgrow `max_len`, or that finds no free draft block drafts nothing for that step.
No probabilities: greedy drafts are one-hot, which verification handles without them.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from flyspec.engine.drafters.base import Drafter, Proposal
from flyspec.engine.drafters.vocab_map import DraftView, VocabMap, target_tokens_since
from flyspec.engine.kv_blocks import BlockManager
from flyspec.engine.model_runner import ModelRunner

if TYPE_CHECKING:
    from flyspec.engine.sequence import Sequence


@dataclass
class _RequestState:
    """One request's draft-side state: its text in draft tokens, the draft ids its cache holds, and the
    draft cache blocks that hold them."""

    view: DraftView
    cached: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)


class CrossVocabDrafter(Drafter):
    """Token-Level Intersection drafting (greedy only) with its own per-request view and cache lengths."""

    def __init__(
        self,
        runner: ModelRunner,
        num_speculative_tokens: int,
        vocab_map: VocabMap,
        max_len: int,
        catch_up_chunk: int = 512,
    ) -> None:
        self.runner = runner
        self.max_len = max_len
        self.blocks = BlockManager(runner.cache.num_blocks, runner.cache.block_size)
        self.blocks.add_release_hook(runner.cache.release)
        self.num_speculative_tokens = num_speculative_tokens
        self.map = vocab_map
        self.catch_up_chunk = catch_up_chunk
        self._allowed = vocab_map.allowed.to(runner.device)
        self._to_target = vocab_map.draft_to_target.to(runner.device)
        self._states: dict[str, _RequestState] = {}

    def prefill(self, seqs: Seq[Sequence], rows: Seq[Seq[int]], starts: Seq[int]) -> None:
        """Nothing yet: the draft needs the prompt in its own tokens, which it builds when it first drafts."""

    def commit(self, seqs: Seq[Sequence], num_accepted: Seq[int]) -> None:
        """Nothing: the next `propose` finds what changed by comparing the view with the cached ids."""

    def release(self, seq: Sequence) -> None:
        """Drop the request's view and cache record, and give its draft blocks back."""
        state = self._states.pop(seq.request_id, None)
        if state is not None:
            self.blocks.free(state.blocks)

    def _catch_up(self, seq: Sequence) -> list[int] | None:
        """Bring the request's view up to date and trim its draft cache to the longest prefix that still
        matches; return the draft ids to feed from there (at least the newest), or None to draft nothing."""
        state = self._states.get(seq.request_id)
        if state is None:
            state = self._states[seq.request_id] = _RequestState(DraftView(self.map))
        view, cached = state.view, state.cached
        stable = view.append(target_tokens_since(seq.prompt_token_ids, seq.output_token_ids, view.num_target))
        ids = view.ids
        # The cache holds a prefix of the previous view plus drafts; ids before `stable` did not change.
        common = min(stable, len(cached))
        while common < min(len(cached), len(ids)) and cached[common] == ids[common]:
            common += 1
        del cached[common:]
        # The passes write the view plus the first K - 1 drafts.
        needed = len(ids) + self.num_speculative_tokens
        if not view.ready or not ids or needed > self.max_len:
            return None
        if not self.blocks.allocate(state.blocks, needed):
            return None
        if len(cached) == len(ids):
            cached.pop()  # the newest id is fed again: its logits start the draft
        return ids[len(cached) :]

    def propose(self, seqs: Seq[Sequence], uniform: torch.Tensor | None = None) -> Proposal:
        """Up to K target tokens per request (K_b = 0 for rows that cannot draft this step); greedy, so
        `uniform` is not used."""
        k = self.num_speculative_tokens
        token_ids = torch.zeros((len(seqs), k), dtype=torch.int64)
        num_tokens = torch.zeros(len(seqs), dtype=torch.int64)
        todo = [self._catch_up(seq) for seq in seqs]
        active = [b for b, row in enumerate(todo) if row is not None]
        if not active:
            return Proposal(token_ids, num_tokens, None)
        states = [self._states[seqs[b].request_id] for b in active]
        rows = [row for row in todo if row is not None]
        tables = [state.blocks for state in states]
        starts = [len(state.cached) for state in states]
        self._feed_long_rows(rows, tables, starts, states)
        picked_rows: list[torch.Tensor] = []
        for _ in range(k):
            logits = self.runner.forward(rows, tables, starts, keep=[[len(r) - 1] for r in rows], reuse=True)
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
        num_tokens[index] = k
        return Proposal(token_ids, num_tokens, None)

    def _feed_long_rows(
        self, rows: list[list[int]], tables: list[list[int]], starts: list[int], states: list[_RequestState]
    ) -> None:
        """Long catch-ups (a new prompt) go in bounded chunks first, so one pass never gets very wide;
        shortens `rows` and advances `starts` in place."""
        chunk = self.catch_up_chunk
        while True:
            long = [i for i, row in enumerate(rows) if len(row) > chunk]
            if not long:
                return
            self.runner.forward(
                [rows[i][:chunk] for i in long], [tables[i] for i in long], [starts[i] for i in long]
            )
            for i in long:
                states[i].cached.extend(rows[i][:chunk])
                rows[i], starts[i] = rows[i][chunk:], starts[i] + chunk
