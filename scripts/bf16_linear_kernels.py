"""Time bfloat16 linear kernels on Qwen2.5-1.5B's layer shapes, side by side in one process.

Compares torch's F.linear, the prepacked oneDNN linear flyspec uses for bf16 weights, a float32 copy of the
weights (activations upcast), and vLLM's `onednn_mm` when run from vLLM's venv. Prints, per row count, the
summed time of one decoder layer's four projections and each kernel's ratio to flyspec's packed bf16.

    python scripts/bf16_linear_kernels.py                    # flyspec's venv
    .peers/vllm/bin/python scripts/bf16_linear_kernels.py    # adds vLLM's kernel (after `make peers`)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

# One Qwen2.5-1.5B decoder layer as flyspec packs it: fused QKV, O, fused gate/up, down (out, in).
SHAPES = ((1536 + 2 * 256, 1536), (1536, 1536), (2 * 8960, 1536), (1536, 8960))


def _ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def _kernels(w: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
    w32 = w.float()
    packed32 = torch.ops.mkldnn._reorder_linear_weight(w32, 1)
    kernels: dict[str, Callable[[], object]] = {
        "flyspec packed bf16": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "F.linear bf16": lambda: torch.nn.functional.linear(x, w),
        "packed float32 copy": lambda: torch.ops.mkldnn._linear_pointwise(
            x.float(), packed32, None, "none", [], ""
        ).bfloat16(),
    }
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return kernels
    if ops._supports_onednn:
        handler = ops.create_onednn_mm(w.t(), 32)
        kernels["vLLM onednn_mm bf16"] = lambda: ops.onednn_mm(handler, x, None)
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,5,16,32", help="activation rows, comma list")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        totals: dict[str, float] = {}
        for n, k in SHAPES:
            w = (torch.randn(n, k, generator=generator) * 0.02).bfloat16()
            x = torch.randn(rows, k, generator=generator).bfloat16()
            for name, fn in _kernels(w, x).items():
                totals[name] = totals.get(name, 0.0) + _ms(fn, args.repeats)
        base = totals["flyspec packed bf16"]
        print(f"{rows} rows: " + "; ".join(f"{n} {t:.2f} ms ({t / base:.2f}x)" for n, t in totals.items()))


if __name__ == "__main__":
    main()
