"""Which bet should the exact-graded sequential gate use? Questions to a PASS and validity, by simulation.

Compares, on the same simulated runs (margin 2 points, alpha 0.025, i.i.d. differences), the lower
side's capital at -margin of:

- ``mixture``: the gate's registered method (a mixture of eight constant bets, flyspec/gate/stats/
  sequential.py);
- ``aGRAPA``: Waudby-Smith and Ramdas's (2024) approximate growth-rate adaptive bet,
  ``(mu - m) / (sigma^2 + (mu - m)^2)`` from the running mean and variance (their priors: one
  pseudo-observation at 1/2 with variance 1/4), truncated at half the largest bet;
- ``aGRAPA, prior 20``: the same with twenty pseudo-observations, so early noise moves the bet less;
- ``ONS``: online Newton step betting (Cutkosky and Orabona 2018, as in Shekhar and Ramdas 2023).

For flip rates 6%, 16% and 30% with no true loss: mean, median and 90th percentile of the questions to a
PASS (runs capped at 25,000); at delta = -margin: the share of runs that PASS within 4,000 questions
(the error, which must stay at most alpha).

    python scripts/bet_comparison.py                 # the table in docs/statistics.md
    python scripts/bet_comparison.py --runs 200      # a quick look
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from flyspec.gate.stats.sequence import BETS
from flyspec.gate.stats.simulation import draw_differences

MARGIN, ALPHA, CAP = 0.02, 0.025, 25_000
M = (1 - MARGIN) / 2  # -margin on the X = (D + 1) / 2 scale
TRUNCATION = 0.5


def mixture(x: np.ndarray) -> np.ndarray:
    logs = [np.cumsum(np.log1p(min(bet, TRUNCATION / M) * (x - M)), axis=1) for bet in BETS]
    top = np.max(logs, axis=0)
    return top + np.log(np.mean([np.exp(v - top) for v in logs], axis=0))


def agrapa(x: np.ndarray, prior: float) -> np.ndarray:
    t = np.arange(1, x.shape[1] + 1)
    mu = (0.5 * prior + np.cumsum(x, axis=1)) / (t + prior)
    var = (0.25 * prior + np.cumsum((x - mu) ** 2, axis=1)) / (t + prior)
    mu_before = np.concatenate([np.full((x.shape[0], 1), 0.5), mu[:, :-1]], axis=1)
    var_before = np.concatenate([np.full((x.shape[0], 1), 0.25), var[:, :-1]], axis=1)
    bet = np.clip((mu_before - M) / (var_before + (mu_before - M) ** 2), 0.0, TRUNCATION / M)
    return np.cumsum(np.log1p(bet * (x - M)), axis=1)


def ons(x: np.ndarray) -> np.ndarray:
    rows, cols = x.shape
    bet, curvature, log_k = np.zeros(rows), np.ones(rows), np.zeros(rows)
    out = np.empty((rows, cols))
    step = 2 / (2 - math.log(3))
    for t in range(cols):
        g = x[:, t] - M
        log_k += np.log1p(bet * g)
        out[:, t] = log_k
        z = g / (1 + bet * g)
        curvature += z * z
        bet = np.clip(bet + step * z / curvature, 0.0, TRUNCATION / M)
    return out


BETTORS = {
    "mixture (registered)": mixture,
    "aGRAPA": lambda x: agrapa(x, 1.0),
    "aGRAPA, prior 20": lambda x: agrapa(x, 20.0),
    "ONS": ons,
}


def in_chunks(bettor, x: np.ndarray) -> np.ndarray:
    """First PASS of each row (columns + 1 if none), 100 rows at a time to bound memory."""
    stops = []
    for start in range(0, x.shape[0], 100):
        hit = bettor(x[start : start + 100]) >= math.log(1 / ALPHA)
        stops.append(np.where(hit.any(axis=1), hit.argmax(axis=1) + 1, x.shape[1] + 1))
    return np.concatenate(stops)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=20250102)
    args = parser.parse_args()
    started = time.time()
    rng = np.random.default_rng(args.seed)
    print(f"{BETS.size} constant bets in the mixture; {args.runs} runs per flip rate, capped at {CAP:,}\n")
    print("| flip rate | bet | mean n to PASS | median | 90% by | P(PASS) at delta = -margin |")
    print("|---|---|---|---|---|---|")
    for psi in (0.06, 0.16, 0.30):
        x = (draw_differences(rng, args.runs, CAP, psi, 0.0) + 1).astype(np.float32) / 2
        null = (draw_differences(rng, 2 * args.runs, 4000, psi, -MARGIN) + 1).astype(np.float32) / 2
        for name, bettor in BETTORS.items():
            stops = in_chunks(bettor, x)
            error = float((in_chunks(bettor, null) <= null.shape[1]).mean())
            print(
                f"| {psi:.2f} | {name} | {stops.mean():,.0f} | {np.median(stops):,.0f} | "
                f"{np.quantile(stops, 0.9):,.0f} | {error:.4f} |",
                flush=True,
            )
    print(f"\n({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
