"""Graders: turn a model's output and a reference answer into a deterministic right/wrong (SPEC 11.2).

- ``gsm8k``: the number after the last ``####``, else the last number in the output; commas, ``$`` and
  spaces are stripped and values compared as exact rationals (``18.00`` equals ``18``, ``3/4`` equals
  ``0.75``).
- ``math``: MATH and AIME answers, compared by ``math-verify`` (LaTeX aware: ``\\boxed{}`` with nested
  braces, fractions, intervals, ...). math-verify times out with SIGALRM, which only works in the main
  thread, so this grader refuses to run anywhere else instead of silently grading wrong.
- ``choice``: multiple choice by letter (``Answer: C``, ``\\boxed{C}``, ``(C)``).
- ``exact``: the whole output, whitespace-trimmed, equals the answer.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from fractions import Fraction

GRADERS = ("gsm8k", "math", "choice", "exact")

# A number as people write it: optional sign (not a hyphen inside "2-3"), optional $, thousands commas
# only in groups of three, decimals, and an optional "/denominator".
_NUMBER = re.compile(
    r"(?P<sign>(?<![\w.)\]}])-)?\s?(?:\$\s?(?P<sign2>-)?)?"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
    r"(?:\s?/\s?(?P<den>\d{1,3}(?:,\d{3})+|\d+)(?![\d.]))?"
)
_CHOICE_PATTERNS = (
    re.compile(r"answer\s*(?:is|:)?\s*[:*]*\s*\(?\s*\**([A-J])\b(?!')", re.IGNORECASE),
    re.compile(r"\\boxed\{\s*(?:\\text(?:bf)?\{)?\s*\(?([A-J])\b"),
    re.compile(r"\(([A-J])\)"),
    re.compile(r"^\s*\**\(?([A-J])[).:]?\**\s*$", re.MULTILINE),
)


@dataclass(frozen=True)
class Grade:
    """The answer extracted from an output (None when nothing was found) and whether it is right."""

    extracted: str | None
    correct: bool


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


_GRADE_FUNCTIONS = {"gsm8k": grade_gsm8k, "math": grade_math, "choice": grade_choice, "exact": grade_exact}


def check_grader(name: str) -> str:
    """Return ``name`` if it is a known grader, else raise ValueError listing the known ones."""
    if name not in _GRADE_FUNCTIONS:
        raise ValueError(f"grader={name!r}: must be one of {', '.join(GRADERS)}")
    return name


def check_reference(grader: str, answer: str) -> None:
    """Raise ValueError if ``answer`` cannot serve as a reference for ``grader`` (checked before a run,
    so that a bad reference stops the run before its first answer instead of in the middle)."""
    # Grading an empty output exercises exactly the reference parsing each grader does.
    grade(grader, "", answer)


def grade(grader: str, output: str, answer: str) -> Grade:
    """Grade ``output`` against ``answer`` with the named grader (deterministic)."""
    return _GRADE_FUNCTIONS[check_grader(grader)](output, answer)
