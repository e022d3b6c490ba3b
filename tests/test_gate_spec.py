"""The gate's records and their one codec (flyspec/gate/data/spec.py): every
record written and read back is itself, each older stored layout reads with its meaning, and a stored
record missing a key it needs is refused by name."""

from __future__ import annotations

import pytest

from flyspec.gate.data.spec import (
    BASELINE,
    CalibrationRecord,
    ComparisonPlan,
    DatasetEntry,
    Excluded,
    Extension,
    Family,
    Gold,
    JudgeRecord,
    QuestionOrder,
    Registration,
    SamplingRecord,
    SettingRecord,
    TuneRecord,
    from_json,
    plan_json,
    to_json,
)
from flyspec.gate.data.spec import (
    TestOrder as SettingOrder,  # not Test*: pytest would collect it
)
from flyspec.gate.data.store import keeping_bets
from flyspec.gate.stats.monitor import JUDGED_METHOD, SequentialPlan

SEQUENTIAL = SequentialPlan(0.02, 0.025, 100, 100, 3)
SHARED = {
    "margin": 0.02,
    "alpha": 0.025,
    "seed": 1,
    "sampling": SamplingRecord(0.0, 1.0, 64),
    "arms": {"baseline": {"kind": "engine"}, "candidate": {"kind": "engine"}},
    "shuffle_seed": 5,
    "alpha_budget": 0.05,
    "datasets": {"gsm8k": DatasetEntry("abc", 10, 1319)},
    "excluded": Excluded(("pilot",), 8),
}
GATE = Registration(
    "gate",
    **SHARED,
    repeats=(0,),
    limit=10,
    max_questions=100,
    order=QuestionOrder(3, "sha256", 1319),
    design="sequential",
    sequential=SEQUENTIAL,
    listed=(
        ComparisonPlan("candidate", BASELINE, ("candidate", 0), 0.02, 0.0125, "candidate", SEQUENTIAL),
        ComparisonPlan("control", BASELINE, ("control", 0), 0.02, 0.0125, "control", SEQUENTIAL),
    ),
    family=Family(0.025, "Bonferroni"),
    carries="fixed",
    judge=JudgeRecord("j", 32, 0, "pairwise", "sha", "text", ("AB", "BA"), "rule", {"id": "j"}, 0.0),
    gold=Gold(0.2, 0, "human"),
    extensions=(Extension(100, 200, 1.5),),
)
SETTINGS = (SettingRecord("s1", "W=2", {"method": "draft_model"}),)
ORDER = SettingOrder("speed", ("s1",), "tokens_per_s", "ascending", "t/calibration", {"s1": 10.0})
TUNE = Registration(
    "tune",
    **SHARED,
    max_questions=50,
    order=QuestionOrder(3, "sha256", 1319),
    design="fixed",
    settings=SETTINGS,
    tune=TuneRecord("fixed sequence", ORDER, "t/calibration", (("gsm8k", "q1"),), 40),
)
CALIBRATION = Registration("calibration", **SHARED, settings=SETTINGS, calibration=CalibrationRecord(5, "t"))
PILOT = Registration(
    "pilot", **SHARED, repeats=(0, 1), order=QuestionOrder(3, "r", 9), design="fixed", pilot_mode="noise"
)


@pytest.mark.parametrize("registration", [GATE, TUNE, CALIBRATION, PILOT], ids=lambda r: r.kind)
def test_every_kind_reads_back_as_written(registration: Registration) -> None:
    """A registration of each kind, written and read again, is itself, and writes the same JSON again."""
    stored = registration.to_dict()
    again = Registration.read(registration.kind, stored)
    assert again == registration
    assert again.to_dict() == stored


def test_the_stored_layout_keeps_its_keys() -> None:
    """The layout other code and users read: renamed keys (``all``, ``from``, ``comparisons``), the judge's
    sampling nested, the tune's own keys beside the shared ones, absent optional parts written as no key."""
    gate = GATE.to_dict()
    assert gate["gold"] == {"rate": 0.2, "seed": 0, "source": "human", "all": False, "draw": 2, "bet": 2}
    assert gate["extensions"] == [{"from": 100, "to": 200, "at": 1.5}]
    assert gate["comparisons"][1] == {
        "name": "control",
        "candidate": "control",
        "margin": 0.02,
        "alpha": 0.0125,
        "role": "control",
        "sequential": plan_json(SEQUENTIAL),
    }
    assert gate["judge"]["sampling"] == {"temperature": 0.0, "max_tokens": 32, "seed": 0}
    assert gate["judge"]["kind"] == "openai" and "settings" not in gate and "pilot" not in gate
    tune = TUNE.to_dict()
    assert tune["question_order"] == {"seed": 3, "rule": "sha256", "pool": 1319}
    assert tune["order"]["method"] == "speed" and "fallback" not in tune["order"]
    assert tune["calibration"] == {"run": "t/calibration", "questions": [["gsm8k", "q1"]]}
    assert "repeats" not in tune and "comparisons" not in tune
    assert "design" not in CALIBRATION.to_dict() and PILOT.to_dict()["pilot"] == {"mode": "noise"}
    bare = Registration("gate", 0.02, 0.025).to_dict()
    assert not {"alpha_budget", "excluded", "sequential", "judge", "gold", "family", "carries"} & set(bare)


