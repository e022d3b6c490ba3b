"""A one-sequence decode to sample with py-spy: where a token's time goes, by Python line.

    py-spy record -r 200 -f raw -o one_row.raw -- python scripts/one_row_profile.py --threads 2
    python scripts/one_row_profile.py --summarise one_row.raw

The first command generates --tokens greedy tokens (after a warm-up) for one prompt on the target in the
given weight format; the second prints the share of the decode steps' samples (--within: the samples
with that frame on the stack) by innermost frame and by frame anywhere on the stack. The int4/int8
kernels are C++ called through ctypes: their time shows on the line of flyspec/models/int4_kernel.py
that calls them (torch.profiler does not see them at all).
"""

from __future__ import annotations

import argparse
import collections
import sys


def summarise(path: str, top: int, within: str = "") -> None:
    """Print the top frames of a py-spy raw (collapsed stacks) file, counting only the samples with a
    frame containing `within` on their stack."""
    total, innermost, anywhere = 0, collections.Counter(), collections.Counter()
    with open(path) as lines:
        for line in lines:
            stack, _, count = line.rstrip().rpartition(" ")
            frames, n = stack.split(";"), int(count)
            if within not in stack:
                continue
            total += n
            innermost[frames[-1]] += n
            for frame in set(frames):
                anywhere[frame] += n
    print(f"{total} samples")
    for title, counter in (("innermost frame", innermost), ("anywhere on the stack", anywhere)):
        print(f"\nby {title}:")
        for frame, n in counter.most_common(top):
            print(f"{n / total:6.1%}  {frame}")


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--quantization", default="int4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=800, help="greedy tokens to generate (sampled)")
    parser.add_argument("--summarise", metavar="RAW", help="print the top frames of a py-spy raw file")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--within",
        default="LLMEngine._decode",
        help="with --summarise: count only samples with this frame on the stack (default: decode steps, "
        "not the loading)",
    )
    args = parser.parse_args()
    if args.summarise:
        summarise(args.summarise, args.top, args.within)
        return
    import torch

    from flyspec import LLM
    from flyspec.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(model=args.model, quantization=args.quantization, max_num_seqs=1, max_model_len=2048)
    llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(["Write a Python function that sorts a list."], params, use_tqdm=False)
    print(f"generated {args.tokens} tokens", file=sys.stderr)


if __name__ == "__main__":
    main()
