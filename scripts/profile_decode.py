"""Profile flyspec's batch-1 decode with torch.profiler: which operators take the time, and how much of the
wall time no operator accounts for (Python and dispatch overhead).

    .venv/bin/python scripts/profile_decode.py [--model qwen2.5-coder-1.5b-instruct]
        [--draft qwen2.5-coder-0.5b-instruct] [--k 4] [--fly] [--max-tokens 64] [--rows 25]

--k 0 profiles target-only decoding. The run first generates once untimed (warm-up), then profiles one
greedy generation of --max-tokens tokens for the first GSM8K prompt, prints the operator table sorted by
self CPU time, and the share of wall time spent outside operators. For a sampling profile of the Python
side, run the same command under py-spy: `py-spy record -r 200 -o decode.svg -- .venv/bin/python
scripts/profile_decode.py ...`.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flyspec.bench.prompts import load_prompts
from flyspec.llm import LLM
from flyspec.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step; 0 = target-only")
    parser.add_argument("--fly", action="store_true", help="FLy verification (default window)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rows", type=int, default=25, help="operators to list")
    args = parser.parse_args()

    spec = None
    if args.k > 0:
        spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
        if args.fly:
            spec["rejection_sample_method"] = "fly"
    llm = LLM(args.model, speculative_config=spec, max_num_seqs=1)
    prompt = load_prompts("gsm8k", 1, llm.get_tokenizer())[0].token_ids
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        wall = time.perf_counter() - start
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    op_seconds = sum(e.self_cpu_time_total for e in table) / 1e6
    tokens = len(out.outputs[0].token_ids)
    steps = out.metrics.num_drafts or tokens
    print(
        f"{tokens} tokens in {wall:.2f} s ({tokens / wall:.2f} tokens/s, "
        f"{1000 * wall / steps:.1f} ms per step)"
    )
    print(
        f"operators: {op_seconds:.2f} s self time; outside operators (Python, dispatch): "
        f"{max(0.0, wall - op_seconds):.2f} s = {100 * max(0.0, wall - op_seconds) / wall:.1f}% of wall time "
        f"(torch threads: {torch.get_num_threads()})"
    )


if __name__ == "__main__":
    main()
