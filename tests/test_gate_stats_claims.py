"""What a sequential PASS claims (SPEC 11.3) and the plan that records it (flyspec/gate/stats/monitor.py),
and the judged run's monitor.

The simulation is the audit's case: per-question differences that vary from run to run with an expected
value of exactly -margin. A claim about "these N questions in this run's outputs" then PASSes about half
the time, because each run's own mean lands above -margin half the time; the claim about the method must
PASS at most alpha of the time, which the i.i.d. sequence does and the finite one cannot.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from flyspec.gate.data.spec import plan_from_json, plan_json
from flyspec.gate.stats.decide import claim
from flyspec.gate.stats.judged import JudgedPair
from flyspec.gate.stats.monitor import CS_METHOD, JUDGED_METHOD, Monitor, SequentialPlan, judged_stop
from flyspec.gate.stats.simulation import draw_differences, draw_judged, sequential_decisions

MARGIN, ALPHA = 0.02, 0.025


def test_the_default_plan_claims_the_method_and_old_registrations_stay_finite() -> None:
    """A new plan is about the method (i.i.d. sequence); a registration written before the field existed
    reads back as the finite claim with the old method, so stored runs recompute the same decisions; the
    plan round-trips through its registration and says its claim in words."""
    plan = SequentialPlan(MARGIN, ALPHA, 1319, 1319, 5)
    assert plan.population == "superpopulation" and plan.sequence_population is None
    assert "questions like these" in plan.claim and "run-to-run" in plan.claim
    old = {
        "method": CS_METHOD,
        "margin": MARGIN,
        "alpha": ALPHA,
        "level": 0.95,
        "max_questions": 1319,
        "population_size": 1319,
        "order_seed": 5,
    }
    read = plan_from_json(old)
    assert (read.population, read.method, read.sequence_population) == ("finite", "wsr-mixture", 1319)
    assert "without replacement" in read.description
    assert "these 1319 questions" in read.claim
    for p in (plan, read, dataclasses.replace(plan, method=JUDGED_METHOD, label_rate=0.2, label_bet=2)):
        assert plan_from_json(plan_json(p)) == p
    with pytest.raises(ValueError, match="population"):
        claim("everything")
    with pytest.raises(ValueError, match="label rate"):
        SequentialPlan(MARGIN, ALPHA, 10, 10, 0, method=JUDGED_METHOD)


def test_run_to_run_noise_at_the_margin_passes_the_finite_claim_half_the_time_and_the_default_rarely() -> (
    None
):
    """2,000 runs over one set of 1,319 questions whose per-question differences are redrawn each run
    (6% flips, expected difference exactly -margin), every question answered: the default plan's
    sequence PASSes in at most alpha of runs (within Monte Carlo error); the finite sequence PASSes in
    more than 30% (the audit: about half), so a test of the default claim would fail if the finite
    sequence were the default."""
    runs, pool = 2000, 1319
    d = draw_differences(np.random.default_rng(35), runs, pool, 0.06, -MARGIN)
    plan = SequentialPlan(MARGIN, ALPHA, pool, pool, 0)
    default = np.mean(sequential_decisions(d, MARGIN, ALPHA, plan.sequence_population)[0] == "PASS")
    finite_plan = dataclasses.replace(plan, population="finite")
    finite = np.mean(sequential_decisions(d, MARGIN, ALPHA, finite_plan.sequence_population)[0] == "PASS")
    print(f"\nrun-to-run noise at -margin: default claim P(PASS) {default:.4f}, finite claim {finite:.4f}")
    assert default <= ALPHA + 2.5 * math.sqrt(ALPHA * (1 - ALPHA) / runs)
    assert finite > 0.3


def _judged_pairs(seed: int, n: int, delta: float, rate: float) -> list[JudgedPair]:
    return draw_judged(np.random.default_rng(seed), 1, n, 0.2, delta, "fair", 0.05, rate).pairs()


@pytest.mark.parametrize("delta", [0.06, -0.08])
def test_the_judged_monitor_stops_where_the_stored_pairs_say_and_waits_for_labels(delta: float) -> None:
    """Pairs fed in a shuffled order with every gold label late (the pair first, its label after the
    next few pairs) reach the stop that judged_stop computes from the stored pairs; until a selected
    pair's label arrives the monitor does not move past it."""
    plan = SequentialPlan(MARGIN, ALPHA, 900, 900, 0, method=JUDGED_METHOD, label_rate=0.3, label_bet=2)
    pairs = _judged_pairs(4, 900, delta, 0.3)
    order = [("chat", str(i)) for i in range(900)]
    monitor = Monitor(order, plan)
    rng = np.random.default_rng(1)
    arrival = rng.permutation(900)
    late: list[int] = []
    stop = None
    for step, i in enumerate(arrival):
        pair = pairs[i]
        if pair.selected:
            monitor.add_pair(order[i], dataclasses.replace(pair, gold=None))
            late.append(int(i))
        else:
            stop = monitor.add_pair(order[i], pair) or stop
        if step % 5 == 4:
            for j in late:
                stop = monitor.add_pair(order[j], pairs[j]) or stop
            late = []
    for j in late:
        stop = monitor.add_pair(order[j], pairs[j]) or stop
    expected = judged_stop(order, dict(zip(order, pairs, strict=True)), plan)
    # complete_prefix: the monitor's is where it stopped, the stored pairs' reach further.
    assert stop is not None and dataclasses.replace(stop, complete_prefix=900) == expected
    assert stop.decision == ("PASS" if delta > 0 else "FAIL")
    waiting = dict(zip(order, pairs, strict=True))
    first = next(i for i, p in enumerate(pairs) if p.selected)
    waiting[order[first]] = dataclasses.replace(pairs[first], gold=None)
    held = judged_stop(order, waiting, plan)
    assert held.complete_prefix == first and held.awaiting_label and held.reason == "in_progress"
