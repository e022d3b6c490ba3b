"""Graders: a model's output and a reference answer to a deterministic right or wrong (docs/gate.md, "Gate
your own traffic"), registered as ``Grader`` records; and the judge's rule for open-ended answers."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from flyspec.gate.grading.code_exec import CodeTask, build_run, extract_code, isolation, run_tests

EQUIVALENCE = "equivalent_to_baseline"
JUDGE = "judge"

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
    values = [v for m in _NUMBER.finditer(text) if (v := _to_fraction(m)) is not None]
    return (values[-1] if last else values[0]) if values else None


def extract_gsm8k(output: str) -> Fraction | None:
    """The final number of a GSM8K-style output: after the last ``####`` if present, else the last one."""
    if "####" in output:
        tail = output.rsplit("####", 1)[1]
        found = parse_number(tail, last=False)
        if found is not None:
            return found
    return parse_number(output)


def grade_gsm8k(output: str, answer: str) -> Grade:
    """GSM8K: the final number equals the reference's as an exact rational (``18.00`` is ``18``, ``3/4`` is
    ``0.75``); commas, ``$`` and spaces are ignored."""
    gold = extract_gsm8k(answer)
    if gold is None:
        raise ValueError(f"GSM8K reference answer {answer!r} contains no number")
    found = extract_gsm8k(output)
    if found is None:
        return Grade(None, False)
    return Grade(_format_number(found), found == gold)


def grade_math(output: str, answer: str) -> Grade:
    """MATH/AIME by math-verify (LaTeX aware), the reference parsed as ``\\boxed{answer}``; main thread only,
    since math-verify's timeouts use SIGALRM."""
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
    """Multiple choice: the extracted letter (``Answer: C``, ``\\boxed{C}``, ``(C)``) equals the reference."""
    gold = answer.strip().strip("()").upper()
    if not re.fullmatch(r"[A-J]", gold):
        raise ValueError(f"multiple-choice reference answer {answer!r} is not a single letter A-J")
    letter = extract_choice(output)
    return Grade(letter, letter == gold)


def grade_exact(output: str, answer: str) -> Grade:
    """Exact string match after trimming surrounding whitespace."""
    text = output.strip()
    return Grade(text, text == answer.strip())


def grade_code(output: str, answer: str) -> Grade:
    """Code by execution: the reference's tests must run to their end against the extracted program (in a
    sandbox whose verdict the program cannot forge)."""
    task = CodeTask.from_answer(answer)
    code = extract_code(output, task.entry_point)
    result = run_tests(build_run(code, task))
    return Grade(code, result.passed, f"{result.status}: {result.detail}" if result.detail else result.status)


def sandbox_notes(graders: set[str]) -> dict[str, object] | None:
    """The code sandbox this machine gives, with ``missing``, the protections it lacks in plain words; None
    when none of ``graders`` runs code."""
    if not any(grader_named(name)[0].sandboxed for name in graders):
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
    value = parse_number(text)
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
    """The two grades of one question under a pairwise grader such as ``equivalent_to_baseline``: the
    first lane's (the reference) and the second's against it."""
    found, argument = grader_named(grader)
    if found.grade_pair is None:
        raise ValueError(f"grader={grader!r}: not a pairwise grader; grade each answer with grade()")
    return found.grade_pair(baseline_output, candidate_output, argument or "")


@dataclass(frozen=True)
class Grader:
    """A grader as the gate knows it, registered once (``register_grader``); callers ask the record what
    the grader needs, never its name (docs/architecture.md, "A grader"). ``check`` refuses a reference the
    grader cannot use (by default: grading an empty output with it)."""

    name: str
    grade: Callable[[str, str], Grade] | None = None
    grade_pair: Callable[[str, str, str], tuple[Grade, Grade]] | None = None
    reference: str = "required"
    check: Callable[[str], object] | None = None
    argument: tuple[str, ...] | None = None
    model_graded: bool = False
    sandboxed: bool = False
    parse_reference: Callable[[object], str] | None = None

    @property
    def pairwise(self) -> bool:
        return self.grade_pair is not None or self.model_graded


def _check_no_reference(answer: str) -> None:
    if answer:
        raise ValueError(f"{EQUIVALENCE} compares with the baseline's output; the answer must be empty")


