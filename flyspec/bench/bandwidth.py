"""The memory bandwidth limit of one sequence's decoding, measured on the machine at hand.

At one sequence a decode step reads every weight of the model once per token and does little arithmetic
with each byte, so tokens/s cannot exceed the memory read bandwidth over the weight bytes a token reads.
`read_bandwidth` measures that bandwidth the way STREAM's kernels do (a buffer far larger than the caches
read end to end, the best of several passes), with the threads the benchmark uses. The report puts it
beside what a step streams (`LLM.target_weight_bytes`, flyspec/models/footprint.py): the weight bytes
times tokens/s against the measured bandwidth (flyspec/bench/llama_cpp.py).
"""

from __future__ import annotations

import time

import torch

from flyspec import huge_pages

READ_BYTES, READ_PASSES = 512 << 20, 5
"""The buffer `read_bandwidth` reads (far beyond any CPU's last-level cache) and its timed passes."""


def read_bandwidth(threads: int, nbytes: int = READ_BYTES, passes: int = READ_PASSES) -> float:
    """Bytes per second of a full read of an `nbytes` float32 buffer (a sum over it) with `threads`
    torch threads: the best of `passes` after one untimed pass that faults the pages in. The buffer lies
    in huge-page-advised memory, as the quantized weights do (flyspec/huge_pages.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = huge_pages.mapping(nbytes).view(torch.float32).fill_(1.0)
        buffer.sum()
        best = float("inf")
        for _ in range(passes):
            start = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - start)
        return buffer.numel() * 4 / best
    finally:
        torch.set_num_threads(before)
