"""`flyspec bench --peer llama.cpp`: the options of `flyspec bench` that apply, the run, its output.

The comparison itself is flyspec/bench/llama_cpp.py. Defaults: the zoo's Qwen pair, 1, 16 and 32
sequences, int8 and int4 weights, K=4, 64 new tokens, one repetition, torch's thread count.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from flyspec.bench.llama_cpp import DEFAULT_FORMATS, DEFAULT_SEQUENCES, LlamaCppSettings
from flyspec.bench.sweep import parse_int_list
from flyspec.bench.throughput import DEFAULT_DRAFT, DEFAULT_MODEL


def _formats(text: str | None) -> tuple[str | None, ...]:
    if text is None:
        return DEFAULT_FORMATS
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    allowed = ("none", "int8", "int4", "auto")
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError(
            f"--quantization {text!r}: with --peer llama.cpp, a comma list of {', '.join(allowed)}"
        )
    return tuple(None if n == "none" else n for n in names)


def _settings(options: dict[str, Any]) -> LlamaCppSettings:
    """The comparison `flyspec bench`'s options ask for; ValueError naming an option that does not apply
    as given."""
    drafts = options["draft"] or [DEFAULT_DRAFT]
    if len(drafts) != 1 or drafts[0] == "ngram":
        raise ValueError("--peer llama.cpp: give one draft model (--draft NAME)")
    ks = parse_int_list("k", options["k"] or "4", 1)
    if len(ks) != 1:
        raise ValueError("--peer llama.cpp: give one K (--k N)")
    batch_sizes = options["batch_sizes"]
    sequences = parse_int_list("batch_sizes", batch_sizes) if batch_sizes else DEFAULT_SEQUENCES
    n_gen = options["max_tokens"] or 64
    if n_gen < 2:
        raise ValueError(
            "--max-tokens: at least 2 with --peer llama.cpp (the rate leaves out the first token)"
        )
    return LlamaCppSettings(
        model=options["model"] or DEFAULT_MODEL, draft=drafts[0], formats=_formats(options["quantization"]),
        sequences=tuple(sequences), k=ks[0], n_gen=n_gen, repeats=options["repeats"] or 1,
        threads=options["threads"], dtype="bfloat16" if options["dtype"] == "auto" else options["dtype"],
        seed=options["seed"], dataset=options["dataset"] or "gsm8k",
    )  # fmt: skip


def bench_llama_cpp(options: dict[str, Any]) -> None:
    """Validate the options, run the comparison with a progress line per step on stderr, print the
    Markdown table, write --json and --markdown."""
    from flyspec.bench.llama_cpp import run
    from flyspec.bench.llama_cpp_report import render
    from flyspec.bench.peers import peers_dir

    settings = _settings(options)
    for path, name in ((options["json_path"], "--json"), (options["markdown"], "--markdown")):
        if path is not None and not Path(path).resolve().parent.is_dir():
            raise ValueError(f"{name} {path}: folder {Path(path).resolve().parent} does not exist")
    root = peers_dir()

    def progress(label: str) -> None:
        print(f"[bench --peer llama.cpp] {label}", file=sys.stderr, flush=True)

    report = run(settings, root=root, logs=root / "logs" / "bench-llama-cpp", on_progress=progress)
    if report.llama_cpp_skipped:
        print(report.llama_cpp_skipped, file=sys.stderr)
    text = render(report)
    if options["json_path"] is not None:
        Path(options["json_path"]).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    if options["markdown"] is not None:
        Path(options["markdown"]).write_text(text)
    print(text)
