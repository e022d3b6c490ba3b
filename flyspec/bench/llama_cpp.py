"""`flyspec bench --peer llama.cpp`: llama.cpp's own benches beside flyspec's decoding, on this CPU.

llama.cpp is the strongest CPU reference for raw decode speed, and users compare with its own tools, so
those are what runs: `llama-bench` (one sequence, text generation `tg`) and `llama-batched-bench` (text
generation of B parallel sequences after a prompt of `npp` tokens each), on the zoo's GGUF file of the
target (the Q4_K_M file as shipped). flyspec runs the same model from its safetensors in each weight
format asked for, target-only and with speculative decoding (the zoo's draft, K tokens, standard
verification), at the same numbers of sequences, through the public `LLM.generate`.

Prefill is excluded on both sides, as llama.cpp's S_TG does (it times the prompt pass apart from the
decode steps): each flyspec measurement generates `n_gen` tokens per sequence and, over the same prompts,
one token, and the rate is B x (n_gen - 1) / (t(n_gen) - t(1)) (prefix caching off, so the second call
prefills like the first). The flyspec prompts are GSM8K questions through the chat template; llama.cpp's
prompt length is their mean, rounded (its prompt tokens are random).

On a shared machine the load changes by the minute, so llama.cpp runs right before and right after
every flyspec measurement, at the same number of sequences, and each ratio is flyspec's rate over the
mean of those two (all runs are in the JSON). Threads: torch's thread count for both. With
`FLYSPEC_CPU_ISA=avx2` (flyspec/cpuinfo.py) the AVX2-only llama.cpp build is used
(`.peers/llama.cpp-avx2`, `LLAMA_CPU_ISA=avx2 bash scripts/peers/llama_cpp.sh`). A llama.cpp that is not
installed is skipped with the command that installs it; flyspec's rows are still measured.
"""

from __future__ import annotations

import gc
import itertools
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyspec import cpuinfo

INSTALL = {
    None: "make peers (or: bash scripts/peers/llama_cpp.sh), then FLYSPEC_PEERS=.peers",
    "avx2": "LLAMA_CPU_ISA=avx2 bash scripts/peers/llama_cpp.sh (the AVX2-only build)",
}


def llama_cpp_dir(root: Path) -> Path:
    """The llama.cpp build to compare with: the AVX2-only one when flyspec emulates an AVX2 CPU."""
    return root / ("llama.cpp-avx2" if cpuinfo.emulated_isa() == "avx2" else "llama.cpp")


def missing(root: Path) -> str | None:
    """None when llama-bench and llama-batched-bench are installed, else a line saying what is missing
    and the command that installs them."""
    folder = llama_cpp_dir(root) / "bin"
    absent = [name for name in ("llama-bench", "llama-batched-bench") if not (folder / name).is_file()]
    if not absent:
        return None
    how = INSTALL["avx2" if cpuinfo.emulated_isa() == "avx2" else None]
    return f"llama.cpp: skipped, not installed ({', '.join(absent)} missing in {folder}): run {how}"


