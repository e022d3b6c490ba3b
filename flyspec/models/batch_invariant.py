"""Batch-invariant matmuls and attention: each token position is computed the same way, bit for bit,
whatever else shares its forward pass (other requests, padding, the other tokens of its own chunk).

Why the ordinary path is not: a float matmul library picks its algorithm by shape (on an AMD EPYC with
torch 2.13, float32 `F.linear` gives a row different bits with 1 row, with 2-3 rows and with 4 or more;
bfloat16 gave the same bits for every row count tried), and SDPA's CPU kernel splits keys and queries
into blocks whose sizes follow the numbers of keys and query rows, so a row's sums are grouped
differently when a longer request pads the batch or when its own chunk is longer.

What this module does instead:
- `padded_rows`: a matmul is always called with exactly `ROWS` rows: longer inputs are cut into pieces
  of `ROWS`, and the last piece is filled with copies of its last row (dropped again), so every row is
  computed by the one algorithm the library picks for that shape. A minimum alone is not enough: on an
  Intel Xeon with AMX (torch 2.13), bfloat16 `F.linear` gives the same bits for 16 to 32 rows and
  different ones from 33 rows on.
- `attention`, in float32: a score is one dot product over the head dimension, computed in a matmul of
  a multiple of `TILE` query rows (the many-row algorithm again); the row maximum is exact in any order;
  keys are summed in blocks of `KEYS` (fixed-length sums, and the weighted values of a block in a
  [rows, KEYS] x [KEYS, D] matmul), and the blocks are added in key order by a sequential cumulative
  sum, so the zero-weight keys and blocks that padding adds change nothing.

None of this is a guarantee about an arbitrary CPU's libraries, so `LlamaForCausalLM.
enable_batch_invariance` probes the model's own forward first and refuses where rows still differ.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ROWS = 32
TILE = 16
KEYS = 64
# Scores per piece of work (query rows x keys): bounds the float32 temporaries of a long prefill.
_MAX_SCORES = 2**22


def padded_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for a row-wise fn (a linear layer), called on pieces of exactly ROWS rows."""
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    short = -rows % ROWS
    if short:
        # Copies of a real row, not zeros: a quantized layer scales each row by its own maximum.
        flat = torch.cat((flat, flat[-1:].expand(short, -1)))
    out = torch.cat([fn(piece) for piece in flat.split(ROWS)])[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) over the visible keys) v, in q's dtype.

    q: [B, H, R, D]; k, v: [B, H, L, D]; visible: [B, 1, R, L] bool (each row sees at least one key, or
    its output is undefined: padding rows).
    """
    bsz, heads, rows, dim = q.shape
    length = k.shape[2]
    nb = -(-length // KEYS)
    padded = nb * KEYS
    kf = k.new_zeros(bsz, heads, padded, dim, dtype=torch.float32)
    vf = torch.zeros_like(kf)
    kf[:, :, :length] = k
    vf[:, :, :length] = v
    vf = vf.view(bsz, heads, nb, KEYS, dim)
    out = q.new_empty(bsz, heads, rows, dim)
    step = max(TILE, _MAX_SCORES // padded // TILE * TILE)
    for r0 in range(0, rows, step):
        n = min(rows, r0 + step) - r0
        tiled = -(-n // TILE) * TILE
        # Scores: each a dot product over D, in a matmul of a multiple of TILE rows (the many-row
        # algorithm); the rows added for that are dropped again before the softmax.
        qf = q.new_zeros(bsz, heads, tiled, dim, dtype=torch.float32)
        qf[:, :, :n] = q[:, :, r0 : r0 + n]
        qf.mul_(dim**-0.5)
        scores = torch.matmul(qf, kf.transpose(-1, -2))[:, :, :n]  # [B, H, n, L']
        mask = F.pad(visible[:, :, r0 : r0 + n], (0, padded - length))
        scores = scores.masked_fill(~mask, -torch.inf)
        top = scores.amax(dim=-1, keepdim=True)
        top = torch.where(top == -torch.inf, 0.0, top)
        weights = torch.exp(scores - top).view(bsz, heads, n, nb, KEYS)
        den = _in_order(weights.sum(-1), dim=3)  # [B, H, n]
        # Each block's weighted values in a [TILE rows, KEYS] x [KEYS, D] matmul, then the blocks in key
        # order.
        blocks = weights.new_zeros(bsz, heads, nb, tiled, KEYS)
        blocks[:, :, :, :n] = weights.transpose(2, 3)
        num = _in_order(torch.matmul(blocks, vf), dim=2)[:, :, :n]  # [B, H, n, D]
        out[:, :, r0 : r0 + n] = (num / torch.where(den == 0, 1.0, den).unsqueeze(-1)).to(q.dtype)
    return out


def _in_order(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over `dim` added strictly first to last (a cumulative sum's last entry), so trailing
    zeros, such as padding blocks, change nothing."""
    if x.shape[dim] == 1:
        return x.squeeze(dim)
    return x.cumsum(dim).select(dim, -1)
