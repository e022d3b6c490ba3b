"""The logits processors that run before temperature: a grammar's token mask, logit bias and penalties.

Pure tensor functions over [M, V] rows (one row per verified position), vectorised over rows and over the
vocabulary; the engine (engine/logits_processing.py) gathers which rows need which. The order in which
they apply, and why it keeps verification exact, is in docs/verification.md.
"""

from __future__ import annotations

import torch

__all__ = ["apply_logit_bias", "apply_penalties", "apply_token_mask", "unpack_bitmask"]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[M, ceil(V / 32)] int32 bitmasks (bit j of word w allows token 32 w + j, the layout grammar
    libraries fill) -> [M, V] bool allowed-token masks."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    unpacked = (bitmask.unsqueeze(-1) >> bits) & 1  # the arithmetic shift keeps bit 31 readable
    return unpacked.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> None:
    """In place: logits[rows[m], t] = -inf wherever allowed[m, t] is False."""
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor
) -> None:
    """In place: logits[rows[i], token_ids[i]] += bias[i] (pairs may repeat a row, never a (row, token))."""
    logits.index_put_((rows, token_ids), bias.to(logits.dtype), accumulate=True)


def apply_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    seen: torch.Tensor | None,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Repetition, then frequency, then presence penalty (vLLM's order), per row.

    repetition (transformers / vLLM): the logit of a token in `seen` is divided by the row's penalty when
    positive and multiplied by it otherwise. frequency and presence (OpenAI): subtract frequency x count
    and presence x (count > 0), where count is the token's occurrences among the generated tokens.
    A logit at -inf stays -inf.

    Args:
        logits: [M, V] float32.
        output_counts: [M, V] float32 occurrences of each token in the row's generated tokens.
        seen: [M, V] bool, tokens in the row's prompt or generated tokens; None when no row has a
            repetition penalty other than 1.
        presence, frequency, repetition: [M] float32.

    Returns:
        [M, V] penalised logits (a new tensor).
    """
    if seen is not None:
        factor = torch.where(seen, repetition.unsqueeze(1), torch.ones((), dtype=logits.dtype))
        logits = torch.where(logits > 0, logits / factor, logits * factor)
    generated = (output_counts > 0).to(logits.dtype)
    return logits - frequency.unsqueeze(1) * output_counts - presence.unsqueeze(1) * generated
