"""Minor page faults per 1,000 generated tokens and peak resident memory of one engine run: counts, not
timings, so they stay valid on a machine that is busy with other work.

    python -m flyspec.bench.faults [--quantization int8] [--batch 32] [--k 8] [--max-tokens 64] [--json]

The engine is set up as the demo's (flyspec/demo/design.py): the Qwen2.5-Coder 1.5B target, the 0.5B
draft of the same vocabulary, K draft tokens, a FLy verifier, `max_num_seqs` = batch, the KV cache sized
for the run. One short wave of `batch` GSM8K questions warms it up (weights, KV pages and the allocator's
pools fault in once; not counted). Then one wave of the next `batch` questions (prefilled in the wave,
as the demo's new questions are) generates `max_tokens` tokens each (greedy, ignore_eos),
the requests' verification taking the `--mix` modes in turn as the demo's arms do (standard speculative
decoding beside FLy by default; `draft_only` is the demo's control), and the process's minor faults
(getrusage `ru_minflt`) over that wave are divided by its generated tokens; the same for the steps that
prefilled no prompt tokens alone (the demo's steady state, where a finished request's slot takes one new
prompt at a time, is mostly such steps). `peak_rss_gb` is the peak
resident size during the wave (Linux: /proc/self/status VmHWM, reset before it), `process_peak_rss_gb`
the peak since the process started (loading included).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from dataclasses import asdict, dataclass
from typing import Any

from flyspec.bench.throughput import DEFAULT_DRAFT, DEFAULT_MODEL

MODES = ("standard", "fly", "draft_only", "target_only")
"""Verification modes a request of the counted wave may take (`--mix`)."""


@dataclass(frozen=True)
class FaultCount:
    """One counted wave: its settings and what it cost in page faults and memory."""

    model: str
    draft: str | None
    quantization: str
    batch: int
    k: int
    mix: tuple[str, ...]
    tokens: int
    minor_faults: int
    minor_faults_per_1k_tokens: float
    decode_tokens: int
    decode_minor_faults_per_1k_tokens: float
    peak_rss_gb: float | None
    process_peak_rss_gb: float
    weight_formats: dict[str, str]


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _reset_peak_rss() -> bool:
    """Start the peak resident size (VmHWM) again from the current size; False where Linux's
    /proc/self/clear_refs is not available."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return True


def _peak_rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _params(mix: tuple[str, ...], max_tokens: int) -> list[Any]:
    from flyspec.sampling_params import SamplingParams

    # verification=None: the engine's own policy (FLy here).
    return [
        SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, verification=None if m == "fly" else m
        )
        for m in mix
    ]


def count_faults(
    *,
    model: str = DEFAULT_MODEL,
    draft: str | None = DEFAULT_DRAFT,
    quantization: str = "int8",
    batch: int = 32,
    k: int = 8,
    mix: tuple[str, ...] = ("standard", "fly"),
    max_tokens: int = 64,
    warmup_tokens: int = 8,
    dtype: str = "bfloat16",
) -> FaultCount:
    """Count one wave's minor faults and peak memory (see the module docstring); ValueError names a bad
    setting."""
    sizes = {"batch": batch, "k": k, "max_tokens": max_tokens, "warmup_tokens": warmup_tokens}
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    bad = [m for m in mix if m not in MODES]
    if not mix or bad:
        raise ValueError(f"mix={list(mix)}: each entry must be one of {', '.join(MODES)}")
    from flyspec.bench.prompts import load_prompts
    from flyspec.llm import LLM

    spec = None
    if draft is not None:
        spec = {"model": draft, "num_speculative_tokens": k, "rejection_sample_method": "fly"}
    elif "draft_only" in mix or "fly" in mix:
        raise ValueError(f"mix={list(mix)}: 'fly' and 'draft_only' need a draft model")
    llm = LLM(
        model,
        speculative_config=spec,
        dtype=dtype,
        quantization=None if quantization == "none" else quantization,
        max_num_seqs=batch,
        kv_cache_request_len=1024 + max_tokens,
    )
    # Other questions than the warm-up's, so that the counted wave prefills its prompts as the demo does
    # (the warm-up's would be found in the prefix cache).
    prompts = load_prompts("gsm8k", 2 * batch, llm.get_tokenizer())
    _run(llm, prompts[:batch], _params(mix, warmup_tokens), None)
    peak_known = _reset_peak_rss()
    counts = _Counts()
    _run(llm, prompts[batch:], _params(mix, max_tokens), counts)
    peak = _peak_rss_bytes() if peak_known else None
    return FaultCount(
        model=model,
        draft=draft,
        quantization=quantization,
        batch=batch,
        k=k,
        mix=tuple(mix),
        tokens=counts.tokens,
        minor_faults=counts.faults,
        minor_faults_per_1k_tokens=1000 * counts.faults / max(counts.tokens, 1),
        decode_tokens=counts.decode_tokens,
        decode_minor_faults_per_1k_tokens=1000 * counts.decode_faults / max(counts.decode_tokens, 1),
        peak_rss_gb=None if peak is None else peak / 1e9,
        # ru_maxrss is in KiB on Linux.
        process_peak_rss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
        weight_formats=llm.weight_formats,
    )


