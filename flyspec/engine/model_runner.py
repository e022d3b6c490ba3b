"""Batched forward passes of one model over its paged KV cache, and logits -> probabilities for drafts.

Every pass (prompt chunks, draft steps, target verification) is the same operation: B ragged rows of new
tokens, row b written at cache positions start[b].. of the blocks in its block table, padded into one
[B, T] forward. Which blocks a row owns is decided outside (engine/kv_blocks.py); the runner only passes
the tables on.
The lm_head runs only on the positions the caller asks for, since it is a large share of a step.
Per-row bookkeeping stays in Python lists on the CPU; tensors are created on the model's device.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from flyspec.engine.logits_processing import robust_probs
from flyspec.engine.step_buffer import StepBuffer
from flyspec.engine.timing import UNTIMED, PartTimer
from flyspec.models.llama import ForwardBatch
from flyspec.sampling_params import SamplingParams
from flyspec.spec_decode.sampling import first_argmax, inverse_cdf_sample


class ModelRunner:
    """One model with its own paged KV cache of `num_blocks` blocks of `block_size` positions.

    `timer` adds each forward's wall time to the engine's step timings when those are recorded.
    """

    def __init__(
        self, model: torch.nn.Module, num_blocks: int, block_size: int, *, timer: PartTimer = UNTIMED
    ) -> None:
        self.model = model
        self.timer = timer
        self.cache = model.new_cache(num_blocks, block_size)
        self.device = next(model.parameters()).device
        self.vocab_size: int = model.vocab_size
        self._logits_buffer = StepBuffer(self.vocab_size, torch.float32, self.device)

    @torch.inference_mode()
    def forward(
        self,
        rows: Seq[Seq[int]],
        tables: Seq[Seq[int]],
        starts: Seq[int],
        keep: Seq[Seq[int]] | None = None,
        *,
        prefill: bool = False,
        reuse: bool = False,
    ) -> torch.Tensor:
        """Run rows of new tokens through the model, writing their K/V into the cache.

        rows[b] are token ids at cache positions starts[b], starts[b] + 1, ... of the blocks tables[b]
        (which must cover them).
        keep[b] lists the indices into rows[b] whose logits are wanted (None: none). prefill: every row is
        prompt tokens (ForwardBatch.prefill). Returns float32 logits [sum(len(keep[b])), V] in row-major
        order ([0, V] when nothing is kept: the lm_head does not run). reuse: see `logits`.
        """
        with self.timer:
            hidden = self._hidden(rows, tables, starts, keep or [[]] * len(rows), prefill)
            return self.logits(hidden, reuse=reuse)

    @torch.inference_mode()
    def forward_hidden(
        self,
        rows: Seq[Seq[int]],
        tables: Seq[Seq[int]],
        starts: Seq[int],
        keep: Seq[Seq[int]],
        *,
        prefill: bool = False,
    ) -> torch.Tensor:
        """Like `forward`, but returns the final hidden states [sum(len(keep[b])), H] of the kept
        positions, so that a caller can turn many positions into logits a slice at a time (`logits`)."""
        with self.timer:
            return self._hidden(rows, tables, starts, keep, prefill)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, *, reuse: bool = False) -> torch.Tensor:
        """float32 logits [M, V] of final hidden states [M, H] (M may be 0).

        reuse: written into the runner's step buffer (engine/step_buffer.py) and returned as a view of
        it, valid until the next call with reuse: for the decode step's passes, which use their logits
        before the next pass and would otherwise allocate a new full-vocabulary tensor each time.
        """
        if not len(hidden):
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=hidden.device)
        if reuse:
            return self.model.compute_logits(hidden, out=self._logits_buffer.rows(len(hidden)))
        return self.model.compute_logits(hidden).float()

    def _hidden(
        self,
        rows: Seq[Seq[int]],
        tables: Seq[Seq[int]],
        starts: Seq[int],
        keep: Seq[Seq[int]],
        prefill: bool,
    ) -> torch.Tensor:
        lengths = [len(r) for r in rows]
        width = max(lengths)
        padded = [list(r) + [0] * (width - len(r)) for r in rows]
        input_ids = torch.tensor(padded, dtype=torch.int64, device=self.device)
        num_blocks = max(len(t) for t in tables)
        blocks = [list(t) + [-1] * (num_blocks - len(t)) for t in tables]
        batch = ForwardBatch(
            block_tables=torch.tensor(blocks, dtype=torch.int64, device=self.device),
            start=torch.tensor(list(starts), dtype=torch.int64, device=self.device),
            num_tokens=torch.tensor(lengths, dtype=torch.int64, device=self.device),
            prefill=prefill,
        )
        hidden = self.model(input_ids, batch, self.cache)
        if not any(keep):
            return hidden.new_empty((0, hidden.shape[-1]))
        row_idx = [b for b, positions in enumerate(keep) for _ in positions]
        pos_idx = [p for positions in keep for p in positions]
        device = self.device
        return hidden[torch.tensor(row_idx, device=device), torch.tensor(pos_idx, device=device)]


def logits_to_probs(logits: torch.Tensor, params: Seq[SamplingParams]) -> torch.Tensor:
    """Processed probabilities [N, V], one SamplingParams per logits row (greedy rows: raw softmax), for
    draft distributions. A row that cannot be processed gets a one-hot distribution at its argmax, so a
    bad request cannot fail the drafting of the others: that row then drafts greedily, and verification
    of a one-hot draft distribution is exact (the request itself fails in the target's processing)."""
    return robust_probs(logits, params)[0]


def sample_tokens(probs: torch.Tensor, greedy: Seq[bool], uniform: torch.Tensor) -> list[int]:
    """One token per row: argmax (first maximal index) for greedy rows, inverse CDF with `uniform` [N]
    float64 otherwise. The same rule verification uses for its bonus token, so target-only decoding and
    speculative decoding pick identically (first_argmax is argmax without torch's slow CPU loop)."""
    tokens = first_argmax(probs)
    if not all(greedy):
        drawn = inverse_cdf_sample(probs, uniform.to(probs.device))
        mask = torch.tensor(list(greedy), dtype=torch.bool, device=probs.device)
        tokens = torch.where(mask, tokens, drawn)
    return tokens.tolist()
