"""How often a request's output changes with what else is in its batch: each prompt alone (batch 1) against
all prompts together (batch N), greedy and seeded sampling, per dtype, with and without batch_invariant.

    OMP_NUM_THREADS=2 python scripts/batch_invariance.py --model smollm2-135m-instruct \
        --dtypes bfloat16,float32 --modes ordinary,invariant --num-prompts 32 --max-tokens 64

The prompts are the first GSM8K questions through the chat template (flyspec.bench.prompts). "alone" runs
every prompt by itself on a fresh engine; "batch" runs all of them at once on another fresh engine
(max_num_seqs = N), so neither sees the other's prefix cache. Seeded sampling uses temperature 0.8,
top_p 0.95 and seed 1000 + i for prompt i. For every (dtype, mode, sampling) the script prints how many of
the N outputs differ between alone and batch and the mean share of tokens before the first difference,
then one JSON line with everything. No timing: the numbers do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json

from flyspec.bench.prompts import load_prompts
from flyspec.llm import LLM
from flyspec.sampling_params import SamplingParams


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--modes", default="ordinary,invariant")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    rows = []
    for dtype in args.dtypes.split(","):
        for mode in args.modes.split(","):
            invariant = mode == "invariant"

            def engine(batch: int, dtype: str = dtype, invariant: bool = invariant) -> LLM:
                return LLM(args.model, dtype=dtype, max_num_seqs=batch, batch_invariant=invariant)

            alone_llm = engine(1)
            tokenizer = alone_llm.get_tokenizer()
            prompts = [p.token_ids for p in load_prompts("gsm8k", args.num_prompts, tokenizer)]
            samplings = {
                "greedy": [SamplingParams(temperature=0.0, max_tokens=args.max_tokens)] * len(prompts),
                "seeded": [
                    SamplingParams(temperature=0.8, top_p=0.95, seed=1000 + i, max_tokens=args.max_tokens)
                    for i in range(len(prompts))
                ],
            }
            batch_llm = engine(len(prompts))
            for name, params in samplings.items():
                alone = [
                    alone_llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
                    for p, sp in zip(prompts, params, strict=True)
                ]
                batch = [o.outputs[0].token_ids for o in batch_llm.generate(prompts, params, use_tqdm=False)]
                changed = sum(a != b for a, b in zip(alone, batch, strict=True))
                shared = [
                    _shared_prefix(a, b) / max(len(a), len(b), 1) for a, b in zip(alone, batch, strict=True)
                ]
                row = {
                    "dtype": dtype,
                    "mode": mode,
                    "sampling": name,
                    "changed": changed,
                    "total": len(prompts),
                    "mean_shared_prefix": sum(shared) / len(shared),
                }
                rows.append(row)
                print(
                    f"{dtype:9} {mode:10} {name:7} changed {changed}/{len(prompts)}, "
                    f"mean shared prefix {row['mean_shared_prefix']:.0%}",
                    flush=True,
                )
    print(json.dumps({"model": args.model, "max_tokens": args.max_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
