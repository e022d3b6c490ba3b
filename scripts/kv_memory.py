"""KV cache memory against concurrent long requests: resident memory (RSS) and KV bytes, while they run
and after they end, one fresh process per concurrency.

    python scripts/kv_memory.py --model smollm2-135m-instruct --concurrency 1,8,32 \
        --prompt-tokens 1024 --max-tokens 256 [--json]

For each concurrency N a subprocess loads the model (max_num_seqs = the largest N), records its RSS,
sends N requests of --prompt-tokens random prompt tokens that each generate --max-tokens tokens (greedy,
ignore_eos), samples RSS and the engine's KV bytes after every step, and reports: RSS before, peak RSS
growth, RSS growth left after all requests ended, and KV bytes at the peak and after. KV bytes are, on
the paged cache, the bytes of the blocks requests hold (plus the prompt blocks kept for prefix sharing,
reported apart); on the older slot cache (same command with PYTHONPATH set to an older checkout), the
bytes of its allocated tensors. The prompts are distinct, so prefix sharing saves nothing here. Nothing
is timed; the numbers depend on the model, dtype and lengths only (and on the allocator for RSS).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _kv_bytes(engine) -> tuple[int, int]:
    """(bytes held by requests, bytes kept for prefix sharing); the slot cache's tensors on older code."""
    if hasattr(engine, "kv_cache_used_bytes"):
        return engine.kv_cache_used_bytes, engine.kv_cache_cached_bytes
    total = engine.target.cache.memory_bytes()
    runner = getattr(engine.drafter, "runner", None)
    return total + (runner.cache.memory_bytes() if runner is not None else 0), 0


def _one(args: argparse.Namespace) -> dict:
    import torch

    from flyspec.config import EngineConfig
    from flyspec.engine.engine import LLMEngine
    from flyspec.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.prompt_tokens + args.max_tokens + 8,
        )
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(100, min(engine.vocab_size, 30000), (args.prompt_tokens,), generator=gen).tolist()
        for _ in range(args.one)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    before = _rss()
    peak_rss, peak_kv = before, 0
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        peak_rss = max(peak_rss, _rss())
        peak_kv = max(peak_kv, _kv_bytes(engine)[0])
    used, cached = _kv_bytes(engine)
    capacity = getattr(engine, "kv_cache_capacity_bytes", None)
    return {
        "concurrency": args.one,
        "rss_before_mib": before / 2**20,
        "rss_peak_growth_mib": (peak_rss - before) / 2**20,
        "rss_growth_after_mib": (_rss() - before) / 2**20,
        "kv_peak_mib": peak_kv / 2**20,
        "kv_after_mib": used / 2**20,
        "kv_cached_after_mib": cached / 2**20,
        "kv_capacity_mib": None if capacity is None else capacity / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="end with one JSON line")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the subprocess: one concurrency
    parser.add_argument("--max-num-seqs", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(_one(args)))
        return
    levels = [int(n) for n in args.concurrency.split(",")]
    rows = []
    print("requests  RSS before  RSS peak +  RSS after +  KV peak  KV after (+ kept for sharing)  (MiB)")
    for n in levels:
        command = [
            sys.executable,
            __file__,
            "--model", args.model,
            "--dtype", args.dtype,
            "--prompt-tokens", str(args.prompt_tokens),
            "--max-tokens", str(args.max_tokens),
            "--one", str(n),
            "--max-num-seqs", str(max(levels)),
        ]  # fmt: skip
        result = subprocess.run(command, capture_output=True, text=True, check=True)
        row = json.loads(result.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{n:8d}  {row['rss_before_mib']:10.0f}  {row['rss_peak_growth_mib']:10.0f}  "
            f"{row['rss_growth_after_mib']:11.0f}  {row['kv_peak_mib']:7.0f}  {row['kv_after_mib']:8.0f} "
            f"(+ {row['kv_cached_after_mib']:.0f})",
            flush=True,
        )
    if args.json:
        print(json.dumps({"model": args.model, "prompt_tokens": args.prompt_tokens, "rows": rows}))


if __name__ == "__main__":
    main()
