"""The prefill pass of a step in which some requests asked for prompt logprobs (SamplingParams.
prompt_logprobs): those requests keep the final hidden state of every prompt position they have not
scored yet, turned into logits a slice at a time (engine/logprobs.py), and every request that samples its
first token keeps its last position, as in an ordinary prefill pass.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from flyspec.engine.logprobs import LogprobsBuilder, prompt_logprobs
from flyspec.engine.model_runner import ModelRunner

if TYPE_CHECKING:
    from flyspec.engine.sequence import Sequence

logger = logging.getLogger("flyspec.engine")


def num_scored(seq: Sequence) -> int:
    """Prompt positions whose logprobs the request has (position p predicts prompt token p + 1)."""
    return 0 if seq.prompt_logprobs is None else len(seq.prompt_logprobs) - 1


def wants_scoring(seq: Sequence, start: int, n: int) -> bool:
    """Whether the chunk of n tokens from `start` holds prompt positions the request has yet to score."""
    return seq.wants_prompt_logprobs and min(start + n, seq.num_prompt_tokens - 1) > num_scored(seq)


def prefill_scoring(
    runner: ModelRunner,
    builder: LogprobsBuilder,
    chunks: Seq[tuple[Sequence, int]],
    rows: Seq[Seq[int]],
    starts: Seq[int],
    sample: Seq[bool],
    scored: Seq[bool],
) -> torch.Tensor:
    """Run the prefill pass, record the prompt logprobs of the `scored` chunks, and return the logits of
    the positions that sample a first token ([number of True in `sample`, V], in chunk order)."""
    keep = [
        list(range(n)) if want else ([n - 1] if s else [])
        for (_, n), want, s in zip(chunks, scored, sample, strict=True)
    ]
    tables = [seq.block_table for seq, _ in chunks]
    hidden = runner.forward_hidden(rows, tables, starts, keep, prefill=True)
    sampling_rows, offset = [], 0
    for (seq, n), kept, want, s, start in zip(chunks, keep, scored, sample, starts, strict=True):
        if want:
            # Position p predicts prompt token p + 1; the prompt's last position predicts the output.
            # Positions scored before a preemption are not scored again.
            next_tokens = seq.prompt_token_ids[start + 1 : start + n + 1]
            skip = max(0, num_scored(seq) - start)
            rows_b = hidden[offset + skip : offset + len(next_tokens)]
            _score_prompt(runner, builder, seq, rows_b, next_tokens[skip:])
        if s:
            sampling_rows.append(offset + len(kept) - 1)
        offset += len(kept)
    return runner.logits(hidden[sampling_rows])


def _score_prompt(
    runner: ModelRunner, builder: LogprobsBuilder, seq: Sequence, hidden: torch.Tensor, next_tokens: list[int]
) -> None:
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None]  # the first prompt token has no prefix to be predicted from
    try:
        num_top = seq.params.prompt_logprobs or 0
        seq.prompt_logprobs.extend(prompt_logprobs(builder, hidden, runner.logits, next_tokens, num_top))
    except Exception as exc:
        logger.warning("request %s fails alone while scoring its prompt: %s", seq.request_id, exc)
        seq.fail(f"computing prompt logprobs failed: {type(exc).__name__}: {exc}")
