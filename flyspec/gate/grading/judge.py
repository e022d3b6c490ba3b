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
  other did not; or a verdict could not be read): **undecided**. An undecided pair counts against the
  claim being tested: as lost when the gate tests for PASS, as gained when it tests for FAIL
  (``stats.decide_with_undecided``). A judge that cannot tell the answers apart (always "A", a coin) then
  produces no FAIL, and a PASS only when the answers differ so rarely that even counting every
  difference as a loss stays within the margin.

These are the lost / gained / concordant counts of the paired tests plus the undecided count, so the same
statistics and decision rules apply; what "lost" means changes, and the report says so.

The judge is asked for a final line ``Verdict: A``, ``Verdict: B`` or ``Verdict: tie``; the last such line
counts (``[[A]]``, and a last line holding only the choice, are read too).
The prompt template (named and versioned; its text and sha256 are registered), the judge model and its
sampling (temperature 0, ``max_tokens``, ``seed``) are part of the run's registration.
"""

from __future__ import annotations

import hashlib
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from flyspec.gate.arms.base import OpenAIArm, load_arm_spec, parse_arm
from flyspec.gate.arms.endpoint import EndpointError, retry_reason
from flyspec.gate.data.datasets import Question

JUDGE = "judge"
POSITIONS = ("AB", "BA")
OUTCOMES = ("first", "second", "tie", "identical", "disagree", "unreadable")
UNDECIDED = ("disagree", "unreadable")
RULE = (
    "lost: both orders prefer the baseline; gained: both prefer the candidate; tie: both say tie, or the "
    "answers are identical; otherwise undecided, counted as lost when testing for PASS and as gained when "
    "testing for FAIL"
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

_JUDGE_KEYS = (
    "kind",
    "base_url",
    "base_urls",
    "model",
    "api_key",
    "max_tokens",
    "seed",
    "template",
    "concurrency",
    "timeout",
    "max_retries",
    "backoff",
)
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


def request_text(question: Question) -> str:
    """What was asked, as the judge sees it: the prompt, or the chat's turns (one user turn as is)."""
    if question.prompt is not None:
        return question.prompt
    messages = question.messages or []
    if len(messages) == 1:
        return messages[0]["content"]
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages)


@dataclass(frozen=True)
class Judge:
    """The judge endpoint, model, sampling and prompt template of a run."""

    endpoint: OpenAIArm
    max_tokens: int = 512
    seed: int = 0
    template: str = DEFAULT_TEMPLATE

    @property
    def template_text(self) -> str:
        return TEMPLATES[self.template]

    def prompt(self, question: Question, response_a: str, response_b: str) -> str:
        """The judge's prompt for one position."""
        reference = REFERENCE_BLOCK.format(reference=question.answer) if question.answer else ""
        return self.template_text.format(
            request=request_text(question), reference=reference, response_a=response_a, response_b=response_b
        )

    def identity(self, served: dict[str, Any] | None) -> dict[str, Any]:
        """What the registration records: model, served model, sampling and the template (name, sha256,
        text)."""
        out: dict[str, Any] = {
            "kind": "openai",
            "model": self.endpoint.model,
            "sampling": {"temperature": 0.0, "max_tokens": self.max_tokens, "seed": self.seed},
            "template": self.template,
            "template_sha256": hashlib.sha256(self.template_text.encode()).hexdigest(),
            "template_text": self.template_text,
            "positions": list(POSITIONS),
            "rule": RULE,
        }
        if served is not None:
            out["served_model"] = served
        return out

    def public_dict(self) -> dict[str, Any]:
        """The judge's settings for the run's notes (the API key only as whether one is set)."""
        return {**self.endpoint.public_dict(), "max_tokens": self.max_tokens, "seed": self.seed}


