"""Decode step time at given batch sizes and context length, in thread CPU time (one torch thread).

    OMP_NUM_THREADS=1 python scripts/decode_step_time.py --model smollm2-135m-instruct \
        --batch-sizes 1,16 --context 256 --steps 24

For each batch size the script prefills B distinct random prompts of --context tokens (untimed), then
times --steps target-only greedy decode steps with `time.thread_time` and prints the median ms per step
(and the min), one line per batch size, plus a JSON line with everything. It drives `LLMEngine` step by
step (as the server does) through its long-standing public methods, so the same command runs on an older
checkout (PYTHONPATH=that tree) to compare KV cache layouts: run the two trees in turns, several rounds, and
compare medians (a shared machine's CPU time still moves by 10-30% between runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from flyspec.config import EngineConfig
from flyspec.engine.engine import LLMEngine
from flyspec.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per batch size")
    parser.add_argument("--batch-invariant", action="store_true", help="engine option batch_invariant=True")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    # Only passed when set, so that the script runs on checkouts from before the option.
    options = {"batch_invariant": True} if args.batch_invariant else {}
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            max_num_seqs=max(sizes),
            max_model_len=args.context + args.steps + 8,
            **options,
        )
    )
    vocab = engine.vocab_size
    eos = engine.eos_token_ids
    gen = torch.Generator().manual_seed(0)
    results = {}
    for size in sizes:
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 2, ignore_eos=True)
        for i in range(size):
            ids = torch.randint(0, vocab, (args.context,), generator=gen).tolist()
            ids = [t if t not in eos else (t + 1) % vocab for t in ids]
            engine.add_request(f"b{size}-{i}", ids, params)
        # Step until every request has its first token (all prompts are in), then time pure decode steps.
        started: set[str] = set()
        while len(started) < size:
            started.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
        times = []
        for _ in range(args.steps):
            start = time.thread_time()
            engine.step()
            times.append(time.thread_time() - start)
        while engine.has_unfinished_requests():
            engine.step()
        results[size] = {"median_ms": 1000 * statistics.median(times), "min_ms": 1000 * min(times)}
        print(
            f"batch {size}: median {results[size]['median_ms']:.2f} ms, min {results[size]['min_ms']:.2f} ms"
        )
    print(json.dumps({"model": args.model, "context": args.context, "steps": args.steps, "results": results}))


if __name__ == "__main__":
    main()