def _grade_against(first: str, second: str, normaliser: str) -> tuple[Grade, Grade]:
    same = grade_equivalence(first, second, normaliser)
    norm = NORMALISERS[normaliser]
    return (
        Grade(norm(first), True, "the baseline is the reference"),
        Grade(norm(second), same, "equivalent" if same else "deviates from the baseline"),
    )


_REGISTRY: dict[str, Grader] = {}


def register_grader(grader: Grader) -> Grader:
    """Register ``grader`` under its name (ValueError for a name taken by another grader)."""
    known = _REGISTRY.get(grader.name)
    if known is not None and known != grader:
        raise ValueError(f"grader {grader.name!r} is registered already")
    _REGISTRY[grader.name] = grader
    return grader


for _grader in (
    Grader("gsm8k", grade_gsm8k),
    Grader("math", grade_math),
    Grader("choice", grade_choice),
    Grader("exact", grade_exact),
    Grader("code", grade_code, check=CodeTask.from_answer, sandboxed=True,
           parse_reference=lambda answer: CodeTask.from_answer(answer).to_answer()),
    Grader(JUDGE, reference="optional", check=lambda answer: None, model_graded=True),
    Grader(EQUIVALENCE, grade_pair=_grade_against, reference="none", check=_check_no_reference,
           argument=tuple(NORMALISERS)),
):  # fmt: skip
    register_grader(_grader)


def graders() -> tuple[str, ...]:
    """The registered graders' names."""
    return tuple(_REGISTRY)


def model_graded(name: str) -> bool:
    """Whether the named grader asks a model (the run's judge) rather than a program."""
    return grader_named(name)[0].model_graded


def model_graded_names() -> tuple[str, ...]:
    """The registered model-graded graders' names (for messages that list them)."""
    return tuple(name for name, grader in _REGISTRY.items() if grader.model_graded)


def grader_named(name: str) -> tuple[Grader, str | None]:
    """The grader a (canonical or short) name asks for and its argument (``equivalent_to_baseline:json`` ->
    its grader and ``json``; the default argument when none is named); ValueError listing the known ones."""
    if not isinstance(name, str):
        raise ValueError(f"grader={name!r}: must be a string, one of {', '.join(graders())}")
    base, sep, argument = name.partition(":")
    grader = _REGISTRY.get(base)
    if grader is None:
        names = [g if _REGISTRY[g].argument is None else f"{g}[:argument]" for g in graders()]
        raise ValueError(f"grader={name!r}: must be one of {', '.join(names)}")
    if grader.argument is None:
        if sep:
            raise ValueError(f"grader={name!r}: {base} takes no argument after ':'")
        return grader, None
    argument = argument if sep else grader.argument[0]
    if argument not in grader.argument:
        raise ValueError(
            f"grader={name!r}: unknown normaliser {argument!r}; use {base}[:NAME] with NAME one of "
            f"{', '.join(grader.argument)}"
        )
    return grader, argument


def check_grader(name: str) -> str:
    """Return the grader's canonical name (one with an argument gets it, e.g.
    ``equivalent_to_baseline:exact``), else raise ValueError listing the known ones."""
    grader, argument = grader_named(name)
    return grader.name if argument is None else f"{grader.name}:{argument}"


def check_reference(grader: str, answer: str) -> None:
    """Raise ValueError if ``answer`` cannot serve as a reference for ``grader`` (checked before a run,
    so that a bad reference stops the run before its first answer instead of in the middle)."""
    found = grader_named(grader)[0]
    if found.check is not None:
        found.check(answer)
    elif found.grade is not None:
        # Grading an empty output exercises exactly the grader's reading of references.
        found.grade("", answer)


def grade(grader: str, output: str, answer: str) -> Grade:
    """Grade ``output`` against ``answer`` with the named one-answer grader (deterministic)."""
    found, _ = grader_named(grader)
    if found.grade is None:
        how = "a judge (--judge)" if found.model_graded else "grade_against_baseline(grader, first, second)"
        raise ValueError(f"the {found.name} grader grades a pair of answers, not one: use {how}")
    return found.grade(output, answer)


# ---------------------------------------------------------------------------- the judge's rule
# The judge is shown the request and both answers twice, the baseline's as A (``AB``) and as B (``BA``),
# because judges favour a position; the verdicts are predictions that gold labels check
# (flyspec/gate/stats/judged.py). Its endpoint and client are flyspec/gate/arms/judge.py.

