"""Time the linear layers of a whole model in each weight format, as a decode step meets them.

One pass multiplies every linear layer of the Qwen2.5 1.5B decoder (--model 1.5b: 28 layers of fused
qkv [2048 x 1536], o, fused gate/up [17920 x 1536] and down [1536 x 8960]; --model 0.5b: 24 layers of
hidden 896, MLP 4864; random weights of the real shapes) by an input of M rows. The weights of all
layers together (1.3 GB in int8 for the 1.5B) do not fit in the CPU caches, so each pass reads them
from memory, as a real decode step does; timing one matrix in a loop would measure the cache instead.
Prints milliseconds per decoder layer (a pass over --layers layers, divided by their number), the
median of --repeats (the formats take turns), for bf16 `F.linear`, a float32 copy of the weights
(`Float32Linear`, which `auto` considers where bf16 has no hardware support), `Int8Linear` and
`Int4Linear` (flyspec/models/quantization.py) on our few-row kernel and on torch's
`_weight_int4pack_mm_for_cpu`, the fallback (FLYSPEC_INT4_KERNEL=torch), with the same int4 weights.

`--clock thread` times the CPU time of this thread (with `--threads 1`): on a machine that other jobs
share, wall time with two OpenMP threads mostly measures when the second thread got a core. Run with
FLYSPEC_CPU_ISA=avx2 to measure what an AVX2-only CPU runs (flyspec/cpuinfo.py; the first line printed
names the CPU and the kernels).

With --bf16 the same passes compare bfloat16 kernels instead: `F.linear`, the prepacked oneDNN layout
flyspec uses (`PackedLinear`), a float32 copy of the weights (activations upcast), and, when run from
vLLM's venv, vLLM's own `onednn_mm`.

    python scripts/quant_kernels.py --rows 1,2,4,5,8,16
    FLYSPEC_CPU_ISA=avx2 python scripts/quant_kernels.py --rows 1,4 --threads 1 --clock thread
    PYTHONPATH=. .peers/vllm/bin/python scripts/quant_kernels.py --bf16 --rows 1,16,32 --layers 14
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from flyspec import cpuinfo
from flyspec.models import int4_kernel, int8_kernel
from flyspec.models.kernel_check import onednn_kernels
from flyspec.models.packed_linear import PackedLinear
from flyspec.models.quantization import Float32Linear, Int4Linear, Int8Linear

# (out, in) of one decoder layer: fused qkv, o, fused gate/up, down; and the number of layers.
MODELS = {
    "1.5b": (((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)), 28),
    "0.5b": (((1152, 896), (896, 896), (9728, 896), (896, 4864)), 24),
}


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
        "float32 copy": [Float32Linear(w, None, torch.bfloat16) for w in weights],
    }
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return layers
    if ops._supports_onednn:
        handlers = [ops.create_onednn_mm(w.t(), 32) for w in weights]
        layers["vLLM onednn_mm"] = [lambda x, h=h: ops.onednn_mm(h, x, None) for h in handlers]
    return layers


def _onednn_int8_layers(weights: list[torch.Tensor]) -> list[Int8Linear]:
    """Int8Linear layers on oneDNN's kernel, where ours would run (FLYSPEC_INT8_KERNEL=onednn)."""
    saved = os.environ.get("FLYSPEC_INT8_KERNEL")
    os.environ["FLYSPEC_INT8_KERNEL"] = "onednn"
    int8_kernel.library.cache_clear()
    try:
        return [Int8Linear(w, None, torch.bfloat16) for w in weights]
    finally:
        os.environ.pop("FLYSPEC_INT8_KERNEL")
        if saved is not None:
            os.environ["FLYSPEC_INT8_KERNEL"] = saved
        int8_kernel.library.cache_clear()


def _format_layers(weights: list[torch.Tensor]) -> dict[str, list]:
    layers = {
        "bf16": [lambda x, w=w: torch.nn.functional.linear(x, w) for w in weights],
        "float32": [Float32Linear(w, None, torch.bfloat16) for w in weights],
        "int8": [Int8Linear(w, None, torch.bfloat16) for w in weights],
        "int4": _int4_layers(weights, "ours"),
        "int4 torch": _int4_layers(weights, "torch"),
    }
    if int8_kernel.library() is not None:  # also oneDNN's int8, which ours replaces on this CPU
        layers["int8 oneDNN"] = _onednn_int8_layers(weights)
    return layers


def _kernels(layers: dict[str, list], k: int) -> str:
    """Which library kernel each column ran (oneDNN's verbose log of one call; `aten` when none)."""
    x = torch.randn(1, k).to(torch.bfloat16)
    names = []
    int8_ours = int8_kernel.describe()
    for name, fns in layers.items():
        if name.startswith("int4"):
            continue
        if name == "int8" and int8_ours is not None:
            names.append(f"int8: {int8_ours}")
            continue
        ran = onednn_kernels(lambda fn=fns[0]: fn(x))
        names.append(f"{name}: {', '.join(ran) if ran else 'aten/MKL'}")
    return "; ".join([*names, f"int4: {int4_kernel.describe()}"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="1.5b")
    parser.add_argument("--rows", default="1,2,4,5,8,16")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--clock", choices=("wall", "thread"), default="wall")
    parser.add_argument("--bf16", action="store_true", help="compare bfloat16 kernels instead of formats")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and torch.get_num_threads() != 1:
        parser.error("--clock thread measures one thread: add --threads 1")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    shapes, depth = MODELS[args.model]
    depth = args.layers or depth
    torch.manual_seed(0)
    weights = [(torch.randn(n, k) * 0.02).to(torch.bfloat16) for _ in range(depth) for n, k in shapes]
    if args.bf16:
        layers = _bf16_layers(weights)
        others = [name for name in layers if name != "bf16 packed"]
        gain_header = " | ".join(f"{name} / packed" for name in others)
    else:
        layers = _format_layers(weights)
        gain_header = "int4 speed-up over int8 | over bf16 | over torch's int4"
    print(
        f"{cpuinfo.describe_cpu()}; {torch.get_num_threads()} thread(s), {args.clock} clock, "
        f"{args.model} shapes x {depth} layers; ms per decoder layer"
    )
    if not args.bf16:
        print(_kernels(layers, shapes[0][1]))
    names = " | ".join(f"{name} (ms)" for name in layers)
    print(f"| rows M | {names} | {gain_header} |")
    print("|---:|" + "---:|" * (len(layers) + gain_header.count("|") + 1))
    for m in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(m, k).to(torch.bfloat16) for k in {k for _, k in shapes}}
        order = list(shapes) * depth
        times: dict[str, list[float]] = {name: [] for name in layers}
        # Formats take turns within each repeat, so a slow minute of this VM hits all of them alike.
        for rep in range(args.repeats + 1):  # the first round warms up
            for name, fns in layers.items():
                start = clock()
                for fn, (_, k) in zip(fns, order, strict=True):
                    fn(inputs[k])
                if rep:
                    times[name].append(clock() - start)
        medians = {name: 1000 * statistics.median(t) / depth for name, t in times.items()}
        cells = " | ".join(f"{medians[name]:.2f}" for name in layers)
        if args.bf16:
            gains = " | ".join(f"{medians[name] / medians['bf16 packed']:.2f}x" for name in others)
        else:
            int4 = medians["int4"]
            gains = " | ".join(f"{medians[name] / int4:.2f}x" for name in ("int8", "bf16", "int4 torch"))
        print(f"| {m} | {cells} | {gains} |", flush=True)


if __name__ == "__main__":
    main()
