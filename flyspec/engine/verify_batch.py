"""A decode step's verification: its inputs as one typed bundle (as vLLM's SpecDecodeMetadata), and
`verify()` over the batch with each row's failure kept to that row.

The engine builds one `VerifyBatch` per step for the rows that drafted, calls `verify_isolated`, and
commits each row's `RowResult`. A row that makes verification raise (a non-finite distribution, say)
fails alone: the batch is verified again row by row, which gives every other row the same result
(`verify()` treats rows independently), and the failing rows are reported.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

import torch

from flyspec.engine.logits_processing import ProcessedRequest, non_finite_message
from flyspec.engine.timing import UNTIMED, PartTimer
from flyspec.spec_decode.verify import VerificationPolicy, verify

logger = logging.getLogger("flyspec.engine")


@dataclass(frozen=True)
class VerifyBatch:
    """The inputs of `verify()` for B rows that drafted (docs/verification.md has the rules).

    draft_token_ids: [B, K] int64 (positions >= num_draft_tokens[b] are padding); num_draft_tokens: [B]
    int64 K_b; draft_probs: [B, K, V] or None (greedy drafts, drafters without probabilities);
    target_probs: [B, K+1, V] processed target probabilities, row K_b the bonus row; greedy: [B] bool;
    uniform: [B, K] float64 for the p/q tests; sample_uniform: [B] float64 for the recovered or bonus
    token; lossless_before: [B] int64 positions verified natively under a lossy policy, or None.
    """

    draft_token_ids: torch.Tensor
    num_draft_tokens: torch.Tensor
    draft_probs: torch.Tensor | None
    target_probs: torch.Tensor
    greedy: torch.Tensor
    uniform: torch.Tensor
    sample_uniform: torch.Tensor
    lossless_before: torch.Tensor | None

    def rows(self, sel: list[int]) -> VerifyBatch:
        """The same bundle for the rows `sel` only."""

        def pick(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor[torch.tensor(sel, device=tensor.device)]

        return replace(
            self,
            draft_token_ids=pick(self.draft_token_ids),
            num_draft_tokens=pick(self.num_draft_tokens),
            draft_probs=pick(self.draft_probs),
            target_probs=pick(self.target_probs),
            greedy=pick(self.greedy),
            uniform=pick(self.uniform),
            sample_uniform=pick(self.sample_uniform),
            lossless_before=pick(self.lossless_before),
        )


@dataclass(frozen=True)
class RowResult:
    """One row's verification: draft tokens kept (forgiven ones included), the draft positions a lossy
    policy forgave, and the tokens to commit (the kept drafts, then the recovered or bonus token)."""

    num_accepted: int
    forgiven: list[int]
    token_ids: list[int]


def verify_isolated(
    batch: VerifyBatch,
    policy: VerificationPolicy | None,
    seqs: Seq[ProcessedRequest],
    failed: dict[int, str],
    timer: PartTimer = UNTIMED,
) -> dict[int, RowResult]:
    """Results for every row not in `failed` (row index -> RowResult). Rows that make verification raise
    join `failed` with the reason, and every other row gets exactly its result in one call."""
    idx = [b for b in range(len(seqs)) if b not in failed]
    if not idx:
        return {}
    try:
        # The usual case is all rows: then no copies of the [B, K+1, V] probabilities.
        return _verify(batch if len(idx) == len(seqs) else batch.rows(idx), idx, policy, timer)
    except Exception:
        results: dict[int, RowResult] = {}
        for b in idx:
            try:
                results.update(_verify(batch.rows([b]), [b], policy, timer))
            except Exception as exc:
                finite = bool(torch.isfinite(batch.target_probs[b].sum()))
                failed[b] = (
                    f"verification failed: {type(exc).__name__}: {exc}"
                    if finite
                    else non_finite_message(seqs[b].params)
                )
                logger.warning("request %s fails alone: %s", seqs[b].request_id, failed[b])
        return results


def _verify(
    batch: VerifyBatch, idx: list[int], policy: VerificationPolicy | None, timer: PartTimer
) -> dict[int, RowResult]:
    """verify() on `batch`, whose rows are the engine rows `idx`."""
    with timer:
        out = verify(
            batch.draft_token_ids,
            batch.target_probs,
            batch.draft_probs,
            greedy=batch.greedy,
            policy=policy,
            lossless_before=batch.lossless_before,
            num_draft_tokens=batch.num_draft_tokens,
            uniform=batch.uniform,
            sample_uniform=batch.sample_uniform,
        )
    num_accepted, token_ids = out.num_accepted.tolist(), out.token_ids.tolist()
    forgiven = out.forgiven.tolist()
    return {
        b: RowResult(
            num_accepted[j],
            [i for i, f in enumerate(forgiven[j]) if f],
            token_ids[j][: num_accepted[j] + 1],
        )
        for j, b in enumerate(idx)
    }
