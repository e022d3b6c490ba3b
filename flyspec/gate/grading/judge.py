"""Open-ended answers graded by a judge model comparing the two arms' answers, in both orders.

A question with grader ``judge`` has no reference that a program could check (a summary, a chat reply):
the run's ``judge`` setting names an OpenAI-compatible endpoint and model (a larger model on a vLLM
server, or ``flyspec serve``) that is shown the request and BOTH arms' answers and asked which is
better. Every question is judged twice, with the answers' positions swapped (``AB``: the baseline's
answer shown as A; ``BA``: shown as B), because judges favour a position. The two verdicts give:

- both orders prefer the baseline: "baseline better", counted as **lost** (baseline right, candidate
  wrong);
- both orders prefer the candidate: "candidate better", counted as **gained**;
- both orders say tie, or the two answers are identical (the judge is not asked): a **tie**;
- anything else (the orders disagree: each preferred the answer in one position, or one said tie and the
  other did not; or a verdict could not be read): **undecided**.

These verdicts are predictions, not the truth: a coin agrees with itself on the wrong winner a quarter of
the time, so no rule over verdicts alone is valid for every judge. A judged run therefore decides on gold
labels for a random subset of its pairs, with the verdicts as predictions (prediction-powered inference:
flyspec/gate/stats/judged.py); from each pair the statistics read the judge's prediction, the mean of its
two orders' votes (+1 candidate, -1 baseline, 0 tie or unreadable).

The judge is asked for a final line ``Verdict: A``, ``Verdict: B`` or ``Verdict: tie``; the last such line
counts (``[[A]]``, and a last line holding only the choice, are read too).
The prompt template (named and versioned; its text and sha256 are registered), the judge model and its
sampling (temperature 0, ``max_tokens``, ``seed``) are part of the run's registration. The endpoint that
is asked (its settings and client) is flyspec/gate/arms/judge.py.
"""

from __future__ import annotations

import hashlib
import re

POSITIONS = ("AB", "BA")
OUTCOMES = ("first", "second", "tie", "identical", "disagree", "unreadable")
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
