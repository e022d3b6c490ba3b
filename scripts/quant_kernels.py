"""Time the linear layers of a whole model in each weight format, as a decode step meets them.

One pass multiplies every linear layer of the Qwen2.5 1.5B decoder (28 layers of qkv, o, gate/up and
down; random weights of the real shapes) by an input of M rows. The weights of all layers together
(1.3 GB in int8) do not fit in the CPU caches, so each pass reads them from memory, as a real decode step
does; timing one matrix in a loop would measure the cache instead. Prints milliseconds per pass, the
median of --repeats (the formats take turns), for bf16 `F.linear`, `Int8Linear` and `Int4Linear`
(flyspec/models/quantization.py) on our few-row kernel and on torch's `_weight_int4pack_mm_for_cpu`, the
fallback (FLYSPEC_INT4_KERNEL=torch), with the same int4 weights.

With --bf16 the same passes compare bfloat16 kernels instead: `F.linear`, the prepacked oneDNN layout
flyspec uses (`PackedLinear`), a float32 copy of the weights (activations upcast), and, when run from
vLLM's venv, vLLM's own `onednn_mm`.

    python scripts/quant_kernels.py --rows 1,2,4,5,8,16
    PYTHONPATH=. .peers/vllm/bin/python scripts/quant_kernels.py --bf16 --rows 1,16,32 --layers 14
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from flyspec.models import int4_kernel
from flyspec.models.packed_linear import PackedLinear
from flyspec.models.quantization import Int4Linear, Int8Linear

# (out, in) of one Qwen2.5 1.5B decoder layer: fused qkv, o, fused gate/up, down.
SHAPES = ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960))


def _int4_layers(weights: list[torch.Tensor], kernel: str) -> list[Int4Linear]:
    """Int4Linear layers of `weights` on our kernel ("ours") or on torch's fallback ("torch"), chosen as a
    user would, with FLYSPEC_INT4_KERNEL; without the int8 prefill copy, which these passes never use."""
    saved = os.environ.pop("FLYSPEC_INT4_KERNEL", None)
    if kernel == "torch":
        os.environ["FLYSPEC_INT4_KERNEL"] = "torch"
    int4_kernel.library.cache_clear()
    try:
        return [Int4Linear(w, None, torch.bfloat16, prefill_copy=False) for w in weights]
    finally:
        os.environ.pop("FLYSPEC_INT4_KERNEL", None)
        if saved is not None:
            os.environ["FLYSPEC_INT4_KERNEL"] = saved
        int4_kernel.library.cache_clear()


def _bf16_layers(weights: list[torch.Tensor]) -> dict[str, list]:
    """bfloat16 kernels over the same weights; vLLM's `onednn_mm` only where vllm imports."""
    layers: dict[str, list] = {
        "bf16 packed": [PackedLinear(w, None) for w in weights],
        "bf16": [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights],
        "float32 copy": [
            lambda x, w=w.float(): torch.nn.functional.linear(x.float(), w).bfloat16() for w in weights
        ],
    }
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return layers
    if ops._supports_onednn:
        handlers = [ops.create_onednn_mm(w.t(), 32) for w in weights]
        layers["vLLM onednn_mm"] = [lambda x, h=h: ops.onednn_mm(h, x, None) for h in handlers]
    return layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,5,8,16")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bf16", action="store_true", help="compare bfloat16 kernels instead of formats")
    args = parser.parse_args()
    torch.manual_seed(0)
    weights = [(torch.randn(n, k) * 0.02).to(torch.bfloat16) for _ in range(args.layers) for n, k in SHAPES]
    if args.bf16:
        layers = _bf16_layers(weights)
        others = [name for name in layers if name != "bf16 packed"]
        gain_header = " | ".join(f"{name} / packed" for name in others)
    else:
        layers = {
            "bf16": [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights],
            "int8": [Int8Linear(w, None, torch.bfloat16) for w in weights],
            "int4": _int4_layers(weights, "ours"),
            "int4 torch": _int4_layers(weights, "torch"),
        }
        gain_header = "int4 speed-up over int8 | over torch's int4"
    names = " | ".join(f"{name} (ms)" for name in layers)
    print(f"| rows M | {names} | {gain_header} |")
    print("|---:|" + "---:|" * (len(layers) + gain_header.count("|") + 1))
    for m in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {k for _, k in SHAPES}}
        shapes = list(SHAPES) * args.layers
        times: dict[str, list[float]] = {name: [] for name in layers}
        # Formats take turns within each repeat, so a slow minute of this VM hits all of them alike.
        for rep in range(args.repeats + 1):  # the first round warms up
            for name, fns in layers.items():
                start = time.perf_counter()
                for fn, (_, k) in zip(fns, shapes, strict=True):
                    fn(inputs[k])
                if rep:
                    times[name].append(time.perf_counter() - start)
        medians = {name: 1000 * statistics.median(t) for name, t in times.items()}
        cells = " | ".join(f"{medians[name]:.1f}" for name in layers)
        if args.bf16:
            gains = " | ".join(f"{medians[name] / medians['bf16 packed']:.2f}x" for name in others)
        else:
            gains = (
                f"{medians['int8'] / medians['int4']:.2f}x | {medians['int4 torch'] / medians['int4']:.2f}x"
            )
        print(f"| {m} | {cells} | {gains} |", flush=True)


if __name__ == "__main__":
    main()
