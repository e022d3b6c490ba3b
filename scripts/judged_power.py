"""Power of judged runs anchored on gold labels against exact grading, by simulation (docs/statistics.md).

Margin 2 points, alpha 0.025, no true loss, a share of differing answers (16% by default). Prints:

1. P(PASS) of a fixed run of the size Tango's test needs for 80% power under exact grading, for exact
   grading (Tango), the prediction-powered betting interval with every differing pair labelled (the price
   of an interval valid without a central limit theorem), and judged runs with 100 gold labels (the label
   rate that gives 100 labels in expectation) for judges wrong 0%, 2%, 5% per order and a coin;
2. the questions a fixed judged run needs for 80% power at label rates 1, 0.5, 0.2 and 0.1 for judges
   wrong 2% and 5% per order (judged_questions_needed: simulation with common random numbers);
3. the sequential judged design's questions to a decision (median, 90th percentile) for the same judges
   at 100 labels per 3,163 questions' worth of differing pairs, against the exact-graded sequence.

    python scripts/judged_power.py                 # the tables in docs/statistics.md (about 2 minutes)
    python scripts/judged_power.py --runs 200      # a quick look
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from flyspec.gate.stats import questions_needed_noninferiority
from flyspec.gate.stats.simulation import judged_runs
from flyspec.gate.stats.sizing import Design, judged_questions_needed, simulate

JUDGES = (("fair", 0.0), ("fair", 0.02), ("fair", 0.05), ("coin", 0.0))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=2000, help="simulated runs per cell (2000)")
    parser.add_argument("--differing", type=float, default=0.16)
    parser.add_argument("--labels", type=int, default=100)
    parser.add_argument("--margin", type=float, default=0.02)
    parser.add_argument("--alpha", type=float, default=0.025)
    parser.add_argument("--seed", type=int, default=20250101)
    args = parser.parse_args()
    started = time.time()
    psi, margin, alpha = args.differing, args.margin, args.alpha
    n = questions_needed_noninferiority(margin, psi, 0.0, alpha, 0.8)
    rate = min(1.0, args.labels / (psi * n))
    print(
        f"margin {margin}, alpha {alpha}, {psi:.0%} differing answers, no true loss, "
        f"{args.runs} runs per cell\n"
    )
    print(f"1. Fixed runs of {n:,} questions (Tango's size for 80% power under exact grading)\n")
    print("| grading | gold labels (expected) | P(PASS) |")
    print("|---|---|---|")
    exact = simulate(Design("fixed", n), psi, margin, alpha, runs=args.runs, seed=args.seed)
    print(f"| exact, Tango's interval | all | {exact.pass_rate:.3f} |")
    rng = np.random.default_rng(args.seed)
    every = judged_runs(rng, args.runs, n, psi, 0.0, margin, alpha, "fair", 0.0, 1.0, "fixed")
    print(f"| exact, betting interval (rate 1, no CLT) | {psi * n:,.0f} | {every.share('PASS'):.3f} |")
    for judge, noise in JUDGES:
        out = judged_runs(rng, args.runs, n, psi, 0.0, margin, alpha, judge, noise, rate, "fixed")
        name = "coin" if judge == "coin" else f"judge wrong {noise:.0%} per order"
        print(
            f"| {name}, PPI at label rate {rate:.3f} | {args.labels} | {out.share('PASS'):.3f} |", flush=True
        )
    print(f"\n2. Questions a fixed judged run needs for 80% power (exact grading: {n:,})\n")
    print("| judge wrong per order | label rate 1 | 0.5 | 0.2 | 0.1 |")
    print("|---|---|---|---|---|")
    for noise in (0.02, 0.05):
        cells = []
        for label_rate in (1.0, 0.5, 0.2, 0.1):
            need = judged_questions_needed(psi, margin, alpha, label_rate, noise, runs=400, seed=args.seed)
            cells.append("> 200,000" if need is None else f"{need:,}")
        print(f"| {noise:.0%} | " + " | ".join(cells) + " |", flush=True)
    print(f"\n3. Sequential runs (at most 40,000 questions), label rate {rate:.3f}\n")
    print("| grading | median questions | 90% by | PASS |")
    print("|---|---|---|---|")
    exact_seq = simulate(
        Design("sequential", 40_000), psi, margin, alpha, runs=args.runs // 2, seed=args.seed
    )
    print(
        f"| exact, i.i.d. sequence | {exact_seq.median:,} | {exact_seq.q90:,} | {exact_seq.pass_rate:.3f} |"
    )
    for noise in (0.0, 0.02, 0.05):
        design = Design("sequential", 40_000, label_rate=rate, judge_noise=noise)
        out = simulate(design, psi, margin, alpha, runs=args.runs // 2, seed=args.seed)
        q90 = "not reached" if out.q90 is None else f"{out.q90:,}"
        median = "not reached" if out.median is None else f"{out.median:,}"
        print(f"| judge wrong {noise:.0%}, PPI | {median} | {q90} | {out.pass_rate:.3f} |", flush=True)
    print(f"\n({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