# Layouts older flyspec versions stored, each with what it means now.
OLDER = {
    "a pilot before its mode": ("pilot", {}, lambda r: r.pilot_mode == "noise" and r.design == "fixed"),
    "a family before its alpha": (
        "gate",
        {"family": {"procedure": "Bonferroni"}},
        lambda r: r.family == Family(0.025, "Bonferroni"),
    ),
    "datasets before their entries": (
        "gate",
        {"datasets": {"gsm8k": "abc"}},
        lambda r: r.datasets["gsm8k"] == DatasetEntry(None),
    ),
    "an order before its rule": ("gate", {"order": {"seed": 3}}, lambda r: r.order is None),
    "a setting before its label": (
        "calibration",
        {"settings": [{"id": "s1", "speculative_config": {}}]},
        lambda r: r.settings == (SettingRecord("s1", "s1", {}),),
    ),
    "a gold rule before its bets": (
        "gate",
        {
            "gold": {"rate": 0.2, "seed": 0, "source": "human", "draw": 2},
            "sequential": {**plan_json(SEQUENTIAL), "method_key": "ppi-mixture", "label_rate": 0.2},
        },
        lambda r: r.gold.bet == 1 and r.sequential.label_bet == 1,
    ),
    "a sequential run before its design": (
        "gate",
        {"sequential": {k: v for k, v in plan_json(SEQUENTIAL).items() if k != "population"}},
        lambda r: r.design == "sequential" and r.sequential.population == "finite",
    ),
}


@pytest.mark.parametrize("layout", list(OLDER))
def test_each_older_layout_reads_with_its_meaning(layout: str) -> None:
    kind, stored, means = OLDER[layout]
    assert means(Registration.read(kind, {"margin": 0.02, "alpha": 0.025, **stored}))


def test_a_record_missing_a_key_it_needs_is_refused_by_name() -> None:
    assert from_json(Extension, to_json(Extension(1, 2, 3.0))) == Extension(1, 2, 3.0)
    with pytest.raises(ValueError, match="needs the key 'from'"):
        from_json(Extension, {"to": 2, "at": 3.0})
    with pytest.raises(ValueError, match="gold-label draw 7"):
        from_json(Gold, {"rate": 0.2, "seed": 0, "source": "human", "draw": 7})
    with pytest.raises(ValueError, match="bet=3"):
        from_json(Gold, {"rate": 0.2, "seed": 0, "source": "human", "draw": 2, "bet": 3})
    with pytest.raises(ValueError, match="run kind 'other'"):
        Registration.read("other", {"margin": 0.02, "alpha": 0.025})


def test_a_resumed_judged_run_keeps_the_bets_it_registered() -> None:
    """The same command resumes a judged run registered under bets version 1: the new registration takes
    the stored run's version (gold rule and every judged sequential plan), so the store sees no change; a
    new run, or one whose stored run has no judge, keeps what it asked for."""
    judged = SequentialPlan(0.02, 0.025, 100, 100, 3, method=JUDGED_METHOD, label_rate=0.2, label_bet=2)
    new = Registration(
        "gate",
        0.02,
        0.025,
        design="sequential",
        sequential=judged,
        listed=(ComparisonPlan("candidate", BASELINE, ("candidate", 0), 0.02, 0.025, "candidate", judged),),
        gold=Gold(0.2, 0, "human"),
    )
    assert new.gold is not None and new.gold.bet == 2
    old = Registration.read(
        "gate", {**new.to_dict(), "gold": {"rate": 0.2, "seed": 0, "source": "human", "draw": 2}}
    )
    old = Registration.read("gate", {**old.to_dict(), "sequential": {**plan_json(judged), "label_bet": 1}})
    kept = keeping_bets(new, old)
    assert kept.gold is not None and kept.gold.bet == 1
    assert kept.sequential is not None and kept.sequential.label_bet == 1
    assert kept.listed[0].sequential is not None and kept.listed[0].sequential.label_bet == 1
    assert kept.to_dict()["gold"] == {"rate": 0.2, "seed": 0, "source": "human", "all": False, "draw": 2}
    assert keeping_bets(new, None) == new
    assert keeping_bets(new, Registration("gate", 0.02, 0.025)) == new
