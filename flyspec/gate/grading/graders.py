"""Graders: turn a model's output and a reference answer into a deterministic right/wrong (docs/gate.md).

- ``gsm8k``: the number after the last ``####``, else the last number in the output; commas, ``$`` and
  spaces are stripped and values compared as exact rationals (``18.00`` equals ``18``, ``3/4`` equals
  ``0.75``).
- ``math``: MATH and AIME answers, compared by ``math-verify`` (LaTeX aware: ``\\boxed{}`` with nested
  braces, fractions, intervals, ...). math-verify times out with SIGALRM, which only works in the main
  thread, so this grader refuses to run anywhere else instead of silently grading wrong.
- ``choice``: multiple choice by letter (``Answer: C``, ``\\boxed{C}``, ``(C)``).
- ``exact``: the whole output, whitespace-trimmed, equals the answer.
- ``code``: the program in the output (``flyspec.gate.grading.code_grader``) is run with the reference's
  tests in a separate, limited process (``flyspec.gate.grading.code_exec``); right only if every test
  passes. A crash, timeout, memory error or ``sys.exit`` is wrong, never an error of the gate.
- ``judge``: open-ended answers, graded by a judge model that compares both arms' answers in both orders
  (``flyspec.gate.grading.judge``); like ``equivalent_to_baseline`` it grades a pair, never one answer.
- ``equivalent_to_baseline[:normaliser]``: for traffic with no reference. Not a per-answer grader: the
  candidate's output is right when it equals the baseline arm's output for the same question after the
  named normaliser (``NORMALISERS``), and the baseline is always right (``grade_equivalence``). This
  measures deviation from the baseline, which is not the same as loss: a deviating answer may be as good.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from flyspec.gate.grading.code_exec import SandboxLimits, isolation, run_tests
from flyspec.gate.grading.code_grader import CodeTask, build_run, extract_code

EQUIVALENCE = "equivalent_to_baseline"
JUDGE = "judge"
GRADERS = ("gsm8k", "math", "choice", "exact", "code", JUDGE, EQUIVALENCE)

# A number as people write it: optional sign (not a hyphen inside "2-3"), optional $, thousands commas
# only in groups of three, decimals, and an optional "/denominator".
_NUMBER = re.compile(
    r"(?P<sign>(?<![\w.)\]}])-)?\s?(?:\$\s?(?P<sign2>-)?)?"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
    r"(?:\s?/\s?(?P<den>\d{1,3}(?:,\d{3})+|\d+)(?!\.?\d))?"
)
_CHOICE_PATTERNS = (
    re.compile(r"answer\s*(?:is|:)?\s*[:*]*\s*\(?\s*\**([A-J])\b(?!')", re.IGNORECASE),
    re.compile(r"\\boxed\{\s*(?:\\text(?:bf)?\{)?\s*\(?([A-J])\b"),
    re.compile(r"\(([A-J])\)"),
    re.compile(r"^\s*\**\(?([A-J])[).:]?\**\s*$", re.MULTILINE),
)


@dataclass(frozen=True)
class Grade:
    """The answer extracted from an output (None when nothing was found), whether it is right, and for
    graders that can say more (``code``) a one-line reason such as ``timeout: no result within 20 s``."""

    extracted: str | None
    correct: bool
    detail: str | None = None


def _to_fraction(match: re.Match[str]) -> Fraction | None:
    num = Fraction(match.group("num").replace(",", ""))
    if match.group("den") is not None:
        den = Fraction(match.group("den").replace(",", ""))
        if den == 0:
            return None
        num /= den
    negative = (match.group("sign") is not None) != (match.group("sign2") is not None)
    return -num if negative else num


def _format_number(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{value.numerator}/{value.denominator}"


def parse_number(text: str, *, last: bool = True) -> Fraction | None:
    """The last (or first) number in ``text`` as an exact fraction, or None when there is none."""
    text = text.replace("\u2212", "-")  # the Unicode minus sign models sometimes emit
    matches = [m for m in _NUMBER.finditer(text) if _to_fraction(m) is not None]
    if not matches:
        return None
    return _to_fraction(matches[-1] if last else matches[0])


def extract_gsm8k(output: str) -> Fraction | None:
    """The final number of a GSM8K-style output: after the last ``####`` if present, else the last one."""
    if "####" in output:
        tail = output.rsplit("####", 1)[1]
        found = parse_number(tail, last=False)
        if found is not None:
            return found
    return parse_number(output)