def parse_judge(spec: dict[str, Any] | str | Any) -> Judge:
    """A judge given as a dict, a JSON object string or a JSON file: ``{"base_url" | "base_urls", "model",
    "api_key", "max_tokens", "seed", "template", "concurrency", "timeout", "max_retries", "backoff"}``."""
    data = load_arm_spec(spec, JUDGE)
    unknown = sorted(set(data) - set(_JUDGE_KEYS))
    if unknown:
        raise ValueError(
            f"judge: unknown key(s) {', '.join(unknown)}; a judge takes {', '.join(_JUDGE_KEYS)}"
        )
    if data.get("kind", "openai") != "openai":
        raise ValueError(f"judge: kind={data['kind']!r}: a judge is an OpenAI-compatible endpoint ('openai')")
    max_tokens = data.pop("max_tokens", 512)
    seed = data.pop("seed", 0)
    template = data.pop("template", DEFAULT_TEMPLATE)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"judge: max_tokens={max_tokens!r}: must be an integer >= 1")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"judge: seed={seed!r}: must be an integer >= 0")
    if template not in TEMPLATES:
        raise ValueError(f"judge: template={template!r}: must be one of {', '.join(TEMPLATES)}")
    endpoint = parse_arm(JUDGE, {**data, "kind": "openai", "concurrency": data.get("concurrency", 2)})
    assert isinstance(endpoint, OpenAIArm)
    return Judge(endpoint, max_tokens, seed, template)


@dataclass(frozen=True)
class Verdict:
    """One judge call's result."""

    position: str
    verdict: str | None
    preferred: str
    output: str
    latency_s: float
    source: str


class JudgeClient:
    """Calls the judge from a small thread pool (``concurrency`` per base URL), so the run's main thread
    keeps grading and storing while the judge works; retries like an endpoint arm."""

    def __init__(self, judge: Judge) -> None:
        self.judge = judge
        arm = judge.endpoint
        self._pool = ThreadPoolExecutor(max_workers=arm.concurrency * len(arm.base_urls))
        headers = {"Authorization": f"Bearer {arm.api_key}"} if arm.api_key else {}
        self._client = httpx.Client(timeout=arm.timeout, headers=headers)
        self._calls = 0

    def submit(self, question: Question, position: str, first: str, second: str) -> Future[Verdict]:
        """Ask the judge about one position of one question's pair (in the background)."""
        a, b = (first, second) if position == "AB" else (second, first)
        index = self._calls
        self._calls += 1
        return self._pool.submit(self._call, question, position, self.judge.prompt(question, a, b), index)

    def _call(self, question: Question, position: str, prompt: str, index: int) -> Verdict:
        arm = self.judge.endpoint
        body = {
            "model": arm.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.0,
            "max_tokens": self.judge.max_tokens,
            "seed": self.judge.seed,
        }
        last_error = ""
        for attempt in range(arm.max_retries + 1):
            if attempt:
                time.sleep(arm.backoff * 2 ** (attempt - 1))
            url = arm.base_urls[(index + attempt) % len(arm.base_urls)]
            start = time.monotonic()
            try:
                response = self._client.post(url + "/chat/completions", json=body)
            except httpx.TransportError as exc:
                last_error = f"{url}: {type(exc).__name__}: {exc or 'no detail'}"
                continue
            reason = retry_reason(response, url, "judge", f"{url}/chat/completions")
            if reason is not None:
                last_error = reason
                continue
            try:
                text = response.json()["choices"][0]["message"]["content"] or ""
            except (ValueError, KeyError, IndexError, TypeError):
                raise ValueError(
                    f"judge: {url}/chat/completions returned a body that is not a chat completion: "
                    f"{response.text[:300]}"
                ) from None
            verdict = parse_verdict(text)
            latency = time.monotonic() - start
            return Verdict(position, verdict, preferred(position, verdict), text, latency, url)
        raise EndpointError(
            f"judge: no verdict for question {question.dataset}/{question.id} ({position}) after "
            f"{arm.max_retries + 1} attempt(s); last error: {last_error}. Answers and judgements stored so "
            "far are kept; rerun the same command to resume."
        )

    def close(self, wait: bool = True) -> None:
        """Stop the pool (``wait=False`` gives up on calls in flight) and the HTTP client."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        if wait:
            self._client.close()