def _run(argv: list[str], log: Path) -> str:
    """Run a llama.cpp tool, its stderr (llama.cpp's log) to `log`; its stdout. RuntimeError with the
    log's tail when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as err:
        err.write(" ".join(argv) + "\n")
        err.flush()
        out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=err, text=True, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"{Path(argv[0]).name} exited with code {out.returncode}:\n{tail}")
    return out.stdout


def llama_bench(binary: Path, gguf: Path, threads: int, n_gen: int, repetitions: int, log: Path) -> dict:
    """`llama-bench -p 0 -n n_gen`: one sequence's text generation, tokens/s (mean and stddev over its
    repetitions), with the CPU and build llama.cpp reports."""
    argv = [str(binary), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(n_gen)]
    argv += ["-r", str(repetitions), "-o", "json"]
    (row,) = json.loads(_run(argv, log))
    return {
        "tokens_per_s": row["avg_ts"],
        "stddev": row["stddev_ts"],
        "cpu_info": row.get("cpu_info"),
        "build": f"{row.get('build_number')} ({row.get('build_commit')})",
        "model_type": row.get("model_type"),
        "command": " ".join(argv),
    }


def batched_bench(
    binary: Path, gguf: Path, threads: int, npp: int, n_gen: int, sequences: list[int], log: Path
) -> dict[int, dict]:
    """`llama-batched-bench`: for each number of parallel sequences, S_TG (text-generation tokens/s, the
    prompt pass excluded) and S_PP."""
    ctx = max(sequences) * (npp + n_gen)
    argv = [str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(ctx)]
    argv += ["-b", "2048", "-ub", "512", "-npp", str(npp), "-ntg", str(n_gen)]
    argv += ["-npl", ",".join(map(str, sequences)), "--output-format", "jsonl"]
    rows = [json.loads(line) for line in _run(argv, log).splitlines() if line.startswith("{")]
    return {
        row["pl"]: {
            "tokens_per_s": row["speed_tg"],
            "prompt_tokens_per_s": row["speed_pp"],
            "command": " ".join(argv),
        }
        for row in rows
    }


@dataclass(frozen=True)
class FlyspecArm:
    """One flyspec engine: a weight format and a method ("target" or "standard" with the draft)."""

    quantization: str | None
    method: str

    @property
    def label(self) -> str:
        fmt = self.quantization or "bf16"
        return f"flyspec {fmt} {'target-only' if self.method == 'target' else 'SD'}"


RETRIES = 2
"""Extra 1-token/n-token pairs `decode_rate` may measure when a pair's difference is not positive."""


def decode_rate(llm: Any, prompts: list[list[int]], n_gen: int, repeats: int) -> dict:
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
    return {
        "tokens_per_s": len(prompts) * (n_gen - 1) / decode_s,
        "decode_seconds": decode_s,
        "seconds_with_prefill": statistics.median(totals),
    }


def _flyspec_engine(
    model: str, draft: str, arm: FlyspecArm, k: int, max_seqs: int, dtype: str, seed: int
) -> Any:
    from flyspec.config import EngineConfig
    from flyspec.llm import LLM

    spec = None if arm.method == "target" else {"model": draft, "num_speculative_tokens": k}
    config = EngineConfig(
        model=model,
        dtype=dtype,
        quantization=arm.quantization,
        speculative_config=spec,
        max_num_seqs=max_seqs,
        enable_prefix_caching=False,
        seed=seed,
    )
    return LLM.from_config(config)


def run(
    *,
    model: str,
    draft: str,
    formats: tuple[str | None, ...],
    sequences: list[int],
    k: int,
    n_gen: int,
    repeats: int,
    threads: int,
    dtype: str,
    seed: int,
    dataset: str,
    root: Path,
    logs: Path,
    on_progress: Callable[[str], None] = lambda _label: None,
) -> dict[str, Any]:
    """Measure llama.cpp (before and after) and every flyspec arm at every number of sequences; the
    report as a JSON-ready dict (see `render`)."""
    import torch

    from flyspec.assets import resolve_model
    from flyspec.bench.machine import describe_machine
    from flyspec.bench.peers import assembled_gguf
    from flyspec.bench.prompts import load_prompts
    from flyspec.models.tokenizer import load_tokenizer

    torch.set_num_threads(threads)
    report: dict[str, Any] = {
        "cpu": cpuinfo.describe_cpu(),
        "machine": describe_machine("cpu"),
        "model": model,
        "draft": draft,
        "k": k,
        "n_gen": n_gen,
        "sequences": sequences,
        "threads": threads,
        "repeats": repeats,
        "flyspec": {},
        "llama_cpp": None,
    }
    arms = [FlyspecArm(q, m) for q in formats for m in ("target", "standard")]
    tokenizer = load_tokenizer(resolve_model(model))
    prompts = [p.token_ids for p in load_prompts(dataset, max(sequences), tokenizer)]
    npp = round(statistics.mean(len(p) for p in prompts))
    report["prompt_tokens_mean"] = npp
    report["llama_cpp_skipped"] = missing(root)
    peer: dict[str, Any] | None = None
    if report["llama_cpp_skipped"] is None:
        folder = llama_cpp_dir(root)
        installed = folder / ".installed"
        peer = {
            "gguf": str(assembled_gguf(model, root)),
            "build": installed.read_text().strip() if installed.is_file() else str(folder),
            "runs": {b: [] for b in sequences},
        }
    count = itertools.count()

    def peer_rate(b: int) -> float | None:
        """llama.cpp at b sequences: llama-bench for one, llama-batched-bench's S_TG for more."""
        if peer is None:
            return None
        on_progress(f"llama.cpp, {b} sequences")
        folder, gguf, log = (
            llama_cpp_dir(root) / "bin",
            Path(peer["gguf"]),
            logs / f"llama-cpp-{next(count)}.log",
        )
        if b == 1:
            result = llama_bench(folder / "llama-bench", gguf, threads, n_gen, 2, log)
        else:
            result = batched_bench(folder / "llama-batched-bench", gguf, threads, npp, n_gen, [b], log)[b]
        peer["runs"][b].append(result)
        return result["tokens_per_s"]

    for arm in arms:
        on_progress(f"load {arm.label}")
        llm = _flyspec_engine(model, draft, arm, k, max(sequences), dtype, seed)
        results = {}
        for b in sequences:
            # llama.cpp right before and after each measurement: on a shared machine the load changes by
            # the minute, and a ratio is only as good as the closeness of its two sides.
            before = peer_rate(b)
            on_progress(f"{arm.label}, {b} sequences")
            results[b] = decode_rate(llm, prompts[:b], n_gen, repeats)
            after = peer_rate(b)
            if before is not None and after is not None:
                results[b]["llama_cpp_tokens_per_s"] = [before, after]
                results[b]["vs_llama_cpp"] = results[b]["tokens_per_s"] / statistics.mean((before, after))
        report["flyspec"][arm.label] = {
            "quantization": arm.quantization,
            "method": arm.method,
            "weights": llm.weight_formats,
            "by_sequences": results,
        }
        del llm
        gc.collect()
    if peer is not None:
        peer["tokens_per_s"] = {
            b: statistics.mean(r["tokens_per_s"] for r in peer["runs"][b]) for b in sequences
        }
    report["llama_cpp"] = peer
    return report


