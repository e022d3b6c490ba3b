"""The decision rule on fixed-size runs, sample-size planning, and fixed-sequence testing
(docs/statistics.md); the rule lives in flyspec/gate/stats/decide.py only, and the simulations' vectorised
rule is pinned to it.

The simulations behind these rules are in tests/test_gate_stats_validity.py.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import binom

from flyspec.gate.stats import (
    decide,
    mcnemar,
    net_difference_ci,
    questions_needed_noninferiority,
    sequential_decision,
)
from flyspec.gate.stats.decide import fixed_sequence
from flyspec.gate.stats.simulation import draw_differences
from flyspec.gate.stats.sizing import Design, flip_rate_upper_bound, plan_noninferiority, simulate

GATE = Path(__file__).resolve().parent.parent / "flyspec" / "gate"
RULE_HOMES = {
    GATE / "stats" / "decide.py": "the rule, the verdicts' names and every route that applies it",
}
VERDICTS = {"PASS", "FAIL"}
READERS = {"share", "count", "index"}
"""Methods that only look a verdict up (``Outcomes.share(PASS)``): passing it to them assigns nothing."""


def test_decide_fields_and_interval() -> None:
    """decide returns a frozen dataclass with exactly decision, loss_detected, low, high; the bounds are
    Tango's 1 - 2 alpha interval."""
    result = decide(58, 14, 1, 0.02)
    assert [f.name for f in dataclasses.fields(result)] == ["decision", "loss_detected", "low", "high"]
    assert (result.low, result.high) == net_difference_ci(58, 14, 1, level=0.95)
    assert (decide(58, 14, 1, 0.02, alpha=0.05).low, decide(58, 14, 1, 0.02, alpha=0.05).high) == (
        net_difference_ci(58, 14, 1, level=0.90)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.decision = "PASS"  # type: ignore[misc]


def test_decide_outcomes() -> None:
    """PASS above -margin, FAIL below it, INCONCLUSIVE between; loss_detected means high < 0."""
    clear = decide(1000, 20, 20, 0.02)
    assert (clear.decision, clear.loss_detected) == ("PASS", False)
    fail = decide(58, 14, 1, 0.02)
    assert (fail.decision, fail.loss_detected) == ("FAIL", True)
    assert (decide(1000, 30, 20, 0.02).decision, decide(1000, 30, 20, 0.02).loss_detected) == (
        "INCONCLUSIVE",
        False,
    )


def test_a_significant_loss_is_reported_beside_the_decision() -> None:
    """A loss McNemar calls highly significant (p = 0.001) is INCONCLUSIVE with loss_detected when the
    interval straddles the margin, and PASS (still loss_detected) when it lies above it: never FAIL."""
    assert mcnemar(40, 15).exact_p < 0.002
    straddles = decide(1000, 40, 15, 0.03)
    assert (straddles.decision, straddles.loss_detected) == ("INCONCLUSIVE", True)
    assert straddles.low < -0.03 < straddles.high < 0
    within = decide(1000, 45, 15, 0.05)
    assert (within.decision, within.loss_detected) == ("PASS", True)


def test_decide_bad_inputs() -> None:
    """A bad margin, alpha or table raises ValueError naming the field."""
    with pytest.raises(ValueError, match="margin"):
        decide(100, 3, 4, 0.0)
    with pytest.raises(ValueError, match="alpha"):
        decide(100, 3, 4, 0.02, alpha=0.5)
    with pytest.raises(ValueError, match="exceeds n"):
        decide(10, 8, 5, 0.02)


@pytest.mark.parametrize(("flips", "n"), [(0, 50), (1, 50), (6, 100), (17, 230), (49, 50)])
def test_flip_rate_upper_bound_is_clopper_pearson(flips: int, n: int) -> None:
    """The bound u solves P[Binomial(n, u) <= flips] = 1 - level (the exact Clopper-Pearson definition)."""
    upper = flip_rate_upper_bound(flips, n)
    assert binom.cdf(flips, n, upper) == pytest.approx(0.05, abs=1e-9)


def test_zero_flips_do_not_mean_a_zero_rate() -> None:
    """No flips in 50: the 95% bound is 1 - 0.05^(1/50) = 5.8%, and the plan uses it, offering no plan at
    the observed rate; all flips: bound 1."""
    assert flip_rate_upper_bound(0, 50) == pytest.approx(1 - 0.05 ** (1 / 50))
    assert flip_rate_upper_bound(50, 50) == 1.0
    plan = plan_noninferiority(0, 50, 0.02)
    assert plan.flip_rate == 0.0 and plan.questions_at_observed is None
    assert plan.questions == questions_needed_noninferiority(0.02, plan.flip_rate_upper)
    with pytest.raises(ValueError, match="flips"):
        flip_rate_upper_bound(51, 50)


def test_plan_from_a_pilot_with_flips() -> None:
    """With flips seen, both plans are given and the upper-bound plan is the larger."""
    plan = plan_noninferiority(6, 100, 0.02)
    assert plan.questions_at_observed == questions_needed_noninferiority(0.02, 0.06)
    assert plan.questions > plan.questions_at_observed
    shifted = plan_noninferiority(6, 100, 0.02, true_diff=-0.005)
    assert shifted.questions == questions_needed_noninferiority(0.02, shifted.flip_rate_upper, -0.005)


def test_fixed_sequence_labels() -> None:
    """The chosen index is the last PASS before the first non-PASS; later settings are NOT TESTED, even
    ones that would have passed; nothing passes when the first does not."""
    assert fixed_sequence(["PASS", "PASS", "INCONCLUSIVE", "PASS"]) == (
        1,
        ["PASS", "PASS", "INCONCLUSIVE", "NOT TESTED"],
    )
    assert fixed_sequence(["FAIL", None]) == (None, ["FAIL", "NOT TESTED"])
    assert fixed_sequence(["PASS", "PASS"]) == (1, ["PASS", "PASS"])
    assert fixed_sequence([]) == (None, [])
    with pytest.raises(ValueError, match=r"decisions\[0\]"):
        fixed_sequence([None, "PASS"])
    with pytest.raises(ValueError, match=r"decisions\[1\]"):
        fixed_sequence(["PASS", "maybe"])


def _assigned_verdicts(tree: ast.AST) -> Iterator[int]:
    """Lines where PASS or FAIL (the name or the string) is given as a value: anything but a comparison
    with it, a membership test, a dict key, ``__all__`` or a look-up (``READERS``)."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        named = isinstance(node, ast.Name) and node.id in VERDICTS and isinstance(node.ctx, ast.Load)
        if not (named or (isinstance(node, ast.Constant) and node.value in VERDICTS)):
            continue
        parent = parents[node]
        if isinstance(parent, (ast.Tuple, ast.Set, ast.List)):
            holder = parents[parent]
            if isinstance(holder, ast.Compare):
                continue
            if isinstance(holder, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in holder.targets
            ):
                continue
        if isinstance(parent, ast.Compare) or (isinstance(parent, ast.Dict) and node in parent.keys):
            continue
        called = parent.func if isinstance(parent, ast.Call) else None
        if isinstance(called, ast.Attribute) and called.attr in READERS:
            continue
        yield node.lineno


def test_verdicts_are_assigned_only_in_decide() -> None:
    """No module of the gate but stats/decide.py (which also names them) gives a run PASS or FAIL: the
    rule is written once, and every route (the fixed and sequential decisions, the running monitor, the
    report's replay, tune, compare, the simulations) reaches it there."""
    found = [
        f"{path.relative_to(GATE)}:{line}"
        for path in sorted(GATE.rglob("*.py"))
        if path not in RULE_HOMES
        for line in _assigned_verdicts(ast.parse(path.read_text(), str(path)))
    ]
    assert found == [], f"PASS/FAIL assigned outside flyspec/gate/stats/decide.py: {found}"


def test_the_verdict_check_can_fail() -> None:
    """The check finds a verdict assigned by a conditional, an array rule and a keyword, and passes
    comparisons, membership tests, dict keys, ``__all__`` and look-ups."""
    caught = """
decision = PASS if low > -margin else FAIL
decisions = np.where(passed, "PASS", "FAIL")
stop = Stop(decision=FAIL)
"""
    assert list(_assigned_verdicts(ast.parse(caught))) == [2, 2, 3, 3, 4]
    allowed = """
__all__ = ["PASS", "FAIL"]
if decision == PASS or decision in (FAIL, "PASS"):
    colours = {PASS: "green", "FAIL": "red"}
    rate = out.share(PASS)
"""
    assert list(_assigned_verdicts(ast.parse(allowed))) == []


@pytest.mark.parametrize("true_diff", [0.0, -0.03, -0.08])
def test_the_simulated_fixed_design_is_decide_on_the_same_draws(true_diff: float) -> None:
    """The sizing's vectorised fixed design (Tango's statistic at -margin against z) gives, run by run,
    the verdict ``decide`` gives on the same seeded tables."""
    n, flips, margin, alpha, runs = 400, 0.2, 0.05, 0.025, 60
    out = simulate(Design("fixed", n), flips, margin, alpha, true_diff, runs=runs, seed=11)
    tables = np.random.default_rng(11).multinomial(
        n, [(flips - true_diff) / 2, (flips + true_diff) / 2, 1 - flips], size=runs
    )
    expected = [decide(n, int(lost), int(gained), margin, alpha).decision for lost, gained, _ in tables]
    assert out.decisions.tolist() == expected
    assert len(set(expected)) > 1


@pytest.mark.parametrize("seed", range(6))
def test_the_simulated_sequential_design_is_the_walk_on_the_same_draws(seed: int) -> None:
    """The sizing's vectorised sequential design (closed-form capital at the margin) stops where
    ``sequential_decision`` stops on the same seeded differences, with the same verdict."""
    questions, flips, margin, alpha = 2500, 0.3, 0.05, 0.025
    true_diff = (-0.1, -0.05, 0.0)[seed % 3]
    out = simulate(Design("sequential", questions), flips, margin, alpha, true_diff, runs=1, seed=seed)
    rng = np.random.default_rng(seed)
    blocks = [
        draw_differences(rng, 1, min(1024, questions - b), flips, true_diff)
        for b in range(0, questions, 1024)
    ]
    walk = sequential_decision(np.concatenate(blocks, axis=1)[0], margin, alpha)
    assert (out.decisions[0], int(out.stops[0])) == (walk.decision, walk.stopped_at)


def test_the_public_decide_survives_its_module() -> None:
    """``flyspec.gate.stats.decide`` stays the function of the spec once its module, of the same name,
    is loaded (the import system would bind the module onto the package), in a fresh interpreter."""
    script = (
        "import flyspec.gate.stats.decide, flyspec.gate.stats as s; "
        "from flyspec.gate.stats import decide; "
        "assert s.decide is decide is sys.modules['flyspec.gate.stats.decide'].decide; "
        "print(decide(58, 14, 1, 0.02).decision)"
    )
    done = subprocess.run(
        [sys.executable, "-c", "import sys; " + script], capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "FAIL"