POSITIONS = ("AB", "BA")
UNDECIDED = ("disagree", "unreadable")
RULE = (
    "lost: both orders prefer the baseline; gained: both prefer the candidate; tie: both say tie, or the "
    "answers are identical; otherwise undecided. The decision rests on gold labels for a random subset of "
    "the pairs, with the verdicts as predictions (prediction-powered inference)"
)

TEMPLATES = {
    "pairwise-v1": (
        "You are judging two responses to the same request. Decide which response is better: more correct, "
        "more complete and more useful for what was asked. The order of the responses says nothing about "
        "their quality, and a longer response is not better for being longer. If they are equally good or "
        "equally bad, the verdict is a tie.\n\n"
        "[Request]\n{request}\n{reference}\n"
        "[Response A]\n{response_a}\n\n"
        "[Response B]\n{response_b}\n\n"
        "Explain your reasoning in at most three sentences. Then write the final line exactly as one of:\n"
        "Verdict: A\nVerdict: B\nVerdict: tie"
    ),
}
DEFAULT_TEMPLATE = "pairwise-v1"
REFERENCE_BLOCK = "\n[Reference answer, which may be incomplete]\n{reference}\n"

_VERDICT_LINE = re.compile(r"verdict(?:\s+is)?\s*[:=]?\s*[\s*_\[(\"'`]*(A|B|tie)\b", re.IGNORECASE)
_BRACKETS = re.compile(r"\[\[\s*(A|B|tie)\s*\]\]", re.IGNORECASE)
# A last line that is only the choice, possibly as "Answer: B" or "The answer is B." (small judges).
_LAST_LINE = re.compile(
    r"^(?:(?:the\s+)?(?:final\s+)?answer(?:\s+is)?\s*[:=]?\s*)?[*_(\[\"']*(A|B|tie)[*_)\]\"']*\.?$",
    re.IGNORECASE,
)


def parse_verdict(text: str) -> str | None:
    """``A``, ``B`` or ``tie`` from the judge's output: the last ``Verdict: X`` (markdown emphasis and
    brackets allowed), else the last ``[[X]]``, else a last line that is only the choice (``B``,
    ``Answer: B``, ``The answer is B.``); None when there is none of these."""
    found = _VERDICT_LINE.findall(text) or _BRACKETS.findall(text)
    if not found:
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        match = _LAST_LINE.match(lines[-1]) if lines else None
        found = [match.group(1)] if match else []
    if not found:
        return None
    value = found[-1]
    return "tie" if value.lower() == "tie" else value.upper()


def preferred(position: str, verdict: str | None) -> str:
    """Which lane a verdict prefers: ``first`` (the baseline), ``second`` (the candidate), ``tie``, or
    ``unreadable`` (no verdict could be read)."""
    if verdict is None:
        return "unreadable"
    if verdict not in ("A", "B"):
        return "tie"
    first_is_a = position == "AB"
    return "first" if (verdict == "A") == first_is_a else "second"


def outcome(first: str, second: str) -> str:
    """The question's outcome from the preferences of the two orders: ``first`` (both prefer the baseline:
    lost), ``second`` (both prefer the candidate: gained), ``tie`` (both say tie), ``unreadable`` (a
    verdict could not be read) or ``disagree`` (the orders said different things: the position, not the
    answer, decided at least one of them). The last two are undecided (``UNDECIDED``)."""
    if "unreadable" in (first, second):
        return "unreadable"
    return first if first == second else "disagree"


def pair_hash(first_output: str, second_output: str) -> str:
    """sha256 of the two outputs judged (a stored judgement is reused only for exactly these)."""
    return hashlib.sha256(f"{len(first_output)}:{first_output}{second_output}".encode()).hexdigest()


def judge_prompt(template: str, request: str, reference: str, response_a: str, response_b: str) -> str:
    """The judge's prompt for one position: the template filled with the request, the reference block (when
    the question has a reference answer) and the two responses in this position's order."""
    block = REFERENCE_BLOCK.format(reference=reference) if reference else ""
    return TEMPLATES[template].format(
        request=request, reference=block, response_a=response_a, response_b=response_b
    )


def lane_label(lane: tuple[str, int]) -> str:
    """How a lane is named in the judgements table (``baseline#0``)."""
    return f"{lane[0]}#{lane[1]}"
