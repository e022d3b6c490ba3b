"""llama.cpp's own benches, as `flyspec bench --peer llama.cpp` runs them (flyspec/bench/llama_cpp.py).

`llama-bench` measures one sequence's text generation (`tg`), `llama-batched-bench` the text generation
of B parallel sequences after a prompt of `npp` tokens each (S_TG, the prompt pass timed apart), both on
the zoo's GGUF file of the target; `llama-speculative-simple` one sequence's speculative decoding with
the draft's GGUF file (greedy, a fixed draft of K tokens, its decode timed apart from the prompt). With
`FLYSPEC_CPU_ISA=avx2` (flyspec/cpuinfo.py) the AVX2-only build is used (`.peers/llama.cpp-avx2`,
`LLAMA_CPU_ISA=avx2 bash scripts/peers/llama_cpp.sh`).
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyspec import cpuinfo
from flyspec.bench.llama_cpp_report import LlamaCppRuns

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


_SPEC_LINES = {
    "decoded": re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds"),
    "encoded": re.compile(r"encoded\s+(\d+) tokens in"),
    "n_drafted": re.compile(r"n_drafted\s*=\s*(\d+)"),
    "n_accept": re.compile(r"n_accept\s*=\s*(\d+)"),
}


def speculative_simple(
    binary: Path, target: Path, draft: Path, prompt: str, k: int, n_gen: int, threads: int, log: Path
) -> dict:
    """`llama-speculative-simple`: one sequence of `n_gen` greedy tokens after `prompt` (its special
    tokens parsed, as a chat template writes them), the draft proposing exactly K tokens a step (no
    minimum, no probability cut-off, as flyspec drafts); the decode's tokens/s with the prompt pass timed
    apart, and the draft tokens proposed and accepted. The numbers are in llama.cpp's log."""
    argv = [str(binary), "-m", str(target), "-md", str(draft), "-t", str(threads), "-td", str(threads)]
    argv += ["-c", "4096", "-n", str(n_gen), "--ignore-eos", "--temp", "0", "--top-k", "1", "--seed", "0"]
    # b11434 drafts nothing unless --spec-type names the method, even with -md (peers.py says the same)
    argv += ["--spec-type", "draft-simple"]
    argv += ["--spec-draft-n-max", str(k), "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]
    argv += ["-p", prompt]
    _run(argv, log)
    text = log.read_text(errors="replace")
    found = {name: pattern.search(text) for name, pattern in _SPEC_LINES.items()}
    absent = [name for name, match in found.items() if match is None]
    if absent:
        raise RuntimeError(f"llama-speculative-simple printed no {', '.join(absent)} line; its log: {log}")
    decoded, seconds = int(found["decoded"][1]), float(found["decoded"][2])
    return {
        "tokens_per_s": decoded / seconds,
        "decoded_tokens": decoded,
        "prompt_tokens": int(found["encoded"][1]),
        "drafted": int(found["n_drafted"][1]),
        "accepted": int(found["n_accept"][1]),
        "command": " ".join(argv[:-1]) + " -p <the chat-templated prompt>",
    }


@dataclass(frozen=True)
class Speculation:
    """What llama.cpp's speculative decoding runs with: the draft's GGUF file, K, and the one sequence's
    prompt as text (flyspec's first prompt, chat template and all)."""

    draft: Path
    k: int
    prompt: str


class LlamaCppBench:
    """The installed llama.cpp measuring the target's GGUF file at a number of sequences, and with
    `speculation` its speculative decoding at one, each run kept in `runs` (the report's `llama_cpp`),
    each with its own log file under `logs`."""

    def __init__(
        self,
        root: Path,
        gguf: Path,
        *,
        sequences: list[int],
        threads: int,
        n_gen: int,
        prompt_tokens: int,
        logs: Path,
        on_progress: Callable[[str], None],
        speculation: Speculation | None = None,
    ) -> None:
        folder = llama_cpp_dir(root)
        installed = folder / ".installed"
        self.bin = folder / "bin"
        self.threads, self.n_gen, self.prompt_tokens = threads, n_gen, prompt_tokens
        self.logs, self.on_progress = logs, on_progress
        self._count = itertools.count()
        build = installed.read_text().strip() if installed.is_file() else str(folder)
        self.runs = LlamaCppRuns(gguf=str(gguf), build=build, runs={b: [] for b in sequences})
        self.speculation = speculation if (self.bin / "llama-speculative-simple").is_file() else None
        if speculation is not None and self.speculation is None:
            missing_sd = "llama.cpp SD: skipped, llama-speculative-simple is missing"
            self.runs.sd_skipped = f"{missing_sd}: run {INSTALL[None]}"

    def sd_rate(self) -> float | None:
        """One sequence's tokens/s with llama.cpp's speculative decoding; None without `speculation`."""
        spec = self.speculation
        if spec is None:
            return None
        self.on_progress("llama.cpp SD, 1 sequence")
        log = self.logs / f"llama-cpp-{next(self._count)}.log"
        binary, gguf = self.bin / "llama-speculative-simple", Path(self.runs.gguf)
        threads = self.threads
        result = speculative_simple(binary, gguf, spec.draft, spec.prompt, spec.k, self.n_gen, threads, log)
        self.runs.sd_runs.append(result)
        return result["tokens_per_s"]

    def rate(self, sequences: int) -> float:
        """Tokens/s at `sequences` sequences: llama-bench for one, llama-batched-bench's S_TG for more."""
        self.on_progress(f"llama.cpp, {sequences} sequences")
        gguf, log = Path(self.runs.gguf), self.logs / f"llama-cpp-{next(self._count)}.log"
        result: dict[str, Any]
        if sequences == 1:
            result = llama_bench(self.bin / "llama-bench", gguf, self.threads, self.n_gen, 2, log)
        else:
            tool = self.bin / "llama-batched-bench"
            by = batched_bench(tool, gguf, self.threads, self.prompt_tokens, self.n_gen, [sequences], log)
            result = by[sequences]
        self.runs.runs[sequences].append(result)
        return result["tokens_per_s"]