def grade_gsm8k(output: str, answer: str) -> Grade:
    """GSM8K grading by exact numeric equality of the final number."""
    gold = extract_gsm8k(answer)
    if gold is None:
        raise ValueError(f"GSM8K reference answer {answer!r} contains no number")
    found = extract_gsm8k(output)
    if found is None:
        return Grade(None, False)
    return Grade(_format_number(found), found == gold)


def grade_math(output: str, answer: str) -> Grade:
    """MATH/AIME grading by math-verify: the reference is parsed as ``\\boxed{answer}``."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "the math grader must run in the main thread: math-verify's timeouts use SIGALRM "
            "(grade in the main thread or in a process pool, never in a thread)"
        )
    from math_verify import parse, verify

    gold = parse("\\boxed{" + answer + "}")
    if not gold:
        raise ValueError(f"math-verify cannot parse the reference answer {answer!r}")
    pred = parse(output)
    if not pred:
        return Grade(None, False)
    extracted = pred[-1] if isinstance(pred[-1], str) else str(pred[0])
    return Grade(extracted, bool(verify(gold, pred)))


def extract_choice(output: str) -> str | None:
    """The chosen letter: the last match of the strongest pattern that matches at all."""
    for pattern in _CHOICE_PATTERNS:
        found = pattern.findall(output)
        if found:
            return found[-1].upper()
    return None


def grade_choice(output: str, answer: str) -> Grade:
    """Multiple choice: the extracted letter equals the reference letter."""
    gold = answer.strip().strip("()").upper()
    if not re.fullmatch(r"[A-J]", gold):
        raise ValueError(f"multiple-choice reference answer {answer!r} is not a single letter A-J")
    letter = extract_choice(output)
    return Grade(letter, letter == gold)


def grade_exact(output: str, answer: str) -> Grade:
    """Exact string match after trimming surrounding whitespace."""
    text = output.strip()
    return Grade(text, text == answer.strip())


def grade_code(output: str, answer: str, limits: SandboxLimits | None = None) -> Grade:
    """Code by execution: the reference's tests must run to their end against the extracted program (in a
    sandbox whose verdict the program cannot forge)."""
    task = CodeTask.from_answer(answer)
    code = extract_code(output, task.entry_point)
    result = run_tests(build_run(code, task), limits)
    return Grade(code, result.passed, f"{result.status}: {result.detail}" if result.detail else result.status)


def sandbox_notes(graders: set[str]) -> dict[str, Any] | None:
    """For a run with code questions: the code sandbox this machine gives (flyspec/gate/grading/code_exec.py),
    with ``missing``, the protections it lacks in plain words; None without code questions."""
    if "code" not in graders:
        return None
    sandbox = isolation()
    return {
        "file_tree": sandbox.file_tree,
        "landlock_abi": sandbox.landlock,
        "pid_namespace": sandbox.pid_namespace,
        "network_namespace": sandbox.network_namespace,
        "program_uid": sandbox.uid,
        "harness_uid": sandbox.harness_uid,
        "missing": sandbox.missing,
    }


def _json_canonical(text: str) -> str | None:
    body = text.strip()
    fenced = re.fullmatch(r"```[\w-]*\s*\n(.*?)\n?```", body, re.DOTALL)
    if fenced:
        body = fenced.group(1)
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _last_number(text: str) -> str | None:
    value = parse_number(text.replace("−", "-"))
    return None if value is None else _format_number(value)


NORMALISERS: dict[str, Callable[[str], str | None]] = {
    "exact": lambda text: text,
    "strip": str.strip,
    "whitespace": lambda text: " ".join(text.split()),
    "lower": lambda text: " ".join(text.casefold().split()),
    "json": _json_canonical,
    "last_number": _last_number,
}
"""Normalisers of ``equivalent_to_baseline``: ``exact`` (byte-equal text), ``strip`` (ends trimmed),
``whitespace`` (every run of whitespace is one space, ends trimmed), ``lower`` (``whitespace`` and case
folded), ``json`` (the output, optionally in one markdown fence, parsed as JSON and re-serialised with
sorted keys and no spaces; ``1`` and ``1.0`` stay different), ``last_number`` (the last number, as the
``gsm8k`` grader reads numbers). ``None`` means the output has no such value."""


def equivalence_normaliser(grader: str) -> str | None:
    """The normaliser of an ``equivalent_to_baseline[:normaliser]`` grader name (``exact`` when none is
    named), or None when ``grader`` is another grader. ValueError for an unknown normaliser."""
    name, sep, normaliser = grader.partition(":")
    if name != EQUIVALENCE:
        return None
    normaliser = normaliser if sep else "exact"
    if normaliser not in NORMALISERS:
        raise ValueError(
            f"grader={grader!r}: unknown normaliser {normaliser!r}; use {EQUIVALENCE}[:NAME] with NAME one "
            f"of {', '.join(NORMALISERS)}"
        )
    return normaliser


def grade_equivalence(baseline_output: str, candidate_output: str, normaliser: str = "exact") -> bool:
    """True when the candidate's output equals the baseline's after ``normaliser`` (deterministic).

    When neither output has a value under the normaliser (e.g. neither is JSON), the two whitespace-trimmed
    texts are compared instead; when only one has a value, they differ. The baseline counts as right for
    every question, so a False here is a deviation from the baseline, not necessarily a worse answer.
    """
    if normaliser not in NORMALISERS:
        raise ValueError(f"normaliser={normaliser!r}: must be one of {', '.join(NORMALISERS)}")
    if not isinstance(baseline_output, str) or not isinstance(candidate_output, str):
        raise ValueError("grade_equivalence: both outputs must be strings")
    norm = NORMALISERS[normaliser]
    base, cand = norm(baseline_output), norm(candidate_output)
    if base is None and cand is None:
        return baseline_output.strip() == candidate_output.strip()
    return base == cand


def grade_against_baseline(grader: str, baseline_output: str, candidate_output: str) -> tuple[Grade, Grade]:
    """The two grades of one question under an ``equivalent_to_baseline[:normaliser]`` grader: the
    baseline's (always right) and the candidate's (right when equivalent), each with its normalised text
    as ``extracted``."""
    normaliser = equivalence_normaliser(check_grader(grader))
    if normaliser is None:
        raise ValueError(f"grader={grader!r}: not an {EQUIVALENCE} grader; grade each answer with grade()")
    same = grade_equivalence(baseline_output, candidate_output, normaliser)
    norm = NORMALISERS[normaliser]
    return (
        Grade(norm(baseline_output), True, "the baseline is the reference"),
        Grade(norm(candidate_output), same, "equivalent" if same else "deviates from the baseline"),
    )


def _grade_equivalence_alone(output: str, answer: str) -> Grade:
    raise ValueError(
        f"the {EQUIVALENCE} grader compares two arms' outputs: grade each pair with "
        "grade_against_baseline(grader, baseline_output, candidate_output), not with grade()"
    )


def _grade_judge_alone(output: str, answer: str) -> Grade:
    raise ValueError(
        f"the {JUDGE} grader compares two arms' answers with a judge model: a run with judge questions needs "
        "a judge (--judge), and grades each pair once both answers are in"
    )


_GRADE_FUNCTIONS: dict[str, Callable[[str, str], Grade]] = {
    "gsm8k": grade_gsm8k,
    "math": grade_math,
    "choice": grade_choice,
    "exact": grade_exact,
    "code": grade_code,
    JUDGE: _grade_judge_alone,
    EQUIVALENCE: _grade_equivalence_alone,
}


def check_grader(name: str) -> str:
    """Return the grader's canonical name (``equivalent_to_baseline`` gets its normaliser, e.g.
    ``equivalent_to_baseline:exact``), else raise ValueError listing the known ones."""
    if not isinstance(name, str):
        raise ValueError(f"grader={name!r}: must be a string, one of {', '.join(GRADERS)}")
    normaliser = equivalence_normaliser(name)
    if normaliser is not None:
        return f"{EQUIVALENCE}:{normaliser}"
    if name not in _GRADE_FUNCTIONS:
        raise ValueError(
            f"grader={name!r}: must be one of {', '.join(GRADERS[:-1])} or {EQUIVALENCE}[:normaliser]"
        )
    return name


def check_reference(grader: str, answer: str) -> None:
    """Raise ValueError if ``answer`` cannot serve as a reference for ``grader`` (checked before a run,
    so that a bad reference stops the run before its first answer instead of in the middle)."""
    grader = check_grader(grader)
    if grader == JUDGE:
        return  # any text, or none: the judge sees it as a reference answer when there is one
    if grader == "code":
        CodeTask.from_answer(answer)
    elif equivalence_normaliser(grader) is not None:
        if answer:
            raise ValueError(f"{grader} compares with the baseline's output; the answer must be empty")
    else:
        # Grading an empty output exercises exactly the reference parsing each grader does.
        grade(grader, "", answer)


def grade(grader: str, output: str, answer: str) -> Grade:
    """Grade ``output`` against ``answer`` with the named grader (deterministic)."""
    name = check_grader(grader).partition(":")[0]
    return _GRADE_FUNCTIONS[name](output, answer)
