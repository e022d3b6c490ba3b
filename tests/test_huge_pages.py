"""The weights our kernels stream every decode step live in memory advised for 2 MB pages
(flyspec/huge_pages.py), with the same values and the same layer outputs as before.

Whether Linux then backs the advice with huge pages depends on the machine's setting, so the tests check
what the process controls: the mapping's `hg` flag (MADV_HUGEPAGE) in /proc/self/smaps where the kernel
has transparent huge pages, the bytes, and that a layer's output is bit for bit the one it gives from
ordinary memory. The speed it buys is a benchmark figure (BENCHMARKS.md), not a test.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flyspec import huge_pages
from flyspec.models import int4_kernel
from flyspec.models.quantization import Int4Linear, quantize_model


def _vm_flags(tensor: torch.Tensor) -> set[str]:
    """The VmFlags of the mapping that holds `tensor`'s first byte."""
    address = tensor.data_ptr()
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds address {address:#x}")


def _advised(tensor: torch.Tensor) -> bool:
    return "hg" in _vm_flags(tensor)


THP = huge_pages.system_setting() != "unavailable"


def test_placed_tensors_keep_their_values_in_advised_chunks() -> None:
    """Small tensors share one chunk, 64-byte aligned, in placement order; one larger than a chunk gets
    a mapping of its own; every copy holds the original's values, dtype and shape; the chunk outlives the
    arena for as long as a tensor placed in it."""
    arena = huge_pages.HugePageArena(chunk_bytes=4 << 20)
    small = [torch.randn(33, 7), torch.arange(100, dtype=torch.int16), torch.randn(5, 3).bfloat16()]
    placed = [arena.place(t) for t in small]
    big = arena.place(torch.randint(0, 255, (5 << 20,), dtype=torch.uint8))
    del arena
    for original, copy in zip(small, placed, strict=True):
        assert torch.equal(original, copy) and copy.dtype == original.dtype and copy.is_contiguous()
        assert copy.data_ptr() % 64 == 0
    starts = [t.data_ptr() for t in placed]
    assert starts[1] - starts[0] == -(-33 * 7 * 4 // 64) * 64 and starts[2] - starts[1] == 256
    assert not placed[0].data_ptr() <= big.data_ptr() < placed[0].data_ptr() + (4 << 20)
    assert all(_advised(t) for t in (*placed, big)) == THP


def test_turned_off_it_leaves_tensors_where_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """`FLYSPEC_HUGE_PAGES=0` (for measuring the difference) returns the tensor itself."""
    monkeypatch.setenv("FLYSPEC_HUGE_PAGES", "0")
    tensor = torch.randn(64, 64)
    assert huge_pages.place(tensor) is tensor


def test_int4_layers_stream_from_advised_memory_with_the_same_outputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model quantized to int4 holds every layer's packed codes and scales in advised memory (the
    decode step reads them once per token), and each layer's output is bit for bit what the same layer
    gives from ordinary memory. Fails for layers that keep the packed tensors where `pack` made them."""
    assert int4_kernel.library() is not None, int4_kernel.unavailable_reason()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256)).to(torch.bfloat16)
    weights = [(layer.weight.detach().clone(), layer.bias.detach().clone()) for layer in model]
    quantize_model(model, "int4")
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    for layer in model:
        assert isinstance(layer, Int4Linear)
        assert _advised(layer.packed) == THP and _advised(layer.scales_and_offsets) == THP
    monkeypatch.setenv("FLYSPEC_HUGE_PAGES", "0")
    plain = [Int4Linear(w, b, torch.bfloat16, prefill_copy=False) for w, b in weights]
    # Left where `pack` made them: torch's own (resizable) storage, not a fixed one over an arena mapping.
    # Not "no hg flag": in two full-suite runs such ordinary memory already carried the flag (set by
    # something outside this code), which says nothing about where the layer's tensors were put.
    assert all(layer.packed.untyped_storage().resizable() for layer in plain)
    assert not any(layer.packed.untyped_storage().resizable() for layer in model)
    assert torch.equal(model[0](x), plain[0](x))
    assert torch.equal(model[1](model[0](x)), plain[1](plain[0](x)))
