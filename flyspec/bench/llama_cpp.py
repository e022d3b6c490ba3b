"""`flyspec bench --peer llama.cpp`: llama.cpp's own benches beside flyspec's decoding, on this CPU.

llama.cpp is the strongest CPU reference for raw decode speed, and users compare with its own tools, so
those are what runs (flyspec/bench/llama_cpp_tools.py): `llama-bench` at one sequence and
`llama-batched-bench` at more, on the zoo's GGUF file of the target (the Q4_K_M file as shipped).
flyspec runs the same model from its safetensors in each weight format asked for, target-only and with
speculative decoding (the zoo's draft, K tokens, standard verification), at the same numbers of
sequences, through the public `LLM.generate`.

The flyspec side is the sweep's: each (weight format, method) is a column of the sweep's `Arm`s, one per
number of sequences (flyspec/bench/sweep.py), whose one engine `BenchRunner` builds (flyspec/bench/
runner.py, prefix caching off) and releases before the next column's; the report is typed
(flyspec/bench/llama_cpp_report.py).

Prefill is excluded on both sides, as llama.cpp's S_TG does (it times the prompt pass apart from the
decode steps): each flyspec measurement generates `n_gen` tokens per sequence and, over the same prompts,
one token, and the rate is B x (n_gen - 1) / (t(n_gen) - t(1)) (prefix caching off, so the second call
prefills like the first). The flyspec prompts are GSM8K questions through the chat template; llama.cpp's
prompt length is their mean, rounded (its prompt tokens are random).

On a shared machine the load changes by the minute, so llama.cpp runs right before and right after
every flyspec measurement, at the same number of sequences, and each ratio is flyspec's rate over the
mean of those two (all runs are in the JSON). Threads: torch's thread count for both. A llama.cpp that is
not installed is skipped with the command that installs it; flyspec's rows are still measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyspec import cpuinfo
from flyspec.bench.llama_cpp_report import DecodeRate, FlyspecColumn, LlamaCppReport
from flyspec.bench.llama_cpp_tools import LlamaCppBench, Speculation, missing
from flyspec.bench.sweep import Arm

DEFAULT_SEQUENCES = (1, 16, 32)
DEFAULT_FORMATS = ("int8", "int4")


@dataclass(frozen=True)
class LlamaCppSettings:
    """One comparison: the target and its draft model, the weight formats of flyspec's columns (None:
    the weights as loaded), the numbers of sequences, K, the new tokens per sequence, the repeated
    1-token/n-token pairs per measurement, threads (None: torch's count), dtype, seed and the prompts'
    dataset."""

    model: str
    draft: str
    formats: tuple[str | None, ...] = DEFAULT_FORMATS
    sequences: tuple[int, ...] = DEFAULT_SEQUENCES
    k: int = 4
    n_gen: int = 64
    repeats: int = 1
    threads: int | None = None
    dtype: str = "bfloat16"
    seed: int = 0
    dataset: str = "gsm8k"


def plan(settings: LlamaCppSettings) -> list[Arm]:
    """The sweep's arms of the comparison, column by column (each format's target-only, then its SD),
    one per number of sequences."""
    arms = []
    for fmt in settings.formats:
        arms += [Arm("flyspec", "target", b, quantization=fmt) for b in settings.sequences]
        arms += [
            Arm("flyspec", "standard", b, settings.draft, settings.k, quantization=fmt)
            for b in settings.sequences
        ]
    return arms


def column_label(arm: Arm) -> str:
    """The report's name of the column an arm belongs to, e.g. "flyspec int8 SD" ("bf16": the weights
    as loaded)."""
    return f"flyspec {arm.quantization or 'bf16'} {'target-only' if arm.method == 'target' else 'SD'}"


RETRIES = 2
"""Extra 1-token/n-token pairs `decode_rate` may measure when a pair's difference is not positive."""


