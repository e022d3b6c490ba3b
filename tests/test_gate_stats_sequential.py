"""The anytime-valid statistics: betting confidence sequence and sequential decision (docs/gate.md)."""

from __future__ import annotations

import numpy as np
import pytest

from flyspec.gate.stats import (
    ConfidenceSequence,
    confidence_sequence,
    sequential_decision,
    sequential_decisions,
)


def test_confidence_sequence_shape_range_and_monotone() -> None:
    """Bounds come one per observation, lie in [-1, 1], contain the running mean, and never widen."""
    rng = np.random.default_rng(1)
    diffs = rng.choice([-1, 0, 1], p=[0.1, 0.8, 0.1], size=600).tolist()
    low, high = confidence_sequence(diffs)
    assert len(low) == len(high) == len(diffs)
    assert all(-1 <= a <= b <= 1 for a, b in zip(low, high, strict=True))
    assert all(a <= b for a, b in zip(low, low[1:], strict=False))
    assert all(a >= b for a, b in zip(high, high[1:], strict=False))
    means = np.cumsum(diffs) / np.arange(1, len(diffs) + 1)
    assert all(a <= m <= b for a, m, b in zip(low, means, high, strict=True))


def test_online_object_matches_function() -> None:
    """ConfidenceSequence.update returns exactly what confidence_sequence returns at each step."""
    diffs = [0, -1, 0, 0, 1, -1, -1, 0, 0, 0] * 30
    low, high = confidence_sequence(diffs, alpha=0.1)
    cs = ConfidenceSequence(alpha=0.1)
    assert [cs.update(d) for d in diffs] == list(zip(low, high, strict=True))


def test_sequential_decision_stops_at_first_crossing() -> None:
    """A clear large loss FAILs early; the stop is the first n whose upper bound is below -margin."""
    diffs = ([-1] * 3 + [0] * 7) * 30
    result = sequential_decision(diffs, margin=0.02)
    low, high = confidence_sequence(diffs, alpha=0.05)
    first = next(i for i, h in enumerate(high) if h < -0.02)
    assert result.decision == "FAIL"
    assert result.stopped_at == first + 1
    assert (result.low, result.high) == (low[first], high[first])
    assert result.loss_detected


def test_sequential_decision_inconclusive_uses_all() -> None:
    """No crossing: INCONCLUSIVE at len(diffs), with the final bounds."""
    diffs = [0, 1, -1, 0] * 10
    result = sequential_decision(diffs, margin=0.02)
    assert result.decision == "INCONCLUSIVE"
    assert result.stopped_at == len(diffs)
    assert not result.loss_detected


def test_batch_equals_single() -> None:
    """sequential_decisions on a matrix gives, row by row, the numbers sequential_decision gives."""
    rng = np.random.default_rng(5)
    rows = rng.choice([-1, 0, 1], p=[0.25, 0.7, 0.05], size=(12, 400))
    decisions, stops, lows, highs = sequential_decisions(rows, margin=0.02)
    for i, row in enumerate(rows):
        single = sequential_decision(row.tolist(), margin=0.02)
        assert (single.decision, single.stopped_at) == (decisions[i], stops[i])
        assert (single.low, single.high) == pytest.approx((lows[i], highs[i]), abs=1e-12)


def test_without_replacement_closes_on_the_mean() -> None:
    """With population_size = N, the interval after all N questions is the exact mean."""
    rng = np.random.default_rng(2)
    diffs = rng.choice([-1, 0, 1], p=[0.2, 0.7, 0.1], size=300).tolist()
    low, high = confidence_sequence(diffs, population_size=300)
    assert low[-1] == pytest.approx(np.mean(diffs)) and high[-1] == pytest.approx(np.mean(diffs))


def test_bad_inputs_are_named() -> None:
    """A difference outside {-1, 0, 1}, a bad alpha or margin, or too many draws raise ValueError."""
    with pytest.raises(ValueError, match="diffs"):
        confidence_sequence([0, 2])
    with pytest.raises(ValueError, match="alpha"):
        confidence_sequence([0], alpha=1.5)
    with pytest.raises(ValueError, match="margin"):
        sequential_decision([0], margin=0.0)
    with pytest.raises(ValueError, match="population_size"):
        confidence_sequence([0, 0, 0], population_size=2)
    with pytest.raises(ValueError, match="d="):
        ConfidenceSequence().update(3)
