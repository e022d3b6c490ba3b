"""The judge's endpoint: its settings (``parse_judge``), the prompt it is shown for a question and the
client that asks it, with the retries of an endpoint arm. The judge's rule is in
flyspec/gate/grading/graders.py; which pairs are asked, and when, is the run's (flyspec/gate/runs/judging.py).
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from flyspec.checks import is_int
from flyspec.gate.arms.base import ArmSpec, ServedModel, Settings, load_arm_spec, unknown_keys
from flyspec.gate.arms.endpoint import KEYS, EndpointError, OpenAIArm, parse, retry_reason
from flyspec.gate.data.questions import Question
from flyspec.gate.data.spec import JudgeRecord
from flyspec.gate.grading.graders import (
    DEFAULT_TEMPLATE,
    POSITIONS,
    RULE,
    TEMPLATES,
    judge_prompt,
    parse_verdict,
    preferred,
)

JUDGE_ARM = "judge"
"""The judge endpoint's name among a run's arms: the model its server reports is recorded under it."""
_JUDGE_KEYS = (*(k for k in KEYS if k != "extra_body"), "max_tokens", "seed", "template")


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
        return judge_prompt(self.template, request_text(question), question.answer, response_a, response_b)

    def identity(self, served: ServedModel | None) -> JudgeRecord:
        """What the registration records: model, served model, sampling and the template (name, sha256,
        text)."""
        return JudgeRecord(
            model=self.endpoint.model,
            max_tokens=self.max_tokens,
            seed=self.seed,
            template=self.template,
            template_sha256=hashlib.sha256(self.template_text.encode()).hexdigest(),
            template_text=self.template_text,
            positions=POSITIONS,
            rule=RULE,
            served_model=served,
        )

    def public_dict(self) -> Settings:
        """The judge's settings for the run's notes (the API key only as whether one is set)."""
        return {**self.endpoint.public_dict(), "max_tokens": self.max_tokens, "seed": self.seed}


def parse_judge(spec: ArmSpec) -> Judge:
    """A judge given as a dict, a JSON object string or a JSON file: ``{"base_url" | "base_urls", "model",
    "api_key", "max_tokens", "seed", "template", "concurrency", "timeout", "max_retries", "backoff"}``."""
    data = load_arm_spec(spec, JUDGE_ARM)
    unknown_keys("judge", data, _JUDGE_KEYS, "a judge takes")
    if data.get("kind", "openai") != "openai":
        raise ValueError(f"judge: kind={data['kind']!r}: a judge is an OpenAI-compatible endpoint ('openai')")
    max_tokens = data.pop("max_tokens", 512)
    seed = data.pop("seed", 0)
    template = data.pop("template", DEFAULT_TEMPLATE)
    if not is_int(max_tokens, 1):
        raise ValueError(f"judge: max_tokens={max_tokens!r}: must be an integer >= 1")
    if not is_int(seed, 0):
        raise ValueError(f"judge: seed={seed!r}: must be an integer >= 0")
    if template not in TEMPLATES:
        raise ValueError(f"judge: template={template!r}: must be one of {', '.join(TEMPLATES)}")
    endpoint = parse(JUDGE_ARM, {**data, "kind": "openai", "concurrency": data.get("concurrency", 2)})
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
