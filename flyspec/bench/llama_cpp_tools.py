"""llama.cpp's own benches, as `flyspec bench --peer llama.cpp` runs them (flyspec/bench/llama_cpp.py).

`llama-bench` measures one sequence's text generation (`tg`), `llama-batched-bench` the text generation
of B parallel sequences after a prompt of `npp` tokens each (S_TG, the prompt pass timed apart), both on
the zoo's GGUF file of the target. With `FLYSPEC_CPU_ISA=avx2` (flyspec/cpuinfo.py) the AVX2-only build
is used (`.peers/llama.cpp-avx2`, `LLAMA_CPU_ISA=avx2 bash scripts/peers/llama_cpp.sh`).
"""

from __future__ import annotations

import itertools
import json
import subprocess
from collections.abc import Callable
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


class LlamaCppBench:
    """The installed llama.cpp measuring the target's GGUF file at a number of sequences, each run kept
    in `runs` (the report's `llama_cpp`), each with its own log file under `logs`."""

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
    ) -> None:
        folder = llama_cpp_dir(root)
        installed = folder / ".installed"
        self.bin = folder / "bin"
        self.threads, self.n_gen, self.prompt_tokens = threads, n_gen, prompt_tokens
        self.logs, self.on_progress = logs, on_progress
        self._count = itertools.count()
        build = installed.read_text().strip() if installed.is_file() else str(folder)
        self.runs = LlamaCppRuns(gguf=str(gguf), build=build, runs={b: [] for b in sequences})

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
