"""The sequential run's forecast (flyspec/gate/stats/forecast.py) and the progress bar that shows it.

The forecast is checked against the thing it predicts: runs simulated at known rates with the real
sequential rule. It must land near their median stopping point, name the decision they reach, and turn its
time into a chance of deciding within a budget.
"""

from __future__ import annotations

import numpy as np
import pytest

from flyspec.gate.runs.progress import GateProgress
from flyspec.gate.stats.forecast import MIN_PAIRS, forecast
from flyspec.gate.stats.monitor import BASELINE, CANDIDATE, SequentialMonitor, SequentialPlan
from flyspec.gate.stats.sequential import sequential_decisions

RUN = {"margin": 0.02, "alpha": 0.025, "max_questions": 1319, "population_size": 1319}


def _draw(rng: np.random.Generator, p_lost: float, p_gained: float, size) -> np.ndarray:
    return rng.choice([-1, 0, 1], p=[p_lost, 1 - p_lost - p_gained, p_gained], size=size).astype(np.int8)


def _prefix(n: int, lost: int, gained: int, seed: int) -> np.ndarray:
    """n pairs with exactly these counts, in a seeded random order."""
    diffs = np.array([-1] * lost + [1] * gained + [0] * (n - lost - gained), dtype=np.int8)
    return np.random.default_rng(seed).permutation(diffs)


@pytest.mark.parametrize(("lost", "gained", "decision"), [(20, 6, "FAIL"), (6, 6, "PASS")])
def test_the_forecast_lands_near_the_median_stop_of_runs_at_the_rates_seen(
    lost: int, gained: int, decision: str
) -> None:
    """After 150 pairs at the demo's observed effect (13% lost, 4% gained) the forecast names FAIL and puts
    the stop within 25% of the median stop of 400 full runs simulated at those rates; with equal losses
    and gains it names PASS, likewise. (A forecast that ignored the rates, e.g. always the question
    limit, would be off by a factor of 4 or more.)"""
    n, pool = 150, 1319
    rates = (lost / n, gained / n)
    rng = np.random.default_rng(7)
    truth = sequential_decisions(_draw(rng, *rates, (400, pool)), 0.02, 0.025, pool)
    decided = truth[0] == decision
    assert decided.mean() > 0.9
    true_median = float(np.median(truth[1]))
    seen = _prefix(n, lost, gained, seed=1)
    assert sequential_decisions(seen[None, :], 0.02, 0.025, pool)[0][0] == "INCONCLUSIVE"
    outlook = forecast(seen, **RUN, pairs_per_minute=10.0, minutes_left=None)
    assert outlook is not None and outlook.likely == decision
    assert abs(outlook.median_pairs / true_median - 1) < 0.25, (outlook, true_median)


def test_the_forecast_turns_the_rate_into_time_and_a_chance_within_budget() -> None:
    """Minutes are the pairs still to go over the rate; with a budget too short to reach the expected stop
    the chance of deciding within it is small, with a generous one large."""
    seen = _prefix(40, 5, 2, seed=3)
    short = forecast(seen, **RUN, pairs_per_minute=10.0, minutes_left=1.0)
    long = forecast(seen, **RUN, pairs_per_minute=10.0, minutes_left=300.0)
    assert short is not None and long is not None
    assert short.median_pairs == long.median_pairs
    assert short.minutes == pytest.approx((short.median_pairs - 40) / 10.0)
    assert short.within_budget < 0.1 < 0.9 < long.within_budget
    assert "FAIL expected at ~" in long.describe() and "within budget" in long.describe()


def test_no_forecast_before_min_pairs_and_none_expected_without_flips_to_decide_on() -> None:
    """Fewer than MIN_PAIRS pairs give no forecast. A run whose arms agree everywhere (no flips) and whose
    question limit is small cannot decide in it: the forecast says no decision is expected."""
    assert forecast([0] * (MIN_PAIRS - 1), **RUN, pairs_per_minute=5.0, minutes_left=None) is None
    small = {**RUN, "max_questions": 60}
    outlook = forecast([0] * 30, **small, pairs_per_minute=5.0, minutes_left=None)
    assert outlook is not None and outlook.median_pairs is None
    assert "no decision expected" in outlook.describe()


def test_the_progress_bar_shows_answers_per_minute_and_the_forecast_after_min_pairs() -> None:
    """Fed answers of a sequential run, the bar's text gains answers per minute and the forecast once
    MIN_PAIRS pairs are complete, and not before."""
    order = [("gsm8k", str(i)) for i in range(200)]
    plan = SequentialPlan(margin=0.02, alpha=0.025, max_questions=200, population_size=200, order_seed=0)
    monitor = SequentialMonitor(order, plan)
    bar = GateProgress([BASELINE, CANDIDATE], 400, 0, monitor=monitor, deadline=None, enabled=False)
    rng = np.random.default_rng(0)
    for i, (dataset, qid) in enumerate(order[: MIN_PAIRS + 10]):
        base, cand = True, bool(rng.random() > 0.3)
        for lane, correct in ((BASELINE, base), (CANDIDATE, cand)):
            monitor.add(*lane, dataset, qid, correct)
            bar.add(lane, correct)
        if i < MIN_PAIRS - 2:
            assert "answers/min" not in bar._text()
    text = bar._text()
    assert "answers/min" in text and "expected" in text, text


def test_a_budget_the_forecast_says_is_too_short_is_said_once_on_its_own_line(capsys) -> None:
    """With a one-minute budget and a small loss to detect, the first forecast (after MIN_PAIRS pairs)
    expects no decision within the budget, and the bar prints that once as a plain line on stderr (it
    must reach a log, where the bar itself is invisible); a generous budget prints nothing."""
    import time

    for minutes, said in ((1.0, 1), (10_000.0, 0)):
        order = [("gsm8k", str(i)) for i in range(400)]
        plan = SequentialPlan(margin=0.02, alpha=0.025, max_questions=400, population_size=400, order_seed=0)
        monitor = SequentialMonitor(order, plan)
        deadline = time.monotonic() + 60 * minutes
        bar = GateProgress([BASELINE, CANDIDATE], 800, 0, monitor=monitor, deadline=deadline, enabled=False)
        bar.started -= 600  # ten minutes for these pairs: about 4 pairs a minute
        rng = np.random.default_rng(1)
        for dataset, qid in order[: MIN_PAIRS + 25]:
            base, cand = True, bool(rng.random() > 0.1)
            for lane, correct in ((BASELINE, base), (CANDIDATE, cand)):
                monitor.add(*lane, dataset, qid, correct)
                bar.add(lane, correct)
        err = capsys.readouterr().err
        assert err.count("gate: at ") == said, err
        if said:
            assert "pairs/min" in err and "INCONCLUSIVE" in err and "continues the run" in err, err
