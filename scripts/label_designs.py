"""Which label design cuts the gold labels a good judge needs? Seeded simulations (docs/statistics.md,
"Fewer labels for a good judge").

Judged runs of 400 and 2,000 questions, 30% of answers differing, a true loss of 12 points or none,
margin 2 points, alpha 0.025, for a judge right on every pair, one right 95% of the time per order, and a
coin. Each cell draws its runs once (common random numbers: the same pairs, verdicts and uniform draw
numbers for every design) and walks them under the rule of ``judged_decision`` with:

- ``uniform``: every differing pair labelled with probability r, bets version 1 (the gate before
  version 2);
- ``by-verdict``: a pair whose two orders agree (|f| = 1) labelled with probability a, any other with
  min(1, 3a), a chosen so that this judge's expected labels equal uniform's at r (the weight 1 / pi of
  each labelled pair, the range [1 - 2/a, 2/a - 1]);
- ``lam-1``: uniform, the PPI++ weight started at 1 instead of 1/2 (still worth one labelled pair);
- ``bets-2``: uniform with bets version 2 (flyspec/gate/stats/sequence.py, ``BET_VERSIONS``): up to 0.99
  of the largest safe bet instead of 0.9 (fixed runs: the plug-in's truncation) or 0.95 (sequential
  runs: the mixture's fractions 0.99 ... 0.13 instead of 0.95 ... 0.09). What runs register now.

The first three use bets version 1, so each design differs from ``uniform`` in one thing. Prints, per
cell, the share of runs that decide (PASS or FAIL) and the mean gold labels drawn up to each run's stop.

    python scripts/label_designs.py                # the table in docs/statistics.md (about 2 minutes)
    python scripts/label_designs.py --runs 200     # a quick look
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from flyspec.gate.stats.decide import INCONCLUSIVE, crossing_verdicts
from flyspec.gate.stats.judged import LAM_PRIOR_WEIGHT
from flyspec.gate.stats.simulation import CapitalAtMargin, JudgedBlock, Stops, draw_judged

JUDGES = (("always right", "fair", 0.0), ("right 95%", "fair", 0.05), ("coin", "coin", 0.0))
DESIGNS = ("uniform", "by-verdict", "lam-1", "bets-2")
DISAGREE_FACTOR = 3.0
MARGIN, ALPHA, DIFFERING = 0.02, 0.025, 0.30


def disagreeing_share(judge: str, noise: float) -> float:
    """The expected share of differing pairs whose two orders do not agree (|f| < 1)."""
    return 0.5 if judge == "coin" else 2.0 * noise * (1.0 - noise)


def label_probabilities(design: str, rate: float, share: float, f: np.ndarray) -> tuple[np.ndarray, float]:
    """Each pair's label probability and the smallest one (which sets the values' range)."""
    if design != "by-verdict":
        return np.full(f.shape, rate), rate
    agree = rate / ((1.0 - share) + DISAGREE_FACTOR * share)
    return np.where(np.abs(f) == 1.0, agree, min(1.0, DISAGREE_FACTOR * agree)), agree


def walk(
    block: JudgedBlock, u: np.ndarray, design: str, rate: float, share: float, kind: str
) -> tuple[np.ndarray, float]:
    """Decisions of the runs (rows) of ``block`` under ``design``; returns (decisions, mean labels)."""
    runs, questions = block.identical.shape
    pi, smallest = label_probabilities(design, rate, share, block.prediction)
    selected = (u < pi) & ~block.identical
    horizon = questions if kind == "fixed" else None
    lo, hi = 1.0 - 2.0 / smallest, 2.0 / smallest - 1.0
    capital = CapitalAtMargin(runs, lo, hi, MARGIN, ALPHA, horizon, bet=2 if design == "bets-2" else 1)
    prior = 1.0 if design == "lam-1" else 0.5
    sum_df, sum_ff = np.full(runs, prior * LAM_PRIOR_WEIGHT), np.full(runs, LAM_PRIOR_WEIGHT)
    labelled = np.zeros(runs, dtype=np.int64)
    stops, active = Stops(runs, questions), np.arange(runs)
    for start in range(0, questions, 256):
        cut = slice(start, min(start + 256, questions))
        f, d, xi = block.prediction[active, cut], block.gold[active, cut], selected[active, cut].astype(float)
        df, ff = np.cumsum(xi * d * f, axis=1), np.cumsum(xi * f * f, axis=1)
        lam = np.clip((sum_df[:, None] + df - xi * d * f) / (sum_ff[:, None] + ff - xi * f * f), 0.0, 1.0)
        y = np.where(block.identical[active, cut], 0.0, lam * f + xi / pi[active, cut] * (d - lam * f))
        labels = labelled[:, None] + np.cumsum(xi, axis=1)
        sum_df, sum_ff, labelled = sum_df + df[:, -1], sum_ff + ff[:, -1], labels[:, -1].astype(np.int64)
        plus, minus = capital.step(y)
        if kind == "fixed":
            stops.passed |= plus.any(axis=1) & (labelled > 0)
            stops.failed |= minus.any(axis=1) & (labelled > 0)
            continue
        keep = stops.record(active, start, plus & (labels >= 1), minus & (labels >= 1))
        active, sum_df, sum_ff, labelled = active[keep], sum_df[keep], sum_ff[keep], labelled[keep]
        capital.keep(keep)
        if active.size == 0:
            break
    decisions = crossing_verdicts(stops.passed, stops.failed)
    # Labels drawn up to each run's stop (a fixed run uses all its pairs).
    used = np.cumsum(selected, axis=1)[np.arange(runs), stops.stopped_at - 1]
    return decisions, float(used.mean())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=1000, help="simulated runs per cell (1000)")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4])
    parser.add_argument("--questions", type=int, nargs="+", default=[400, 2000])
    parser.add_argument("--designs", nargs="+", default=list(DESIGNS), choices=DESIGNS)
    parser.add_argument(
        "--kinds", nargs="+", default=["fixed", "sequential"], choices=["fixed", "sequential"]
    )
    args = parser.parse_args()
    began = time.perf_counter()
    print(
        "kind | questions | truth | judge | rate | "
        + " | ".join(f"{d}: decide, labels" for d in args.designs)
    )
    for kind in args.kinds:
        for questions in args.questions:
            for truth in (-0.12, 0.0):
                for k, (name, judge, noise) in enumerate(JUDGES):
                    rng = np.random.default_rng(1000 * k + questions + int(100 * -truth))
                    u = rng.random((args.runs, questions))
                    block = draw_judged(
                        rng, args.runs, questions, DIFFERING, truth, judge, noise, 1.0, draws=u
                    )
                    share = disagreeing_share(judge, noise)
                    for rate in args.rates:
                        cells = []
                        for design in args.designs:
                            decisions, labels = walk(block, u, design, rate, share, kind)
                            cells.append(f"{np.mean(decisions != INCONCLUSIVE):.3f}, {labels:.1f}")
                        print(
                            f"{kind} | {questions} | {100 * truth:+.0f} | {name} | {rate:g} | "
                            + " | ".join(cells)
                        )
    print(f"({time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
