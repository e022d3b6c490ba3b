"""Profile flyspec's decode with torch.profiler: which operators take the time, how many operator calls a
step makes, and how much of the time no operator accounts for (Python and dispatch between operators).

    .venv/bin/python scripts/profile_decode.py [--model qwen2.5-coder-1.5b-instruct]
        [--draft qwen2.5-coder-0.5b-instruct] [--k 4] [--fly] [--batch 1] [--max-tokens 64]
        [--quantization none] [--draft-quantization int4] [--threads 2] [--rows 25]

--k 0 profiles target-only decoding. The run first generates once untimed (warm-up), then profiles one
greedy generation of --max-tokens tokens for each of the first --batch GSM8K prompts at once, and prints
the operator table sorted by self CPU time, the operator calls per engine step (a count, so it does not
move with a busy machine as times do), and the share of wall time spent outside operators. For a sampling
profile of the Python side, run the same command under py-spy: `py-spy record -r 200 -o decode.svg --
.venv/bin/python scripts/profile_decode.py ...`.
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
    parser.add_argument("--batch", type=int, default=1, help="GSM8K prompts decoded together")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="none", help='"none", "int8", "int4" or "auto"')
    parser.add_argument("--draft-quantization", default=None, help="the draft's own (default: as above)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rows", type=int, default=25, help="operators to list")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    spec = None
    if args.k > 0:
        spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
        if args.fly:
            spec["rejection_sample_method"] = "fly"
        if args.draft_quantization is not None:
            spec["quantization"] = args.draft_quantization
    quantization = None if args.quantization == "none" else args.quantization
    llm = LLM(
        args.model,
        speculative_config=spec,
        max_num_seqs=args.batch,
        dtype=args.dtype,
        quantization=quantization,
    )
    prompts = [p.token_ids for p in load_prompts("gsm8k", args.batch, llm.get_tokenizer())]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    op_seconds = sum(e.self_cpu_time_total for e in table) / 1e6
    calls = sum(e.count for e in table)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # Decode steps: the longest request's verification steps (or tokens without speculation), plus the
    # prefill step.
    steps = 1 + max(o.metrics.num_drafts or len(o.outputs[0].token_ids) - 1 for o in outs)
    print(
        f"{tokens} tokens for {args.batch} requests in {wall:.2f} s ({tokens / wall:.2f} tokens/s, "
        f"{1000 * wall / steps:.1f} ms per step over {steps} steps); {calls} operator calls, "
        f"{calls / steps:.0f} per step"
    )
    print(
        f"operators: {op_seconds:.2f} s self time; outside operators (Python, dispatch): "
        f"{max(0.0, wall - op_seconds):.2f} s = {100 * max(0.0, wall - op_seconds) / wall:.1f}% of wall time "
        f"(torch threads: {torch.get_num_threads()})"
    )


if __name__ == "__main__":
    main()
