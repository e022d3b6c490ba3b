"""Verification policies side by side: FLy and typical acceptance at their defaults, each with and without
a lossless prefix, against standard speculative decoding (docs/verification.md).

Two measurements, each one `flyspec` command (printed before it runs):

1. `flyspec bench`: tokens/s at the given batch sizes for target-only, standard SD, FLy and typical
   acceptance with lossless prefixes 0 and PREFIX; the speed against standard SD, the mean acceptance
   length and the forgiven share come from its report;
2. one paired `flyspec gate run` per lossy setting on GSM8K (greedy, the first QUESTIONS questions of the
   seeded order, a fixed design): how many questions the setting lost and gained against standard SD.
   Standard and lossy arms differ only in the verifier, so each run uses one engine for both.

Then a Markdown summary (stdout and OUT/summary.md). The default is the Qwen pair at batch 1 and 16 with a
prefix of 16; a whole run should take one to two hours on 2 idle cores (an estimate from the reference
sweep's speeds, not measured), so run it on an idle machine:

    python scripts/bench_policies.py --out benchmarks/policies

A quick check of the commands on a small model (about a minute of CPU):

    python scripts/bench_policies.py --target smollm2-135m-instruct --draft ngram --batch-sizes 1,2 \\
        --num-prompts 2 --max-tokens 8 --questions 2 --gate-max-tokens 16 --out /tmp/policies
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

POLICIES = ("fly", "typical")


def _flyspec() -> str:
    return str(Path(sys.executable).parent / "flyspec")


def _run(args: list[str]) -> str:
    """Run one flyspec command (printed first) and return its stdout; stop on failure."""
    print("$ " + shlex.join(["flyspec", *args]), file=sys.stderr, flush=True)
    done = subprocess.run([_flyspec(), *args], stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"flyspec {args[0]} failed with exit code {done.returncode}")
    return done.stdout


def _spec(drafter: str, k: int) -> dict[str, Any]:
    if drafter == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    return {"method": "draft_model", "model": drafter, "num_speculative_tokens": k}


def bench(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    args = [
        "bench", "--model", a.target, "--draft", a.draft, "--methods", "target,standard,fly,typical",
        "--lossless-prefix", f"0,{a.prefix}", "--batch-sizes", a.batch_sizes, "--k", str(a.k),
        "--num-prompts", str(a.num_prompts), "--max-tokens", str(a.max_tokens), "--repeats", str(a.repeats),
        "--dtype", a.dtype, "--quantization", a.quantization, "--peer", "none",
        "--json", str(out / "bench.json"), "--markdown", str(out / "bench.md"),
        "--plot", str(out / "bench.png"),
    ]  # fmt: skip
    _run(args)
    return json.loads((out / "bench.json").read_text())


def gate(a: argparse.Namespace, out: Path) -> dict[tuple[str, int], dict[str, Any]]:
    # The same weights as the speed measurement (an engine arm without the key would take "auto").
    quantization = None if a.quantization == "none" else a.quantization
    engine = {
        "kind": "engine", "model": a.target, "dtype": a.dtype, "max_num_seqs": a.gate_batch,
        "quantization": quantization,
    }  # fmt: skip
    base = {**engine, "speculative_config": _spec(a.draft, a.k)}
    results = {}
    for policy in POLICIES:
        for prefix in (0, a.prefix):
            spec = {**base["speculative_config"], "rejection_sample_method": policy}
            if prefix:
                spec["lossless_prefix_tokens"] = prefix
            args = [
                "gate", "run", "--store", str(out / "gate.db"), "--run", f"{policy}-prefix{prefix}",
                "--dataset", a.dataset, "--baseline", json.dumps(base),
                "--candidate", json.dumps({**engine, "speculative_config": spec}), "--margin", str(a.margin),
                "--max-questions", str(a.questions), "--max-tokens", str(a.gate_max_tokens),
                "--no-progress", "--json",
            ]  # fmt: skip
            report = json.loads(_run(args).strip().splitlines()[-1])
            results[policy, prefix] = report["decision"]
    return results


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def summary(a: argparse.Namespace, report: dict[str, Any], gates: dict[tuple[str, int], Any]) -> str:
    rows = report["results"]
    vs_standard = {r["numerator"]: r["value"] for r in report["ratios"] if r["name"].endswith("/ standard")}
    lines = [
        f"Target `{a.target}`, drafter `{a.draft}`, K={a.k}, dtype {a.dtype}, weights {a.quantization}; "
        f"machine: {report['machine'].get('cpu', '?')}.",
        "",
        "| arm | batch | tokens/s | vs standard SD | mean acceptance length | forgiven share |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["method"] == "target":
            continue
        lines.append(
            f"| {r['label']} | {r['batch_size']} | {_num(r['tokens_per_s'], '{:.2f}')} | "
            f"{_num(vs_standard.get(r['label']), '{:.3f}x')} | {_num(r['mean_acceptance_length'], '{:.2f}')} "
            f"| {_num(r['forgiven_share'] and 100 * r['forgiven_share'], '{:.1f}%')} |"
        )
    if gates:
        lines += [
            "",
            f"Gate on `{a.dataset}` (first {a.questions} questions of the seeded order, greedy, "
            f"{a.gate_max_tokens} tokens, margin {a.margin}, fixed design), each setting against "
            "standard SD:",
            "",
            "| setting | questions | lost | gained | decision |",
            "|---|---:|---:|---:|---|",
        ]
        for (policy, prefix), d in gates.items():
            name = policy + (f", lossless prefix {prefix}" if prefix else "")
            lines.append(f"| {name} | {d['n']} | {d['lost']} | {d['gained']} | {d['decision']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="a draft model, or ngram")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prefix", type=int, default=16, help="the lossless prefix measured against none")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="none", help="weights of every arm: none, int8 or int4")
    p.add_argument("--dataset", default="gsm8k")
    p.add_argument("--questions", type=int, default=40, help="gate questions per setting")
    p.add_argument("--gate-max-tokens", type=int, default=256)
    p.add_argument("--gate-batch", type=int, default=16, help="the gate engines' max_num_seqs")
    p.add_argument("--margin", type=float, default=0.05)
    p.add_argument("--skip-gate", action="store_true", help="measure speed only")
    p.add_argument("--out", type=Path, default=Path("benchmarks/policies"))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    report = bench(a, a.out)
    gates = {} if a.skip_gate else gate(a, a.out)
    text = summary(a, report, gates)
    (a.out / "summary.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
