"""Where speculation pays on this CPU: batches of GSM8K questions decoded in different arrangements by one
engine (the demo's: Qwen2.5-Coder 1.5B target, 0.5B draft, K=4, FLy, bfloat16, quantization "auto"),
the arrangements taking turns in one process, and how many cores the process kept busy.

    python scripts/speculation_payoff.py --runs standard+fly:16,target_only+fly:16 --rounds 2
    python scripts/speculation_payoff.py --runs standard:1,target_only:1,standard:16,target_only:16

A run is `MODES:N`: N questions, each sent once per mode in MODES (joined by "+"), all at once, so the
batch is N x len(MODES) requests (beyond --max-num-seqs they queue). A mode is a
SamplingParams.verification value: "standard" (lossless speculative decoding), "fly" (the engine's
policy), "target_only" (no drafts), "draft_only" (the draft model alone). Requests are greedy with
ignore_eos and --max-tokens each, so every arrangement makes the same number of tokens; every prompt is
prefilled once before the runs, so each run reuses the same cached prompt blocks and times the decoding.
One line per run: wall seconds, output tokens per second (all arms, and per arm over the same wall
time), and the process's CPU seconds over wall seconds ("cores busy": user + system time of every thread, from
/proc/self/stat); a JSON line per run and a closing table of the medians over --rounds. On a shared
machine wall time measures the other jobs too: run with --threads 1 and compare tokens per CPU second of
the engine thread (the work each arrangement costs), as docs/performance.md does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from flyspec.bench.prompts import load_prompts
from flyspec.cpuinfo import describe_cpu
from flyspec.llm import LLM
from flyspec.sampling_params import SamplingParams

_MODES = {"standard": "standard", "fly": None, "target_only": "target_only", "draft_only": "draft_only"}


def cpu_seconds() -> float:
    """User plus system CPU time of this process, all threads (fields 14 and 15 of /proc/self/stat)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def parse_runs(text: str) -> list[tuple[list[str], int]]:
    runs = []
    for item in text.split(","):
        modes, _, n = item.partition(":")
        names = modes.split("+")
        unknown = [m for m in names if m not in _MODES]
        if unknown or not n.isdigit():
            raise SystemExit(f"bad run {item!r}: MODES:N with modes from {', '.join(_MODES)}")
        runs.append((names, int(n)))
    return runs


def run_once(llm: LLM, prompts: list[list[int]], modes: list[str], n: int, max_tokens: int) -> dict:
    items, params = [], []
    for i in range(n):
        for mode in modes:
            items.append(prompts[i])
            params.append(
                SamplingParams(
                    temperature=0, max_tokens=max_tokens, ignore_eos=True, verification=_MODES[mode]
                )
            )
    cpu0, thread0, wall0 = cpu_seconds(), time.thread_time(), time.perf_counter()
    outs = llm.generate(items, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
    thread = time.thread_time() - thread0
    per_arm = dict.fromkeys(modes, 0)
    for i, out in enumerate(outs):
        per_arm[modes[i % len(modes)]] += len(out.outputs[0].token_ids)
    tokens = sum(per_arm.values())
    return {
        "run": f"{'+'.join(modes)}:{n}",
        "requests": len(items),
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / wall, 2),
        "per_arm_tokens_per_s": {m: round(t / wall, 2) for m, t in per_arm.items()},
        "cores_busy": round(cpu / wall, 2),
        # With --threads 1 the engine thread does all the work: tokens per CPU second of it measure the
        # cost of the work whatever else the machine runs (wall time does not, on a shared machine).
        "tokens_per_cpu_s": round(tokens / thread, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--quantization", default="auto", help='"auto", "none", "int8", "int4"')
    parser.add_argument(
        "--draft-quantization", default=None, help="the draft's own format (default: as --quantization)"
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", default="standard+fly:16,target_only+fly:16")
    parser.add_argument("--rounds", type=int, default=1, help="the runs repeated in turn")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    runs = parse_runs(args.runs)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    spec = {"model": args.draft, "num_speculative_tokens": args.k, "rejection_sample_method": "fly"}
    if args.draft_quantization is not None:
        spec["quantization"] = args.draft_quantization
    quantization = None if args.quantization == "none" else args.quantization
    llm = LLM(
        args.target,
        speculative_config=spec,
        dtype=args.dtype,
        quantization=quantization,
        max_num_seqs=args.max_num_seqs,
    )
    print(f"CPU: {describe_cpu()}; weights {llm.weight_formats}; ONEDNN_MAX_CPU_ISA="
          f"{os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}", flush=True)  # fmt: skip
    llm.warm_up(time_limit_s=3600)  # a shared machine may be slow; the warm-up only pays one-time costs
    prompts = [p.token_ids for p in load_prompts("gsm8k", max(n for _, n in runs), llm.get_tokenizer())]
    # Every prompt is prefilled once before the timed runs, so that each run finds the same prompt blocks
    # in the prefix cache (else the first run to send a question pays its prefill and the next not).
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    results: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for modes, n in runs:
            result = run_once(llm, prompts, modes, n, args.max_tokens)
            results.setdefault(result["run"], []).append(result)
            print(json.dumps(result), flush=True)
    print(
        "\n| run | requests | tokens/s | per arm | tokens per engine-thread CPU s | cores busy |"
        "\n|---|---:|---:|---|---:|---:|"
    )
    for name, rs in results.items():
        med = statistics.median(r["tokens_per_s"] for r in rs)
        arms = ", ".join(f"{m} {statistics.median(r['per_arm_tokens_per_s'][m] for r in rs):.1f}"
                         for m in rs[0]["per_arm_tokens_per_s"])  # fmt: skip
        per_cpu = statistics.median(r["tokens_per_cpu_s"] for r in rs)
        busy = statistics.median(r["cores_busy"] for r in rs)
        print(f"| {name} | {rs[0]['requests']} | {med:.1f} | {arms} | {per_cpu:.2f} | {busy:.2f} |")


if __name__ == "__main__":
    main()
