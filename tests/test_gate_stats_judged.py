"""Judged comparisons anchored on gold labels (flyspec/gate/stats/judged.py, sequence.py, simulation.py):
the prediction-powered values, the label draw, the prefix rule, the online sequence against the vectorised
simulation. The label advice against simulated runs: tests/test_gate_stats_label_advice.py.

The seeded simulations proving P(PASS) <= alpha for any judge are in
tests/test_gate_stats_judged_validity.py.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from judged_draws import run_draws

from flyspec.gate.data.questions import Question, select_questions
from flyspec.gate.data.spec import Gold
from flyspec.gate.stats.decide import judged_decision
from flyspec.gate.stats.judged import (
    GOLD_DRAW,
    JudgedPair,
    gold_selected,
    judge_counts,
    judge_prediction,
    judged_values,
    usable_prefix,
    value_range,
)
from flyspec.gate.stats.sequence import (
    BET,
    PRIOR_MEAN,
    PRIOR_VARIANCE,
    BoundedMeanSequence,
    check_bet,
    log_mean_exp,
)
from flyspec.gate.stats.simulation import draw_judged, judged_runs

MARGIN, ALPHA = 0.02, 0.025


def _pairs(seed: int, n: int, differing: float, delta: float, judge: str, noise: float, rate: float):
    return draw_judged(np.random.default_rng(seed), 1, n, differing, delta, judge, noise, rate).pairs()


@pytest.mark.parametrize("rate", [1.0, 0.5, 0.1])
@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
def test_the_value_is_unbiased_for_the_gold_difference_and_lies_in_its_range(rate: float, lam: float) -> None:
    """For every gold D and every prediction f a judge can give, averaging Y over the label draw gives D
    exactly (whatever lam was fixed beforehand), and every Y lies in [1 - 2/rate, 2/rate - 1]. A value
    that used the judge without the correction (Y = f) would be off by f - D."""
    lo, hi = value_range(rate)
    for d, f in itertools.product((-1, 0, 1), (-1.0, -0.5, 0.0, 0.5, 1.0)):
        labelled = lam * f + (d - lam * f) / rate
        unlabelled = lam * f
        assert rate * labelled + (1 - rate) * unlabelled == pytest.approx(d, abs=1e-12)
        assert lo - 1e-12 <= labelled <= hi + 1e-12 and lo <= unlabelled <= hi
    # The range is attained: a judge sure of the wrong winner, labelled, at lam = 1.
    assert 1 * 1 + (-1 - 1) / rate == pytest.approx(lo)


def test_values_use_only_labels_seen_before_and_identical_pairs_are_zero() -> None:
    """Y_i does not change when a later label changes (the weight is predictable); identical pairs give
    0; a pair waiting for its label raises."""
    pairs = _pairs(3, 300, 0.3, 0.0, "fair", 0.05, 0.3)
    y = judged_values(pairs, 0.3)
    last = max(i for i, p in enumerate(pairs) if p.selected)
    changed = list(pairs)
    changed[last] = JudgedPair(False, pairs[last].prediction, True, -pairs[last].gold or 1)
    assert np.array_equal(judged_values(changed, 0.3)[:last], y[:last])
    assert all(v == 0 for v, p in zip(y, pairs, strict=True) if p.identical)
    waiting = list(pairs)
    waiting[last] = JudgedPair(False, pairs[last].prediction, True, None)
    with pytest.raises(ValueError, match="usable_prefix"):
        judged_values(waiting, 0.3)
    assert usable_prefix(waiting) == last


def test_the_gold_draw_is_seeded_nested_and_at_its_rate() -> None:
    """The draw depends only on seed, dataset and question; it is nested in the rate; over 20,000
    questions its share is the rate within 4 standard errors."""
    ids = [str(i) for i in range(20_000)]
    at_10 = [gold_selected(7, "gsm8k", q, 0.1) for q in ids]
    at_20 = [gold_selected(7, "gsm8k", q, 0.2) for q in ids]
    assert all(b for a, b in zip(at_10, at_20, strict=True) if a)
    assert abs(np.mean(at_10) - 0.1) < 4 * np.sqrt(0.1 * 0.9 / len(ids))
    assert at_10 != [gold_selected(8, "gsm8k", q, 0.1) for q in ids]
    assert at_10 == [gold_selected(7, "gsm8k", q, 0.1) for q in ids]


def _drawn_by_decile(seed: int, draw: int, rate: float = 0.2) -> list[float]:
    """The share of questions drawn for a gold label in each tenth of the run's order, with the order and
    the draw the gate uses: ``select_questions`` over two datasets of 1,000 questions, ``Gold.selected``."""
    datasets = {
        name: [Question(str(i), "1", "exact", name, prompt=f"{name} {i}") for i in range(1000)]
        for name in ("gsm8k", "chats")
    }
    order = select_questions(datasets, seed=seed)
    gold = Gold(rate, seed, "exact", draw=draw)
    drawn = np.array([gold.selected(q.dataset, q.id) for q in order])
    return [float(part.mean()) for part in np.array_split(drawn, 10)]


@pytest.mark.parametrize("seed", [0, 1, 7, 2024])
def test_the_share_drawn_is_the_same_in_every_decile_of_the_order(seed: int) -> None:
    """The gold draw is independent of the question order: in every tenth of the order (200 questions)
    the share drawn is the rate within 4 standard errors, for several seeds."""
    rate, size = 0.2, 200
    bound = 4 * np.sqrt(rate * (1 - rate) / size)
    shares = _drawn_by_decile(seed, GOLD_DRAW, rate)
    assert all(abs(share - rate) < bound for share in shares), shares


def test_a_narrow_final_interval_is_flagged_under_the_defective_draw_only() -> None:
    """The report comments on a judged interval less than half as wide as a normal-theory interval from the
    same values (``JudgedDecision.narrow``): the running bounds met because the values' mean changed along
    the order. Fixed runs of 2,000 questions, 16% differing, the harsh judge at a true loss of the margin,
    label rate 0.2, with the gate's order: under draw 1 many runs are flagged (the audit's interval was
    0.1 points wide and excluded the truth), under draw 2 none of the same runs, nor with a fair judge."""
    flagged = {}
    for draw in (1, GOLD_DRAW):
        _, draws = run_draws(16, 2000, draw)
        for judge in ("harsh", "fair"):
            block = draw_judged(
                np.random.default_rng(5), 16, 2000, 0.16, -MARGIN, judge, 0.05, 0.2, draws=draws
            )
            flagged[draw, judge] = sum(
                judged_decision(block.pairs(r), MARGIN, ALPHA, 0.2, "fixed").narrow for r in range(16)
            )
    assert flagged[1, "harsh"] >= 5, flagged
    assert flagged[GOLD_DRAW, "harsh"] == flagged[GOLD_DRAW, "fair"] == 0, flagged


def test_pairs_reject_impossible_fields() -> None:
    """An identical pair is never judged or labelled; gold is -1, 0 or 1 and only on a selected pair."""
    with pytest.raises(ValueError, match="identical"):
        JudgedPair(True, 0.5)
    with pytest.raises(ValueError, match="gold"):
        JudgedPair(False, 0.0, True, 2)
    with pytest.raises(ValueError, match="selected"):
        JudgedPair(False, 0.0, False, 1)
    with pytest.raises(ValueError, match="prediction"):
        JudgedPair(False, 1.5)
    assert judge_prediction(1, -1) == 0.0 and judge_prediction(1, 1) == 1.0


@pytest.mark.parametrize("rate", [0.3, 1.0])
@pytest.mark.parametrize("design", ["fixed", "sequential"])
def test_the_online_decision_is_the_simulated_one(design: str, rate: float) -> None:
    """judged_decision (online, on a grid) and judged_runs (vectorised, capital beside the margin) reach
    the same decision at the same question on 16 seeded runs with decisions of both kinds. Rate 1 (every
    differing pair labelled) puts the grid's ends at the edge of the value range, where an unbounded bet
    once turned the online capital into NaN and kept the interval at [-1, 1] for ever."""
    seen = set()
    for seed in range(16):
        delta = (0.06, -0.08)[seed % 2]
        out = judged_runs(
            np.random.default_rng(seed),
            1,
            900,
            0.2,
            delta,
            MARGIN,
            ALPHA,
            "fair",
            0.05,
            rate,
            design,
            block=900,
        )
        pairs = _pairs(seed, 900, 0.2, delta, "fair", 0.05, rate)
        decision = judged_decision(pairs, MARGIN, ALPHA, rate, design)
        assert decision.decision == out.decisions[0], seed
        if design == "sequential":
            assert decision.stopped_at == out.stopped_at[0], seed
        seen.add(decision.decision)
    assert {"PASS", "FAIL"} <= seen


def _plug_in_bets(x: np.ndarray, alpha: float, horizon: int) -> np.ndarray:
    """The fixed-horizon bet before each observation (untruncated), for rows of observations in [0, 1].

    ``lambda_t = sqrt(2 log(2 / alpha) / (horizon sigma_{t-1}^2))`` with the running estimates
    ``mu_t = (1/2 + sum_{i<=t} x_i) / (t + 1)`` and
    ``sigma_t^2 = (1/4 + sum_{i<=t} (x_i - mu_i)^2) / (t + 1)``
    (Waudby-Smith and Ramdas 2024, section 4: the predictable plug-in tuned to n); each bet uses only
    earlier observations.
    """
    steps = np.arange(1, x.shape[-1] + 1, dtype=float)
    mu = (PRIOR_MEAN + np.cumsum(x, axis=-1)) / (steps + 1)
    sigma2 = (PRIOR_VARIANCE + np.cumsum((x - mu) ** 2, axis=-1)) / (steps + 1)
    before = np.concatenate([np.full(x.shape[:-1] + (1,), PRIOR_VARIANCE), sigma2[..., :-1]], axis=-1)
    return np.sqrt(2.0 * math.log(2.0 / alpha) / (horizon * before))


def log_capital(
    x: np.ndarray, m: float, side: int, alpha: float, horizon: int | None, bet: int = BET
) -> np.ndarray:
    """Running log capital of one side at the candidate mean ``m`` (in X units) for rows of observations
    ``x`` in [0, 1] (shape (runs, n)): ``side=1`` is K+ (it grows when the mean is above m), ``-1`` K-.

    ``BoundedMeanSequence`` written again for many rows at once, as this test's independent reference.
    """
    if not 0.0 < m < 1.0:
        raise ValueError(f"m={m!r}: must lie strictly inside (0, 1)")
    room = m if side > 0 else 1.0 - m
    deviation = side * (x - m)
    if horizon is None:
        logs = [np.cumsum(np.log1p((f / room) * deviation), axis=-1) for f in check_bet(bet).fractions]
        return log_mean_exp(np.stack(logs), axis=0)
    bets = np.minimum(_plug_in_bets(x, alpha, horizon), check_bet(bet).truncation / room)
    return np.cumsum(np.log1p(bets * deviation), axis=-1)


def test_bounded_sequence_matches_the_vectorised_capital() -> None:
    """The online grid sequence rejects a candidate mean exactly when log_capital there reaches log(2/alpha)
    (both bet types), so the simulations test the procedure the gate runs."""
    rng = np.random.default_rng(2)
    y = np.clip(rng.normal(0.05, 1.0, 600), -3, 3)
    for horizon in (None, 600):
        seq = BoundedMeanSequence(-3.0, 3.0, 0.1, horizon)
        for value in y:
            seq.update(float(value))
        for j in (1500, 1990, 2100, 2200):
            m = (seq.grid[j] + 3.0) / 6.0
            up = log_capital(((y + 3.0) / 6.0)[None, :], m, 1, 0.1, horizon)[0]
            down = log_capital(((y + 3.0) / 6.0)[None, :], m, -1, 0.1, horizon)[0]
            rejected = max(up.max(), down.max()) >= np.log(2 / 0.1)
            assert rejected == (not seq.live[j]), (horizon, j)


def test_counts_and_agreement() -> None:
    """lost/gained/undecided follow the judge's two orders; agreement counts labelled pairs whose verdict
    has the gold sign, with a Wilson interval."""
    pairs = [
        JudgedPair(True),
        JudgedPair(False, -1.0, True, -1),
        JudgedPair(False, 1.0, True, -1),
        JudgedPair(False, 0.0, True, 0),
        JudgedPair(False, 0.5),
    ]
    counts = judge_counts(pairs)
    assert (counts.identical, counts.lost, counts.gained, counts.undecided) == (1, 1, 1, 2)
    assert (counts.labelled, counts.agreeing) == (3, 2)
    assert counts.agreement_low < 2 / 3 < counts.agreement_high
