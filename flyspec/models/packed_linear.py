"""bfloat16 linear layers with their weights prepacked in oneDNN's blocked layout (CPU).

`F.linear` hands oneDNN the weight in its plain row-major layout, and oneDNN's matmul then reads it in a
layout it was not blocked for. Reordered once at load into oneDNN's own layout (`mkldnn._reorder_linear_
weight`, what torch.compile's CPU backend does for frozen weights), the same kernel reads it about 1.4-2x
faster for decode-sized inputs (1 to 16 rows), which is memory-bound: measured on an AMD EPYC (AVX-512
BF16), Qwen2.5-1.5B's gate/up projection at one row took 1.08 ms against 1.91 ms. The outputs are the same
bits (same kernel, same sums; tests/test_packed_linear.py). The layers are swapped in at load only where
the kernel check measured them faster (flyspec/models/kernel_check.py); oneDNN cannot pack bfloat16 on CPUs
without AVX-512 (or AVX-NE-CONVERT), and there `pack_reason()` says why the plain layers stay.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


class PackedLinear(nn.Module):
    """A bfloat16 linear layer whose weight [N, K] is held in oneDNN's blocked layout (not kept plain).
    Takes and returns bfloat16 `[..., K]` -> `[..., N]`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # Plain attributes, not parameters: an opaque layout, built from a checkpoint at load, never saved.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), 1)
        self.bias = None if bias is None else bias.detach().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W^T + b in bfloat16."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 prepacked"


@functools.cache
def pack_reason() -> str | None:
    """None when oneDNN can pack bfloat16 weights on this CPU, else why not (its own message)."""
    try:
        PackedLinear(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


def pack_model(model: nn.Module, *, lm_head: str = "lm_head") -> None:
    """Replace every bfloat16 `nn.Linear` of `model` by a PackedLinear, in place, freeing the plain weights
    as it goes. The top-level `lm_head` is skipped (the model packs its own: a tied one shares the
    embedding table, which a lookup needs plain)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
                if parent is model and name == lm_head:
                    continue
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                del child