def decode_rate(llm: Any, prompts: list[list[int]], n_gen: int, repeats: int) -> DecodeRate:
    """Decode tokens/s of `llm` over `prompts` (one batch), prefill excluded: B (n_gen - 1) over the time
    of an n_gen-token generate minus that of a 1-token generate (the median over `repeats` pairs; a pair
    whose difference is not positive was disturbed and is measured again, up to RETRIES times)."""
    from flyspec.sampling_params import SamplingParams

    def timed(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
        return elapsed

    timed(4)  # warm-up at this batch size: builds the step's buffers and primitives
    diffs, totals = [], []
    # A pair whose difference is not positive was disturbed (another process took the cores during the
    # 1-token run): measure again, up to RETRIES more pairs, rather than lose the whole comparison.
    for _ in range(repeats + RETRIES):
        one, full = timed(1), timed(n_gen)
        if full > one:
            diffs.append(full - one)
            totals.append(full)
        if len(diffs) == repeats:
            break
    decode_s = statistics.median(diffs) if diffs else 0.0
    if decode_s <= 0:
        raise RuntimeError(
            f"decoding {n_gen - 1} more tokens took no measurable time beyond the 1-token run "
            f"({decode_s * 1000:.1f} ms): too few new tokens to time decoding apart from prefill; use more"
        )
    return DecodeRate(len(prompts) * (n_gen - 1) / decode_s, decode_s, statistics.median(totals))


@dataclass(frozen=True)
class _Measuring:
    """What every measurement of one comparison shares."""

    settings: LlamaCppSettings
    prompts: list[list[int]]
    peer: LlamaCppBench | None
    on_progress: Callable[[str], None]


def _paired_rate(llm: Any, arm: Arm, m: _Measuring) -> DecodeRate:
    """One arm's rate, between two llama.cpp runs at its number of sequences when llama.cpp is here: on a
    shared machine the load changes by the minute, and a ratio is only as good as the closeness of its
    two sides."""
    b, peer = arm.batch_size, m.peer
    sd = peer is not None and arm.method == "standard" and b == 1 and peer.speculation is not None
    before = peer.rate(b) if peer is not None else None
    sd_before = peer.sd_rate() if sd and peer is not None else None
    m.on_progress(f"{column_label(arm)}, {b} sequences")
    rate = decode_rate(llm, m.prompts[:b], m.settings.n_gen, m.settings.repeats)
    sd_after = peer.sd_rate() if sd and peer is not None else None
    after = peer.rate(b) if peer is not None else None
    if before is not None and after is not None:
        rate.llama_cpp_tokens_per_s = [before, after]
        rate.vs_llama_cpp = rate.tokens_per_s / statistics.mean((before, after))
    if sd_before is not None and sd_after is not None:
        rate.llama_cpp_sd_tokens_per_s = [sd_before, sd_after]
        rate.vs_llama_cpp_sd = rate.tokens_per_s / statistics.mean((sd_before, sd_after))
    return rate


def run(
    settings: LlamaCppSettings,
    *,
    root: Path,
    logs: Path,
    on_progress: Callable[[str], None] = lambda _label: None,
) -> LlamaCppReport:
    """Measure llama.cpp (before and after) and every flyspec column at every number of sequences;
    `root` is where `make peers` installed llama.cpp, `logs` where its runs log."""
    import torch

    from flyspec.bench.bandwidth import read_bandwidth
    from flyspec.bench.machine import describe_machine
    from flyspec.bench.peers import assembled_gguf
    from flyspec.bench.runner import BenchRunner

    threads = settings.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    cpu, machine = cpuinfo.describe_cpu(), describe_machine("cpu")
    prompts, first_prompt = _prompts(settings)
    npp = round(statistics.mean(len(p) for p in prompts))
    skipped = missing(root)
    peer = None
    if skipped is None:
        gguf, sequences = assembled_gguf(settings.model, root), list(settings.sequences)
        speculation = None
        if 1 in settings.sequences:
            speculation = Speculation(assembled_gguf(settings.draft, root), settings.k, first_prompt)
        peer = LlamaCppBench(
            root, gguf, sequences=sequences, threads=threads, n_gen=settings.n_gen, prompt_tokens=npp,
            logs=logs, on_progress=on_progress, speculation=speculation,
        )  # fmt: skip
    report = LlamaCppReport(
        cpu, machine, settings.model, settings.draft, settings.k, settings.n_gen, list(settings.sequences),
        threads, settings.repeats, npp, skipped, llama_cpp=None if peer is None else peer.runs,
    )  # fmt: skip
    on_progress("memory read bandwidth")
    report.memory_read_gbps = read_bandwidth(threads) / 1e9
    arms = plan(settings)
    runner = BenchRunner(
        settings.model, arms, dtype=settings.dtype, device="cpu", ignore_eos=True, seed=settings.seed,
        prefix_caching=False,
    )  # fmt: skip
    measuring = _Measuring(settings, prompts, peer, on_progress)
    for label in dict.fromkeys(column_label(a) for a in arms):
        on_progress(f"load {label}")
        column = [a for a in arms if column_label(a) == label]
        report.flyspec[label] = _measure_column(runner, column, measuring)
        runner.release()  # one engine at a time: its KV cache and weights go before the next loads
    if peer is not None:
        peer.runs.finish()
    return report


def _prompts(settings: LlamaCppSettings) -> tuple[list[list[int]], str]:
    """The token ids of as many of the dataset's prompts as the most sequences, through the target's
    tokenizer and chat template, and the first as text (special tokens written out), for llama.cpp's
    speculative decoding to tokenize the same."""
    from flyspec.assets import resolve_model
    from flyspec.bench.prompts import load_prompts
    from flyspec.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(settings.model))
    ids = [p.token_ids for p in load_prompts(settings.dataset, max(settings.sequences), tokenizer)]
    return ids, tokenizer.decode(ids[0], skip_special_tokens=False)


def _measure_column(runner: Any, column: list[Arm], m: _Measuring) -> FlyspecColumn:
    """One column's rates at each number of sequences, on the one engine its arms share."""
    llm = runner.engine_for(column[0])
    rates = {arm.batch_size: _paired_rate(llm, arm, m) for arm in column}
    if column[0].method == "target" and 1 in rates:  # one sequence's weight traffic (bench/bandwidth.py)
        weight_bytes = rates[1].weight_bytes = llm.target_weight_bytes  # walks the model: once
        rates[1].weight_gbps = weight_bytes * rates[1].tokens_per_s / 1e9
    return FlyspecColumn(column[0].quantization, column[0].method, llm.weight_formats, rates)
