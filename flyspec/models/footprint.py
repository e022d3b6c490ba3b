"""How many bytes of weights one decode step of one sequence reads: the step's memory traffic floor.

At one sequence a decode step reads every linear layer's weights once and does little arithmetic with
each byte, so the memory read bandwidth over these bytes bounds tokens/s (flyspec/bench/bandwidth.py
measures the bandwidth). Counted: each linear layer's own tensors (weights, scales, biases) in the
format it runs in, the lm_head included (the embedding table where a tied head multiplies by it
unquantized). Not counted: the embedding lookup (one row a token), the norms (a few kilobytes), the KV
cache (it grows with the context), and the int8 copies int4 layers keep for prefill (not read while
decoding).
"""

from __future__ import annotations

import torch
from torch import nn


def _own_tensor_bytes(module: nn.Module) -> int:
    tensors = [t for t in vars(module).values() if isinstance(t, torch.Tensor)]
    tensors += list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def streamed_weight_bytes(model: nn.Module) -> int:
    """The bytes of linear-layer weights one decode step of one sequence reads (module docstring)."""
    prefill_copies = {id(getattr(m, "prefill", None)) for m in model.modules()}
    total = sum(
        _own_tensor_bytes(m)
        for m in model.modules()
        if hasattr(m, "in_features") and hasattr(m, "out_features") and id(m) not in prefill_copies
    )
    if getattr(model, "lm_head", None) is None:  # a tied head multiplies by the whole embedding table
        total += sum(_own_tensor_bytes(m) for m in model.modules() if isinstance(m, nn.Embedding))
    return total
