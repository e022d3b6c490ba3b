"""Questions to a decision: the sequential gate against the fixed design, by simulation (docs/statistics.md).

For each flip rate psi and true difference delta, simulate paired differences D in {-1, 0, 1} with
P(D = -1) = (psi - delta) / 2 and P(D = 1) = (psi + delta) / 2, run the sequential test (stop at the first
boundary crossing, or at the cap), and run the fixed design at the size planned for delta = 0 with 80%
power (questions_needed_noninferiority). Prints a Markdown table and the demo-sized effect.

    python scripts/sequential_table.py                     # the table in docs/statistics.md (a few minutes)
    python scripts/sequential_table.py --replicates 200    # a quick look
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np

from flyspec.gate.stats import decide, questions_needed_noninferiority
from flyspec.gate.stats.simulation import sequential_decisions

FLIP_RATES = (0.06, 0.2, 0.3)
DELTAS = (0.0, -0.01, -0.02, -0.05, -0.10, -0.20)
DEMO = (15 / 58, -13 / 58)  # lost 14 and gained 1 of 58 questions


def paired_differences(
    rng: np.random.Generator, rows: int, cols: int, psi: float, delta: float
) -> np.ndarray:
    """An int8 matrix of i.i.d. differences, drawn in column blocks to keep memory small."""
    p_lost, p_gained = (psi - delta) / 2, (psi + delta) / 2
    out = np.empty((rows, cols), dtype=np.int8)
    for start in range(0, cols, 4096):
        u = rng.random((rows, min(4096, cols - start)), dtype=np.float32)
        block = np.zeros(u.shape, dtype=np.int8)
        block[u < p_lost] = -1
        block[u >= 1 - p_gained] = 1
        out[:, start : start + u.shape[1]] = block
    return out


@functools.cache
def _decision(n: int, lost: int, gained: int, margin: float, alpha: float) -> str:
    return decide(n, lost, gained, margin, alpha).decision


def fixed_design(
    rng: np.random.Generator, n: int, psi: float, delta: float, reps: int, margin: float, alpha: float
) -> dict[str, float]:
    """Outcome shares of the fixed-size test with ``n`` questions."""
    tables = rng.multinomial(n, [(psi - delta) / 2, (psi + delta) / 2, 1 - psi], size=reps)
    outcomes = [_decision(n, int(lost), int(gained), margin, alpha) for lost, gained, _ in tables]
    return {k: outcomes.count(k) / reps for k in ("PASS", "FAIL", "INCONCLUSIVE")}


def sequential(
    rng: np.random.Generator, psi: float, delta: float, reps: int, cap: int, margin: float, alpha: float
) -> dict[str, float]:
    """Stopping-time summary and outcome shares of the sequential test, capped at ``cap`` questions."""
    decisions, stops = sequential_decisions(paired_differences(rng, reps, cap, psi, delta), margin, alpha)
    return {
        "mean": float(stops.mean()),
        "median": float(np.median(stops)),
        "p90": float(np.quantile(stops, 0.9)),
        "PASS": float(np.mean(decisions == "PASS")),
        "FAIL": float(np.mean(decisions == "FAIL")),
        "none": float(np.mean(decisions == "INCONCLUSIVE")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--replicates", type=int, default=1000, help="simulated runs per cell (1000)")
    parser.add_argument("--cap", type=int, default=50_000, help="most questions a sequential run may use")
    parser.add_argument("--margin", type=float, default=0.02)
    parser.add_argument("--alpha", type=float, default=0.025)
    parser.add_argument("--seed", type=int, default=20241201)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    started = time.time()
    print(
        f"margin {args.margin}, alpha {args.alpha}, {args.replicates} runs per cell, sequential cap "
        f"{args.cap:,} questions, seed {args.seed}\n"
    )
    print(
        "| flip rate | true delta | sequential: mean n | median n | 90% of runs by | PASS | FAIL "
        "| undecided at cap | fixed n (planned at delta=0) | fixed: PASS | FAIL |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for psi in FLIP_RATES:
        planned = questions_needed_noninferiority(args.margin, psi, 0.0, args.alpha)
        for delta in DELTAS:
            if abs(delta) > psi:
                print(f"| {psi:.2f} | {delta:+.2f} | impossible: abs(delta) > flip rate | | | | | | | | |")
                continue
            seq = sequential(rng, psi, delta, args.replicates, args.cap, args.margin, args.alpha)
            fix = fixed_design(rng, planned, psi, delta, args.replicates, args.margin, args.alpha)
            print(
                f"| {psi:.2f} | {delta:+.2f} | {seq['mean']:,.0f} | {seq['median']:,.0f} | {seq['p90']:,.0f} "
                f"| {seq['PASS']:.3f} | {seq['FAIL']:.3f} | {seq['none']:.3f} | {planned:,} "
                f"| {fix['PASS']:.3f} | {fix['FAIL']:.3f} |",
                flush=True,
            )
    psi, delta = DEMO
    demo = sequential(rng, psi, delta, 10 * args.replicates, 2000, args.margin, args.alpha)
    print(
        f"\nDemo-sized effect (flip rate {psi:.3f}, delta {delta:+.3f}; {10 * args.replicates} runs): "
        f"FAIL in {demo['FAIL']:.3f} of runs, PASS in {demo['PASS']:.3f}; questions to the decision: "
        f"mean {demo['mean']:.0f}, median {demo['median']:.0f}, 90% by {demo['p90']:.0f}."
    )
    print(f"\n({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
