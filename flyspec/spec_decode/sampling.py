"""Turning logits into sampling distributions, and drawing tokens from them by inverse CDF.

Both functions are batched over rows with per-row parameters, so one call serves a whole engine step.
Sampling by inverse CDF with caller-supplied uniforms (instead of `torch.multinomial`) lets the engine draw
each request's uniform from that request's own generator: a seeded request then gets the same tokens
whatever else is in the batch.
"""

from __future__ import annotations

import torch

__all__ = ["first_argmax", "inverse_cdf_sample", "process_logits"]


def _check_rows(name: str, tensor: torch.Tensor, n: int) -> None:
    if tensor.dim() != 1 or tensor.shape[0] != n:
        raise ValueError(f"{name} must have shape [{n}] (one value per row), got {list(tensor.shape)}")


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row sampling distributions from logits.

    Rows with temperature 0 are greedy rows: they get the softmax of their logits as given
    (docs/verification.md), and their min-p / top-k / top-p values are ignored. Other rows: logits /
    temperature, then min-p (0 = off; drop tokens whose probability is below min_p times the largest),
    then top-k (0 = off; ties with the k-th largest logit are kept), then top-p on the renormalised
    distribution so far (1.0 = off; the smallest prefix of the descending order whose mass reaches top_p,
    at least one token), then renormalised. Logits already at -inf (a grammar mask) stay excluded.

    Args:
        logits: [N, V] float32.
        temperature: [N], >= 0.
        top_k: [N] int64, >= 0.
        top_p: [N], in (0, 1].
        min_p: [N] in [0, 1], or None (off for every row).
        out: [N, V] float32, contiguous: the result is written here instead of into a new tensor (it may
            be `logits` itself); the values are the same bits.

    Returns:
        [N, V] float32 probabilities (rows sum to 1; filtered tokens are exactly 0).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape [N, V], got {list(logits.shape)}")
    n, vocab = logits.shape
    for name, tensor in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        _check_rows(name, tensor, n)
    if min_p is not None:
        _check_rows("min_p", min_p, n)
        if ((min_p < 0) | (min_p > 1)).any():
            raise ValueError(f"min_p must lie in [0, 1], got {min_p.tolist()}")
    # A NaN makes the sum NaN, so the elementwise check (an [N, V] temporary) runs only when it may hit.
    if torch.isnan(logits.sum()) and torch.isnan(logits).any():
        raise ValueError("logits contain NaN")
    if (temperature < 0).any() or not torch.isfinite(temperature).all():
        raise ValueError(f"temperature must be finite and >= 0, got {temperature.tolist()}")
    if (top_k < 0).any():
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k.tolist()}")
    if ((top_p <= 0) | (top_p > 1)).any():
        raise ValueError(f"top_p must lie in (0, 1], got {top_p.tolist()}")

    device = logits.device
    temperature = temperature.to(device=device, dtype=logits.dtype)
    top_k = top_k.to(device)
    top_p = top_p.to(device)
    greedy = temperature == 0
    divisor = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    scaled = logits / divisor if out is None else torch.div(logits, divisor, out=out)

    if min_p is not None:
        min_p = min_p.to(device=device, dtype=logits.dtype)
        use_min_p = (~greedy) & (min_p > 0)
        if use_min_p.any():
            # p_i < min_p * p_max  <=>  s_i < s_max + ln(min_p): no softmax needed.
            rows = use_min_p.nonzero().squeeze(1)
            sub = scaled[rows]
            floor = sub.amax(dim=-1, keepdim=True) + min_p[rows].log().unsqueeze(1)
            scaled[rows] = sub.masked_fill(sub < floor, float("-inf"))

    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1
    filtered = (~greedy) & (use_k | use_p)
    # Only the rows that filter pay for the O(V log V) sort, a few rows at a time: every step of it is
    # row by row, and the temporaries of a few rows stay below the size the allocator maps afresh.
    for rows in filtered.nonzero().squeeze(1).split(_FILTER_ROWS) if filtered.any() else ():
        vals, order = scaled[rows].sort(dim=-1, descending=True, stable=True)
        k = torch.where(use_k[rows], top_k[rows], torch.full_like(top_k[rows], vocab))
        kth = vals.gather(1, (k - 1).unsqueeze(1))
        vals = vals.masked_fill(vals < kth, float("-inf"))
        probs = torch.softmax(vals, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # A row with top_p = 1 must not lose its tail to cumsum rounding, hence the use_p guard.
        drop = (mass_before >= top_p[rows].unsqueeze(1).to(probs.dtype)) & use_p[rows].unsqueeze(1)
        drop[:, 0] = False
        vals = vals.masked_fill(drop, float("-inf"))
        scaled[rows] = torch.full_like(vals, float("-inf")).scatter(1, order, vals)
    if out is None:
        return torch.softmax(scaled, dim=-1)
    return torch.softmax(scaled, dim=-1, out=scaled)  # in place: scaled is `out`


_FILTER_ROWS = 8
"""Rows sorted together for top-k / top-p: their int64 order over a 151,936-token vocabulary is 9.7 MB."""

_BLOCK = 1024
"""Columns per block in inverse_cdf_sample: a 151,936-token row becomes 149 block sums plus one block."""


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one index per row: the first index whose cumulative probability exceeds u * (row total).

    Rows need not be normalised (the total is used), so a clamped residual can be passed as it is.
    A zero-probability index is never returned, even where rounding puts u * total at or past the end of
    the cumulative sum.

    A sequential cumulative sum over a 150k vocabulary is slow on CPU (far slower than a reduction), so
    the search is two-level: block sums (a vectorised reduction) locate the block, and only that block's
    `_BLOCK` entries are cumulated. Prefix sums are float64; block sums are in the input's precision.

    Args:
        probs: [N, V] non-negative weights, every row with positive total.
        u: [N] uniforms in [0, 1) (float64 recommended).

    Returns:
        [N] int64 indices.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must have shape [N, V], got {list(probs.shape)}")
    n, vocab = probs.shape
    _check_rows("u", u, n)
    device = probs.device
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=device)

    width = min(_BLOCK, vocab)
    full = vocab // width * width
    sums = [probs[:, :full].reshape(n, full // width, width).sum(dim=-1)]
    if full < vocab:
        sums.append(probs[:, full:].sum(dim=-1, keepdim=True))
    block_sums = torch.cat(sums, dim=1).to(torch.float64)  # [N, num_blocks]
    block_cdf = block_sums.cumsum(dim=1)
    total = block_cdf[:, -1]
    if not (total > 0).all():
        bad = (~(total > 0)).nonzero()[0].item()
        raise ValueError(f"probs row {bad} has no positive probability (total {total[bad].item()})")
    target = u.to(device=device, dtype=torch.float64) * total

    # The block whose cumulative sum first exceeds the target; if rounding leaves none, the last block
    # with positive mass.
    num_blocks = block_sums.shape[1]
    block = torch.searchsorted(block_cdf, target.unsqueeze(1), right=True).squeeze(1)
    last_positive_block = torch.where(block_sums > 0, torch.arange(num_blocks, device=device), -1).amax(dim=1)
    block = torch.where(block < num_blocks, block, last_positive_block)
    prefix = torch.where(
        block > 0, block_cdf.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0
    )

    columns = block.unsqueeze(1) * width + torch.arange(width, device=device)
    inside = columns < vocab
    weights = probs.gather(1, columns.clamp(max=vocab - 1)).masked_fill(~inside, 0)  # [N, width]
    local_cdf = prefix.unsqueeze(1) + weights.to(torch.float64).cumsum(dim=1)
    offset = torch.searchsorted(local_cdf, target.unsqueeze(1), right=True).squeeze(1).clamp(max=width - 1)

    landed_on_zero = weights.gather(1, offset.unsqueeze(1)).squeeze(1) <= 0
    if landed_on_zero.any():
        # Rounding only (block sum and in-block sum disagree in the last bits): step back to the last
        # positive entry at or before the offset, else take the block's first positive entry.
        positions = torch.arange(width, device=device)
        positive = weights > 0
        before = torch.where(positive & (positions <= offset.unsqueeze(1)), positions, -1).amax(dim=1)
        first = positive.to(torch.int8).argmax(dim=1)
        offset = torch.where(landed_on_zero, torch.where(before >= 0, before, first), offset)
    return block * width + offset


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the first maximal entry along the last dimension: the same result as `x.argmax(-1)`.

    torch's CPU argmax is a scalar loop, several times slower than the vectorised `amax`; so block maxima
    (one `amax` pass) pick the first block holding the row maximum, and argmax runs on that block only.
    `x` must not contain NaN.
    """
    vocab = x.shape[-1]
    width = min(_BLOCK, vocab)
    full = vocab // width * width
    # unflatten views the last dimension (no copy of x, whatever its leading strides).
    maxima = [x[..., :full].unflatten(-1, (full // width, width)).amax(dim=-1)]
    if full < vocab:
        maxima.append(x[..., full:].amax(dim=-1, keepdim=True))
    block = torch.cat(maxima, dim=-1).argmax(dim=-1, keepdim=True)  # first block holding the maximum
    columns = block * width + torch.arange(width, device=x.device)
    values = x.gather(-1, columns.clamp(max=vocab - 1)).masked_fill(columns >= vocab, float("-inf"))
    return (block * width + values.argmax(dim=-1, keepdim=True)).squeeze(-1)
