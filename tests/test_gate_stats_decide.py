"""The decision rule on fixed-size runs, sample-size planning, and fixed-sequence testing
(docs/statistics.md); the rule lives in flyspec/gate/stats/decide.py only, and the simulations' vectorised
rule is pinned to it.

The simulations behind these rules are in tests/test_gate_stats_validity.py.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import binom

from flyspec.gate.data.spec import Registration, SamplingRecord
from flyspec.gate.data.store import AnswerRecord, GateStore, RegisteredQuestion
from flyspec.gate.report.build import build_report
from flyspec.gate.stats import (
    decide,
    mcnemar,
    net_difference_ci,
    questions_needed_noninferiority,
    sequential_decision,
)
from flyspec.gate.stats.decide import Evidence, Rule, fixed_sequence
from flyspec.gate.stats.monitor import SequentialPlan
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


def _report_depths(tmp_path: Path, registration: Registration, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Build the report of a run of 40 questions (every baseline answer right, the candidate wrong on 12)
    and return how many calls below ``build_report`` each ``classify`` made by ``Rule.decide`` was."""
    questions = [RegisteredQuestion("ds", f"q{i}", i, f"h{i}", "1", "exact") for i in range(40)]
    with GateStore(tmp_path / "s.sqlite") as store:
        store.register("r", registration, questions)
        for i, arm in ((i, arm) for i in range(40) for arm in ("baseline", "candidate")):
            right = arm == "baseline" or i % 10 > 2
            store.add_answer(
                "r",
                AnswerRecord(arm, 0, "ds", f"q{i}", 7, "x", "1", right, "stop", 1, 1, 0.1, 1, 1, 1, 1, "e"),
            )
    depths: list[int] = []
    rule_module = importlib.import_module("flyspec.gate.stats.decide")
    rule = rule_module.classify

    def watched(*args: object) -> object:
        stack = [frame.function for frame in inspect.stack()[1:]]
        if stack[0] == "decide" and "build_report" in stack:
            depths.append(stack.index("build_report") + 1)
        return rule(*args)

    monkeypatch.setattr(rule_module, "classify", watched)
    build_report(tmp_path / "s.sqlite", "r")
    return depths


@pytest.mark.parametrize("design", ["fixed", "sequential"])
def test_a_report_reaches_the_rule_in_three_calls(
    tmp_path: Path, design: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "Which line decided my run?": ``flyspec gate run`` calls ``build_report``, which reaches the rule in
    three calls (``_build`` -> ``Rule.decide`` -> ``classify``) for a fixed and a sequential run alike, so
    from the command to ``classify`` is four (a dataset's row of a fixed run is decided further down, by
    the same ``Rule.decide``). Fails if a layer is put back between them."""
    arms = {"baseline": {"kind": "engine", "model": "a"}, "candidate": {"kind": "engine", "model": "b"}}
    plan = SequentialPlan(0.05, 0.025, 40, 40, 0) if design == "sequential" else None
    registration = Registration(
        "gate",
        margin=0.05,
        alpha=0.025,
        seed=0,
        arms=arms,
        sampling=SamplingRecord(temperature=0.0),
        design=design,
        sequential=plan,
    )
    depths = _report_depths(tmp_path, registration, monkeypatch)
    assert depths and min(depths) == 3


def test_a_fixed_rule_decides_only_at_its_registered_size() -> None:
    """A fixed comparison of 300 questions with 200 pairs in hand: INCONCLUSIVE (not final), on the same
    interval that the rule at 200 questions decides on; with all 300 in, the spec's ``decide`` on the
    counts, and final."""
    diffs = [-1] * 40 + [1] * 5 + [0] * 255
    partial = Rule(0.02, 0.025, 300).decide(Evidence(diffs[:200]))
    at_hand = Rule(0.02, 0.025, 200).decide(Evidence(diffs[:200]))
    assert at_hand.decision == "FAIL" and at_hand.final
    assert (partial.decision, partial.reason, partial.final) == ("INCONCLUSIVE", "in_progress", False)
    assert (partial.low, partial.high, partial.stopped_at) == (at_hand.low, at_hand.high, 200)
    whole = Rule(0.02, 0.025, 300).decide(Evidence(diffs))
    expected = decide(300, 40, 5, 0.02)
    assert (whole.decision, whole.low, whole.high, whole.reason) == (
        expected.decision,
        expected.low,
        expected.high,
        "complete",
    )


def test_a_sequential_rule_stops_at_a_pause_or_its_most_questions() -> None:
    """Pairs completed past a sequential comparison's most questions are never walked (a crossing there
    would be a look the plan did not register), and a pause recorded last holds the decision where the
    run was; with neither, the first crossing decides."""
    diffs = [0, 1] * 10 + [-1] * 400
    rule = Rule(0.05, 0.025, 20, sequential=True)
    capped = rule.decide(Evidence(diffs))
    assert (capped.decision, capped.reason, capped.stopped_at) == ("INCONCLUSIVE", "max_questions", 20)
    crossed = replace(rule, size=len(diffs)).decide(Evidence(diffs))
    assert (crossed.decision, crossed.reason) == ("FAIL", "boundary") and 20 < crossed.stopped_at < 420

    @dataclasses.dataclass
    class Stop:
        event: str = "stop"
        reason: str | None = "time_budget"
        stopped_at: int | None = 30

    paused = replace(rule, size=len(diffs)).decide(Evidence(diffs, [Stop()]))
    assert (paused.decision, paused.reason, paused.stopped_at, paused.final) == (
        "INCONCLUSIVE",
        "time_budget",
        30,
        False,
    )