@dataclass
class _Counts:
    tokens: int = 0
    faults: int = 0
    decode_tokens: int = 0
    decode_faults: int = 0


def _run(llm: Any, prompts: list[Any], params: list[Any], counts: _Counts | None) -> None:
    """Generate for `prompts` (request i takes params[i % len(params)]) to the end, adding each step's
    generated tokens and minor faults to `counts`, and to its decode share when the step prefilled no
    prompt tokens. A step's outputs arrive together from `LLM.stream`; a step that only prefills has
    none, so its faults go with the next step that has (which then counts as prefilling too)."""
    stats = llm.stats
    wave = [p.token_ids for p in prompts]
    last = (stats.prompt_tokens, stats.generation_tokens, _minor_faults())

    def add() -> None:
        nonlocal last
        now = (stats.prompt_tokens, stats.generation_tokens, _minor_faults())
        if counts is not None and now[:2] != last[:2]:
            tokens, faults = now[1] - last[1], now[2] - last[2]
            counts.tokens += tokens
            counts.faults += faults
            if now[0] == last[0]:
                counts.decode_tokens += tokens
                counts.decode_faults += faults
        last = now

    for _ in llm.stream(wave, [params[i % len(params)] for i in range(len(wave))]):
        add()
    add()


def main(argv: list[str] | None = None) -> None:
    """The command line (module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m flyspec.bench.faults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="'none': the target alone")
    parser.add_argument("--quantization", default="int8", help="int8, int4, none or auto")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--mix", default="standard,fly", help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="end with the result as one JSON line")
    args = parser.parse_args(argv)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    try:
        result = count_faults(
            model=args.model,
            draft=None if args.draft.lower() == "none" else args.draft,
            quantization=args.quantization,
            batch=args.batch,
            k=args.k,
            mix=tuple(m.strip() for m in args.mix.split(",") if m.strip()),
            max_tokens=args.max_tokens,
            dtype=args.dtype,
        )
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    peak = "n/a" if result.peak_rss_gb is None else f"{result.peak_rss_gb:.2f} GB"
    print(
        f"{result.model} + {result.draft}, {result.quantization}, batch {result.batch}, K={result.k}, "
        f"mix {','.join(result.mix)}: {result.tokens} tokens, {result.minor_faults} minor faults = "
        f"{result.minor_faults_per_1k_tokens:,.0f} per 1,000 tokens "
        f"({result.decode_minor_faults_per_1k_tokens:,.0f} in the steps that prefilled nothing, "
        f"{result.decode_tokens} tokens); peak RSS {peak} during the wave, "
        f"{result.process_peak_rss_gb:.2f} GB since start"
    )
    if args.json:
        print(json.dumps(asdict(result)))


if __name__ == "__main__":
    main()