def _at(by_sequences: dict, b: int) -> Any:
    # JSON turns the integer keys into strings; a report read back has those.
    return by_sequences[b] if b in by_sequences else by_sequences[str(b)]


def render(report: dict[str, Any]) -> str:
    """The report as Markdown: the CPU, one row per number of sequences, llama.cpp's tokens/s, each
    flyspec arm's, and the best target-only and SD arm over llama.cpp."""
    seqs = report["sequences"]
    arms = report["flyspec"]
    peer = report.get("llama_cpp")
    lines = [
        f"CPU: {report['cpu']}; {report['threads']} threads; target {report['model']}, "
        f"draft {report['draft']} (K={report['k']}, standard verification); {report['n_gen']} new tokens "
        f"per sequence, prefill excluded (llama.cpp: prompts of {report['prompt_tokens_mean']} tokens).",
        "",
    ]
    if peer is None:
        lines += [report.get("llama_cpp_skipped") or "llama.cpp: not measured", ""]
    else:
        lines += [f"llama.cpp: {peer['build']}; {peer['gguf']}", ""]
    head = ["sequences", "llama.cpp tok/s", *(f"{label} tok/s" for label in arms)]
    head += ["best target-only / llama.cpp", "best SD / llama.cpp"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for b in seqs:
        cells_of = {label: _at(arm["by_sequences"], b) for label, arm in arms.items()}
        cells = [str(b)]
        if peer is None:
            cells.append("-")
        else:
            runs = [r["tokens_per_s"] for r in _at(peer["runs"], b)]
            tool = "llama-bench tg" if b == 1 else "batched-bench S_TG"
            cells.append(f"{statistics.mean(runs):.2f} ({tool}; {min(runs):.2f}-{max(runs):.2f})")
        cells += [f"{cells_of[label]['tokens_per_s']:.2f}" for label in arms]
        for method in ("target", "standard"):
            mine = [c for label, c in cells_of.items() if arms[label]["method"] == method]
            best = max(mine, key=lambda c: c["tokens_per_s"]) if mine else None
            ratio = None if best is None else best.get("vs_llama_cpp")
            cells.append("-" if ratio is None else f"**{ratio:.2f}x**")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Each flyspec cell was measured between two llama.cpp runs at the same number of sequences; a "
        "ratio is the arm's tokens/s over the mean of those two. The llama.cpp column is the mean (and "
        "range) of all its runs.",
    ]
    return "\n".join(lines) + "\n"
