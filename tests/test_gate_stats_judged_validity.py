"""Seeded simulations: a judged run anchored on gold labels keeps P(PASS) <= alpha for ANY judge, and the
old rule (undecided pairs counted against the claim, no labels) does not.

Each cell simulates runs at a true difference of -margin or -1.5 x margin (margin 2 points, alpha 0.025)
with a share of differing answers, a judge and a gold-label rate of 0.2, in three designs: fixed runs
(the plug-in bet tuned to n), sequential runs (the anytime mixture, looked at after every question) and
finite-population runs (a fixed set of 2,000 questions whose mean is exactly the difference, visited in a
random order, judged runs using the i.i.d. sequence). The judges: always "A" (position bias), a coin, fair
judges wrong 2%, 5% and 10% of the time per order, and one that always prefers the candidate.

Monte Carlo error: R runs give a rate's standard error sqrt(p (1 - p) / R): 0.0049 at alpha with 1,000
runs, 0.0035 with 2,000; each bound allows 2.5 of them. The fast tier runs the key cells with 1,000 runs;
the full grid (2,000 runs per cell) is marked slow. Every test also runs the old rule on the same design
and shows it PASSing a harmful candidate more often than alpha with a coin judge at 3% differing answers.
``pytest -s`` prints the rates; docs/gate.md quotes them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from flyspec.gate.stats import sequential_decisions
from flyspec.gate.stats.simulation import JudgedBlock, draw_judged, judged_runs

MARGIN, ALPHA, RATE = 0.02, 0.025, 0.2
POPULATION = 2000
JUDGES = [
    ("always-A", 0.0),
    ("coin", 0.0),
    ("fair", 0.02),
    ("fair", 0.05),
    ("fair", 0.10),
    ("always-candidate", 0.0),
]
DIFFERING = (0.02, 0.03, 0.16, 0.40)
DESIGNS = ("fixed", "sequential", "finite")


def _mc_bound(rate: float, runs: int) -> float:
    return rate + 2.5 * math.sqrt(rate * (1 - rate) / runs)


def population(differing: float, delta: float, size: int = POPULATION) -> np.ndarray:
    """A finite set of gold differences with exactly ``differing * size`` differing answers and mean
    exactly ``delta`` (0 marks identical answers)."""
    k, net = round(differing * size), round(-delta * size)
    lost = (k + net) // 2
    gained = k - lost
    if lost - gained != net:
        raise ValueError(f"no set of {size} with {k} differing answers and net {-net}")
    return np.array([-1] * lost + [1] * gained + [0] * (size - k), dtype=np.int8)


def new_rule_pass(
    design: str,
    differing: float,
    delta: float,
    judge: str,
    noise: float,
    runs: int,
    questions: int,
    seed: int,
) -> float:
    """P(PASS) of judged runs under judged_decision's rule (the FAIL side skipped: conservative);
    ``questions``: each run's length, or the finite set's size."""
    rng = np.random.default_rng(seed)
    if design == "finite":
        pop = population(differing, delta, questions)
        out = judged_runs(
            rng,
            runs,
            pop.size,
            differing,
            delta,
            MARGIN,
            ALPHA,
            judge,
            noise,
            RATE,
            "sequential",
            population=pop,
            fail_side=False,
        )
    else:
        out = judged_runs(
            rng, runs, questions, differing, delta, MARGIN, ALPHA, judge, noise, RATE, design, fail_side=False
        )
    return out.share("PASS")


def _old_pass_side(block: JudgedBlock) -> np.ndarray:
    """The old rule's PASS-side differences: both orders prefer the baseline, or the orders disagree:
    -1; both prefer the candidate: +1; identical or both tie: 0."""
    first, second = block.votes
    gained = (first == 1) & (second == 1) & ~block.identical
    tie = block.identical | ((first == 0) & (second == 0))
    return np.where(gained, 1, np.where(tie, 0, -1)).astype(np.int8)


def _tango(n: int, lost: np.ndarray, gained: np.ndarray, d0: float) -> np.ndarray:
    a = 2.0 * n
    b = -gained - lost + (2.0 * n - gained + lost) * d0
    c = -lost * d0 * (1.0 - d0)
    p = (np.sqrt(np.maximum(b * b - 4 * a * c, 0.0)) - b) / (2 * a)
    return (gained - lost - n * d0) / np.sqrt(n * (2 * p + d0 * (1 - d0)))


def old_rule_pass(
    design: str,
    differing: float,
    delta: float,
    judge: str,
    noise: float,
    runs: int,
    questions: int,
    seed: int,
) -> float:
    """P(PASS) of the old rule (decide_with_undecided / sequential_decision_with_undecided, whose PASS
    side is Tango's test or the sequence on the PASS-side differences)."""
    rng = np.random.default_rng(seed)
    if design == "finite":
        pop = population(differing, delta, questions)
        d = np.stack([rng.permutation(pop) for _ in range(runs)])
        block = draw_judged(rng, runs, pop.size, differing, delta, judge, noise, RATE, d=d)
        return float(
            np.mean(sequential_decisions(_old_pass_side(block), MARGIN, ALPHA, pop.size)[0] == "PASS")
        )
    block = draw_judged(rng, runs, questions, differing, delta, judge, noise, RATE)
    side = _old_pass_side(block)
    if design == "fixed":
        lost, gained = (side == -1).sum(axis=1), (side == 1).sum(axis=1)
        return float(np.mean(_tango(questions, lost, gained, -MARGIN) > norm.ppf(1 - ALPHA)))
    return float(np.mean(sequential_decisions(side, MARGIN, ALPHA)[0] == "PASS"))


def _check_cells(
    design: str, cells: list[tuple[float, float, str, float]], runs: int, questions: int
) -> None:
    rates = []
    for k, (differing, delta, judge, noise) in enumerate(cells):
        rate = new_rule_pass(design, differing, delta, judge, noise, runs, questions, seed=1000 + k)
        rates.append(rate)
        print(
            f"\n{design} differing {differing:.2f} delta {delta:+.3f} {judge} {noise:.2f}: P(PASS) {rate:.4f}"
        )
    assert max(rates) <= _mc_bound(ALPHA, runs), rates


def _check_old_rule_fails(
    design: str, runs: int, questions: int, differing: float = 0.03, judge: str = "coin"
) -> None:
    old = old_rule_pass(design, differing, -MARGIN, judge, 0.0, runs, questions, seed=7)
    print(f"\n{design}: old rule, {judge} judge, {differing:.0%} differing, delta -margin: P(PASS) {old:.4f}")
    assert old > _mc_bound(ALPHA, runs) + 0.02


FAST_CELLS = [(0.03, -MARGIN, judge, noise) for judge, noise in JUDGES] + [
    (0.16, -MARGIN, "always-candidate", 0.0),
    (0.40, -1.5 * MARGIN, "coin", 0.0),
]


@pytest.mark.parametrize("design", DESIGNS)
def test_judged_runs_keep_alpha_for_any_judge(design: str) -> None:
    """Fast tier: every judge at 3% differing answers and delta = -margin, the adversary at 16% and a
    coin at 40% (delta -1.5 margin): P(PASS) <= alpha within Monte Carlo error in 1,000 runs (fixed
    and sequential runs of 1,500 questions; a finite set of 1,000), while the old rule PASSes the coin's
    harmful candidate far more often (runs of 4,000 questions; a finite set of 2,000)."""
    _check_cells(design, FAST_CELLS, runs=1000, questions=1000 if design == "finite" else 1500)
    _check_old_rule_fails(design, runs=1000, questions=POPULATION if design == "finite" else 4000)


@pytest.mark.slow
@pytest.mark.parametrize("differing", DIFFERING)
@pytest.mark.parametrize("design", DESIGNS)
def test_judged_runs_keep_alpha_full_grid(design: str, differing: float) -> None:
    """The full grid: 6 judges x 2 true differences (-margin, -1.5 margin; only -margin at 2%, the
    audit's reproduction: the candidate differs on 2% of questions and is worse on all of them) at this
    share of differing answers, 2,000 runs each (fixed and sequential runs of 4,000 questions). The old
    rule, given a judge that always prefers the candidate, exceeds alpha on the same cells."""
    cells = [
        (differing, delta, judge, noise)
        for judge, noise in JUDGES
        for delta in (-MARGIN, -1.5 * MARGIN)
        if abs(delta) <= differing
    ]
    questions = POPULATION if design == "finite" else 4000
    _check_cells(design, cells, runs=2000, questions=questions)
    _check_old_rule_fails(design, 2000, questions, differing, "always-candidate")
