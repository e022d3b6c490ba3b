"""The report of `flyspec bench --peer llama.cpp` (flyspec/bench/llama_cpp.py): typed records, their JSON
and the Markdown table.

JSON layout (`--json FILE`, e.g. benchmarks/llama-cpp-native.json):

- `cpu`, `machine` (flyspec/bench/machine.py), `model`, `draft`, `k`, `n_gen` (new tokens per sequence),
  `sequences`, `threads`, `repeats`, `prompt_tokens_mean` (llama.cpp's prompt length: the mean length of
  flyspec's prompts);
- `flyspec`: one object per column (one engine: a weight format and a method, e.g. "flyspec int8 SD"):
  `quantization`, `method` ("target" or "standard"), `weights` (the formats its models loaded in) and
  `by_sequences`, per number of sequences: `tokens_per_s` (decoding, prefill excluded),
  `decode_seconds`, `seconds_with_prefill` and, where llama.cpp ran, `llama_cpp_tokens_per_s` (its runs
  right before and after) and `vs_llama_cpp` (`tokens_per_s` over their mean); an SD column at one
  sequence also `llama_cpp_sd_tokens_per_s` and `vs_llama_cpp_sd` (the same against llama.cpp's own
  speculative decoding with the same draft and K); a target-only column at one sequence also
  `weight_bytes` (the target's weights a decode step reads, `LLM.target_weight_bytes`) and `weight_gbps`
  (those bytes times `tokens_per_s`: the step's weight traffic, against `memory_read_gbps`);
- `memory_read_gbps`: this machine's memory read bandwidth at the run's threads, measured at its start
  (flyspec/bench/bandwidth.py; absent from reports saved before it);
- `llama_cpp`: null when it was skipped (`llama_cpp_skipped` then says why and how to install it), else
  `gguf`, `build`, `runs` (per number of sequences, each run's tokens/s and the tool's details) and
  `tokens_per_s` (per number of sequences, the mean of its runs); with SD asked for, `sd_runs`
  (`llama-speculative-simple` at one sequence: tokens/s, tokens drafted and accepted, the command),
  `sd_tokens_per_s` (their mean) and `sd_skipped` (why none ran, or null).

JSON writes the numbers of sequences as strings; `from_dict` reads them back as integers.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any

from flyspec.bench.bandwidth import READ_BYTES, READ_PASSES

__all__ = ["DecodeRate", "FlyspecColumn", "LlamaCppReport", "LlamaCppRuns", "render"]


def _by_sequences(data: dict[Any, Any]) -> dict[int, Any]:
    return {int(b): value for b, value in data.items()}


@dataclass
class DecodeRate:
    """One flyspec column at one number of sequences (module docstring)."""

    tokens_per_s: float
    decode_seconds: float
    seconds_with_prefill: float
    llama_cpp_tokens_per_s: list[float] | None = None
    vs_llama_cpp: float | None = None
    llama_cpp_sd_tokens_per_s: list[float] | None = None
    vs_llama_cpp_sd: float | None = None
    weight_bytes: int | None = None
    weight_gbps: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """Its JSON object; the llama.cpp fields only where llama.cpp ran."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class FlyspecColumn:
    """One flyspec engine over the numbers of sequences (module docstring)."""

    quantization: str | None
    method: str
    weights: dict[str, str]
    by_sequences: dict[int, DecodeRate] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "quantization": self.quantization,
            "method": self.method,
            "weights": self.weights,
            "by_sequences": {b: rate.to_dict() for b, rate in self.by_sequences.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FlyspecColumn:
        rates = {b: DecodeRate(**rate) for b, rate in _by_sequences(data["by_sequences"]).items()}
        return cls(data["quantization"], data["method"], data["weights"], rates)


@dataclass
class LlamaCppRuns:
    """llama.cpp's runs (module docstring); `tokens_per_s` is filled once they are all in."""

    gguf: str
    build: str
    runs: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    tokens_per_s: dict[int, float] = field(default_factory=dict)
    sd_runs: list[dict[str, Any]] = field(default_factory=list)
    sd_tokens_per_s: float | None = None
    sd_skipped: str | None = None

    def finish(self) -> None:
        """Set `tokens_per_s`: the mean of the runs at each number of sequences (and of the SD runs)."""
        self.tokens_per_s = {
            b: statistics.mean(r["tokens_per_s"] for r in runs) for b, runs in self.runs.items()
        }
        if self.sd_runs:
            self.sd_tokens_per_s = statistics.mean(r["tokens_per_s"] for r in self.sd_runs)

    def to_dict(self) -> dict[str, Any]:
        """Its JSON object; the SD fields only where SD was asked for (reports saved before them read
        and write back unchanged)."""
        data = dataclasses.asdict(self)
        if not self.sd_runs and self.sd_skipped is None:
            for name in ("sd_runs", "sd_tokens_per_s", "sd_skipped"):
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlamaCppRuns:
        runs, rates = _by_sequences(data["runs"]), _by_sequences(data.get("tokens_per_s") or {})
        sd = {name: data[name] for name in ("sd_runs", "sd_tokens_per_s", "sd_skipped") if name in data}
        return cls(data["gguf"], data["build"], runs, rates, **sd)


@dataclass
class LlamaCppReport:
    """One comparison's report (module docstring)."""

    cpu: str
    machine: dict[str, Any]
    model: str
    draft: str
    k: int
    n_gen: int
    sequences: list[int]
    threads: int
    repeats: int
    prompt_tokens_mean: int
    llama_cpp_skipped: str | None
    flyspec: dict[str, FlyspecColumn] = field(default_factory=dict)
    llama_cpp: LlamaCppRuns | None = None
    memory_read_gbps: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (`--json`), its keys in the order of the reports already saved (the
        bandwidth last, and only where it was measured)."""
        head = ("cpu", "machine", "model", "draft", "k", "n_gen", "sequences", "threads", "repeats")
        data = {
            **{name: getattr(self, name) for name in head},
            "flyspec": {label: column.to_dict() for label, column in self.flyspec.items()},
            "llama_cpp": None if self.llama_cpp is None else self.llama_cpp.to_dict(),
            "prompt_tokens_mean": self.prompt_tokens_mean,
            "llama_cpp_skipped": self.llama_cpp_skipped,
        }
        if self.memory_read_gbps is not None:
            data["memory_read_gbps"] = self.memory_read_gbps
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LlamaCppReport:
        """A saved report (`--json`)."""
        own = {f.name for f in dataclasses.fields(cls)} - {"flyspec", "llama_cpp", "memory_read_gbps"}
        return cls(
            **{name: data[name] for name in own},
            memory_read_gbps=data.get("memory_read_gbps"),
            flyspec={label: FlyspecColumn.from_dict(c) for label, c in data["flyspec"].items()},
            llama_cpp=None if data["llama_cpp"] is None else LlamaCppRuns.from_dict(data["llama_cpp"]),
        )


def _peer_cell(peer: LlamaCppRuns, b: int) -> str:
    runs = [r["tokens_per_s"] for r in peer.runs[b]]
    tool = "llama-bench tg" if b == 1 else "batched-bench S_TG"
    return f"{statistics.mean(runs):.2f} ({tool}; {min(runs):.2f}-{max(runs):.2f})"


def _best_ratio(report: LlamaCppReport, b: int, method: str) -> str:
    """The ratio to llama.cpp of the fastest column of `method` at b sequences."""
    mine = [c.by_sequences[b] for c in report.flyspec.values() if c.method == method]
    best = max(mine, key=lambda rate: rate.tokens_per_s) if mine else None
    return "-" if best is None or best.vs_llama_cpp is None else f"**{best.vs_llama_cpp:.2f}x**"


def render(report: LlamaCppReport) -> str:
    """The report as Markdown: the CPU, one row per number of sequences, llama.cpp's tokens/s, each
    flyspec column's, and the best target-only and SD column over llama.cpp."""
    peer = report.llama_cpp
    if peer is None:
        about_peer = report.llama_cpp_skipped or "llama.cpp: not measured"
    else:
        about_peer = f"llama.cpp: {peer.build}; {peer.gguf}"
    lines = [
        f"CPU: {report.cpu}; {report.threads} threads; target {report.model}, draft {report.draft} "
        f"(K={report.k}, standard verification); {report.n_gen} new tokens per sequence, prefill excluded "
        f"(llama.cpp: prompts of {report.prompt_tokens_mean} tokens).",
        "",
        about_peer,
        "",
    ]
    head = ["sequences", "llama.cpp tok/s", *(f"{label} tok/s" for label in report.flyspec)]
    head += ["best target-only / llama.cpp", "best SD / llama.cpp"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for b in report.sequences:
        cells = [str(b), "-" if peer is None else _peer_cell(peer, b)]
        cells += [f"{column.by_sequences[b].tokens_per_s:.2f}" for column in report.flyspec.values()]
        cells += [_best_ratio(report, b, method) for method in ("target", "standard")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Each flyspec cell was measured between two llama.cpp runs at the same number of sequences; a "
        "ratio is the arm's tokens/s over the mean of those two. The llama.cpp column is the mean (and "
        "range) of all its runs.",
    ]
    if peer is not None and (peer.sd_runs or peer.sd_skipped):
        lines += ["", _sd_line(report, peer)]
    if report.memory_read_gbps is not None:
        lines += ["", _bandwidth_line(report, report.memory_read_gbps)]
    return "\n".join(lines) + "\n"


def _bandwidth_line(report: LlamaCppReport, bandwidth: float) -> str:
    """One sequence's target-only decoding against the memory bandwidth: the weight bytes a step reads
    times tokens/s, as a share of what this machine's memory delivered at the same threads."""
    cells = [
        f"{label} reads {rate.weight_bytes / 1e9:.3f} GB of weights a token, at {rate.tokens_per_s:.2f} "
        f"tok/s {rate.weight_gbps:.1f} GB/s (**{rate.weight_gbps / bandwidth:.0%}**)"
        for label, column in report.flyspec.items()
        if (rate := column.by_sequences.get(1)) is not None
        and rate.weight_bytes is not None
        and rate.weight_gbps is not None
    ]
    return (
        f"One sequence against the memory bandwidth: this machine read {bandwidth:.1f} GB/s (a sum over "
        f"{READ_BYTES >> 20} MB, {report.threads} threads, the best of {READ_PASSES}); "
        + ("; ".join(cells) or "no target-only column at one sequence")
        + "."
    )


def _sd_line(report: LlamaCppReport, peer: LlamaCppRuns) -> str:
    """Speculative decoding against speculative decoding at one sequence: llama.cpp's own with the same
    draft and K beside flyspec's SD columns, each measured between two llama.cpp SD runs."""
    if not peer.sd_runs:
        return peer.sd_skipped or ""
    rates = [r["tokens_per_s"] for r in peer.sd_runs]
    drafted, accepted = sum(r["drafted"] for r in peer.sd_runs), sum(r["accepted"] for r in peer.sd_runs)
    mine = [
        f"{label} {c.by_sequences[1].tokens_per_s:.2f} tok/s (**{c.by_sequences[1].vs_llama_cpp_sd:.2f}x**)"
        for label, c in report.flyspec.items()
        if c.method == "standard" and 1 in c.by_sequences and c.by_sequences[1].vs_llama_cpp_sd is not None
    ]
    return (
        f"SD against SD at one sequence (`llama-speculative-simple`, draft {report.draft}, K={report.k}, "
        f"greedy, flyspec's first prompt): llama.cpp {statistics.mean(rates):.2f} tok/s "
        f"({min(rates):.2f}-{max(rates):.2f}; {accepted} of {drafted} draft tokens accepted); "
        + ("; ".join(mine) or "no flyspec SD column at one sequence")
        + "."
    )
