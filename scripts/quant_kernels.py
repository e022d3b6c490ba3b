"""Time the linear layers of a whole model in each weight format, as a decode step meets them.

One pass multiplies every linear layer of the Qwen2.5 1.5B decoder (28 layers of qkv, o, gate/up and
down; random weights of the real shapes) by an input of M rows. The weights of all layers together
(1.3 GB in int8) do not fit in the CPU caches, so each pass reads them from memory, as a real decode step
does; timing one matrix in a loop would measure the cache instead. Prints milliseconds per pass, the
median of --repeats (the formats take turns), for bf16 `F.linear`, `Int8Linear`, `Int4Linear`
(flyspec/models/quantization.py, our few-row kernel) and torch's `_weight_int4pack_mm_for_cpu` on the same
int4 weights.

    python scripts/quant_kernels.py --rows 1,2,4,5,8,16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flyspec.models.quantization import Int4Linear, Int8Linear, quantize_per_group_int4

# (out, in) of one Qwen2.5 1.5B decoder layer: fused qkv, o, fused gate/up, down.
SHAPES = ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960))


def _torch_int4(w: torch.Tensor):
    """torch's own int4 kernel on the same quantized weights (what Int4Linear used before its own)."""
    codes, pairs = quantize_per_group_int4(w, 64)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    pairs = pairs.to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 64, pairs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,5,8,16")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    layers: dict[str, list] = {"bf16": [], "int8": [], "int4": [], "int4 torch": []}
    for _ in range(args.layers):
        for n, k in SHAPES:
            w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
            layers["bf16"].append(lambda x, w=w: torch.nn.functional.linear(x, w))
            layers["int8"].append(Int8Linear(w, None, torch.bfloat16))
            layers["int4"].append(Int4Linear(w, None, torch.bfloat16))
            layers["int4 torch"].append(_torch_int4(w))
    names = " | ".join(f"{name} (ms)" for name in layers)
    print(f"| rows M | {names} | int4 speed-up over int8 | over torch's int4 |")
    print("|---:|" + "---:|" * (len(layers) + 2))
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
        gains = f"{medians['int8'] / medians['int4']:.2f}x | {medians['int4 torch'] / medians['int4']:.2f}x"
        print(f"| {m} | {cells} | {gains} |", flush=True)


if __name__ == "__main__":
    main()
