"""Microbenchmark of `verify` at engine scale (default B=64, K=8, V=151,936) on CPU.

Times standard and FLy verification for greedy and random rows (random rows with and without draft
probabilities), and, for scale, one plain reduction over the target probabilities (the cost of a single
memory pass). Prints a table; `--json` ends the output with one JSON object.

    .venv/bin/python scripts/bench_verify.py [--batch 64] [--k 8] [--vocab 151936] [--repeats 7]
        [--threads N] [--json]

On a shared machine, `--threads 1` gives steadier numbers: with more torch threads than free cores every
parallel kernel waits for a descheduled thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flyspec.spec_decode.verify import FlyParams, verify


def make_inputs(batch: int, k: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Target and draft distributions shaped like a real step: mostly peaked rows, some flat ones, drafts
    that agree with the target argmax 70% of the time (so rejections land at varied positions)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.where(torch.rand(batch, k + 1, 1, generator=g) < 0.7, 8.0, 2.0)
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=g) * scale, dim=-1)
    draft_probs = torch.softmax(torch.randn(batch, k, vocab, generator=g) * 6.0, dim=-1)
    agree = torch.rand(batch, k, generator=g) < 0.7
    draft = torch.where(agree, target[:, :k].argmax(-1), torch.randint(0, vocab, (batch, k), generator=g))
    return {"draft": draft, "target": target, "draft_probs": draft_probs}


def time_call(fn, repeats: int) -> float:
    """Median wall time in milliseconds over `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="end with one JSON object")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    x = make_inputs(args.batch, args.k, args.vocab, seed=0)
    fly = FlyParams(window_size=min(6, args.k - 1), entropy_threshold=0.3, entropy_top_k=3)
    all_greedy = torch.ones(args.batch, dtype=torch.bool)
    all_random = torch.zeros(args.batch, dtype=torch.bool)
    mixed = torch.arange(args.batch) % 2 == 0
    cases = [
        ("standard", "greedy", all_greedy, True),
        ("standard", "random", all_random, True),
        ("standard", "random, no Q", all_random, False),
        ("standard", "mixed", mixed, True),
        ("fly", "greedy", all_greedy, True),
        ("fly", "random", all_random, True),
        ("fly", "random, no Q", all_random, False),
        ("fly", "mixed", mixed, True),
    ]
    results = []
    one_pass = time_call(lambda: x["target"].sum(), args.repeats)
    for method, rows, greedy, with_q in cases:
        generator = torch.Generator().manual_seed(1)

        def call(greedy=greedy, with_q=with_q, method=method, generator=generator):
            return verify(
                x["draft"],
                x["target"],
                x["draft_probs"] if with_q else None,
                greedy=greedy,
                policy=fly if method == "fly" else None,
                generator=generator,
            )

        out = call()
        ms = time_call(call, args.repeats)
        results.append(
            {
                "method": method,
                "rows": rows,
                "ms": round(ms, 2),
                "mean_accepted": round(out.num_accepted.double().mean().item(), 3),
                "mean_forgiven": round(out.num_forgiven.double().mean().item(), 3),
            }
        )

    print(
        f"verify on CPU: B={args.batch} K={args.k} V={args.vocab}, {torch.get_num_threads()} threads, "
        f"median of {args.repeats}; one sum() over target_probs takes {one_pass:.2f} ms"
    )
    print(f"{'method':<10}{'rows':<15}{'ms':>9}{'accepted':>10}{'forgiven':>10}")
    for r in results:
        print(
            f"{r['method']:<10}{r['rows']:<15}{r['ms']:>9.2f}{r['mean_accepted']:>10.3f}{r['mean_forgiven']:>10.3f}"
        )
    if args.json:
        print(
            json.dumps(
                {
                    "batch": args.batch,
                    "k": args.k,
                    "vocab": args.vocab,
                    "threads": torch.get_num_threads(),
                    "one_pass_ms": round(one_pass, 2),
                    "results": results,
                }
            )
        )


if __name__ == "__main__":
    main()
