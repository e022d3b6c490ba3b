"""Batch-invariant matmuls and attention: each token position is computed the same way, bit for bit,
whatever else shares its forward pass (other requests, padding, the other tokens of its own chunk).

Why the ordinary path is not: a float matmul library picks its algorithm by shape (on an AMD EPYC with
torch 2.13, float32 `F.linear` gives a row different bits with 1 row, with 2-3 rows and with 4 or more;
bfloat16 gave the same bits for every row count tried), and SDPA's CPU kernel splits keys and queries
into blocks whose sizes follow the numbers of keys and query rows, so a row's sums are grouped
differently when a longer request pads the batch or when its own chunk is longer.

What this module does instead:
- `padded_rows`: a matmul is never called with fewer than `MIN_ROWS` rows (copies of the last row are
  added and dropped again), so it always runs the many-row algorithm, whose rows depend only on their
  own inputs.
- `attention`: queries in tiles of `TILE` rows, keys in blocks of `KEYS`; every matmul has the shape
  [TILE, D] x [D, KEYS] or [TILE, KEYS] x [KEYS, D] whatever the lengths; the row maximum is exact in
  any order; each block's sum has a fixed length; blocks are added in key order by a sequential
  cumulative sum, so the zero-weight blocks that padding adds change nothing. Computed in float32.

None of this is a guarantee about an arbitrary CPU's libraries, so `LlamaForCausalLM.
enable_batch_invariance` probes the model's own forward first and refuses where rows still differ.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

MIN_ROWS = 16
TILE = 16
KEYS = 64
# (query tile, key block) pairs per piece of work: bounds the float32 temporaries of a long prefill.
_MAX_PAIRS = 2048


def padded_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for a row-wise fn (a linear layer), called with at least MIN_ROWS rows."""
    rows = x.numel() // x.shape[-1]
    if rows >= MIN_ROWS:
        return fn(x)
    flat = x.reshape(rows, x.shape[-1])
    # Copies of a real row, not zeros: a quantized layer scales each row by its own maximum.
    out = fn(torch.cat((flat, flat[-1:].expand(MIN_ROWS - rows, -1))))[:rows]
    return out.reshape(*x.shape[:-1], out.shape[-1])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) over the visible keys) v, in q's dtype.

    q: [B, H, R, D]; k, v: [B, H, L, D]; visible: [B, 1, R, L] bool (each row sees at least one key, or
    its output is undefined: padding rows).
    """
    bsz, heads, rows, dim = q.shape
    length = k.shape[2]
    nt, nb = -(-rows // TILE), -(-length // KEYS)
    qf = F.pad(q.float() * dim**-0.5, (0, 0, 0, nt * TILE - rows)).view(bsz, heads, nt, 1, TILE, dim)
    kf = F.pad(k.float(), (0, 0, 0, nb * KEYS - length)).view(bsz, heads, 1, nb, KEYS, dim)
    vf = F.pad(v.float(), (0, 0, 0, nb * KEYS - length)).view(bsz, heads, 1, nb, KEYS, dim)
    kt = kf.transpose(-1, -2)
    vis = F.pad(visible, (0, nb * KEYS - length, 0, nt * TILE - rows)).view(bsz, 1, nt, TILE, nb, KEYS)
    vis = vis.transpose(3, 4)  # [B, 1, nt, nb, TILE, KEYS]
    out = qf.new_empty(bsz, heads, nt, TILE, dim)
    step = max(1, _MAX_PAIRS // nb)
    for t0 in range(0, nt, step):
        tiles = slice(t0, t0 + step)
        scores = torch.matmul(qf[:, :, tiles], kt).masked_fill_(~vis[:, :, tiles], -torch.inf)
        top = scores.amax(dim=(3, 5), keepdim=True)
        top = torch.where(top == -torch.inf, 0.0, top)
        weights = torch.exp(scores - top)
        den = weights.sum(-1).cumsum(3)[:, :, :, -1]  # [B, H, tiles, TILE]
        num = torch.matmul(weights, vf).cumsum(3)[:, :, :, -1]  # [B, H, tiles, TILE, D]
        out[:, :, tiles] = num / torch.where(den == 0, 1.0, den).unsqueeze(-1)
    return out.view(bsz, heads, nt * TILE, dim)[:, :, :rows].to(q.dtype)
