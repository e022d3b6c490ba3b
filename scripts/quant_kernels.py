"""Time the linear layers of a whole model in each weight format, as a decode step meets them.

One pass multiplies every linear layer of the Qwen2.5 1.5B decoder (28 layers of qkv, o, gate/up and
down; random weights of the real shapes) by an input of M rows. The weights of all layers together
(1.3 GB in int8) do not fit in the CPU caches, so each pass reads them from memory, as a real decode step
does; timing one matrix in a loop would measure the cache instead. Prints milliseconds per pass, the
median of --repeats, for bf16 `F.linear`, `Int8Linear` and `Int4Linear` (flyspec/models/quantization.py).

    python scripts/quant_kernels.py --rows 1,2,4,5,8,16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from flyspec.models.quantization import Int4Linear, Int8Linear

# (out, in) of one Qwen2.5 1.5B decoder layer: fused qkv, o, fused gate/up, down.
SHAPES = ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,5,8,16")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    layers: dict[str, list] = {"bf16": [], "int8": [], "int4": []}
    for _ in range(args.layers):
        for n, k in SHAPES:
            w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
            layers["bf16"].append(lambda x, w=w: torch.nn.functional.linear(x, w))
            layers["int8"].append(Int8Linear(w, None, torch.bfloat16))
            layers["int4"].append(Int4Linear(w, None, torch.bfloat16))
    print(f"| rows M | {' | '.join(f'{name} (ms)' for name in layers)} | int4 speed-up over int8 |")
    print("|---:|" + "---:|" * (len(layers) + 1))
    for m in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {k for _, k in SHAPES}}
        shapes = list(SHAPES) * args.layers
        medians = {}
        for name, fns in layers.items():
            times = []
            for _ in range(args.repeats + 1):  # the first pass warms up
                start = time.perf_counter()
                for fn, (_, k) in zip(fns, shapes, strict=True):
                    fn(inputs[k])
                times.append(time.perf_counter() - start)
            medians[name] = 1000 * statistics.median(times[1:])
        cells = " | ".join(f"{medians[name]:.1f}" for name in layers)
        print(f"| {m} | {cells} | {medians['int8'] / medians['int4']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
