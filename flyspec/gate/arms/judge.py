"""The judge's endpoint: its settings (``parse_judge``), the prompt it is shown for a question and the
client that asks it through an ``EndpointClient``, as an endpoint arm asks its server. The judge's rule is in
flyspec/gate/grading/graders.py; which pairs are asked, and when, is the run's (flyspec/gate/runs/judging.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

from flyspec.checks import is_int
from flyspec.gate.arms.base import ArmSpec, ServedModel, Settings, load_arm_spec, unknown_keys
from flyspec.gate.arms.endpoint import KEYS, KIND, EndpointClient, OpenAIArm, parse
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


@dataclass(frozen=True)
class Judge:
    """The judge endpoint, model, sampling and prompt template of a run."""

    endpoint: OpenAIArm
    max_tokens: int = 512
    seed: int = 0
    template: str = DEFAULT_TEMPLATE

    def identity(self, served: ServedModel | None) -> JudgeRecord:
        """What the registration records: model, served model, sampling, the template (name, sha256,
        text), the positions and the rule."""
        text = TEMPLATES[self.template]
        return JudgeRecord(
            model=self.endpoint.model,
            max_tokens=self.max_tokens,
            seed=self.seed,
            template=self.template,
            template_sha256=hashlib.sha256(text.encode()).hexdigest(),
            template_text=text,
            positions=POSITIONS,
            rule=RULE,
            served_model=served,
        )

    def public_dict(self) -> Settings:
        """The judge's settings for the run's notes (the API key only as whether one is set)."""
        return {**self.endpoint.public_dict(), "max_tokens": self.max_tokens, "seed": self.seed}


def parse_judge(spec: ArmSpec) -> Judge:
    """A judge given as a dict, a JSON object string or a JSON file (docs/gate.md lists its keys)."""
    data = load_arm_spec(spec, JUDGE_ARM)
    unknown_keys("judge", data, _JUDGE_KEYS, "a judge takes")
    if data.get("kind", KIND) != KIND:
        raise ValueError(f"judge: kind={data['kind']!r}: a judge is an OpenAI-compatible endpoint ('openai')")
    own = {key: data.pop(key) for key in ("max_tokens", "seed", "template") if key in data}
    judge = Judge(parse(JUDGE_ARM, {**data, "kind": KIND, "concurrency": data.get("concurrency", 2)}), **own)
    if not is_int(judge.max_tokens, 1):
        raise ValueError(f"judge: max_tokens={judge.max_tokens!r}: must be an integer >= 1")
    if not is_int(judge.seed, 0):
        raise ValueError(f"judge: seed={judge.seed!r}: must be an integer >= 0")
    if judge.template not in TEMPLATES:
        raise ValueError(f"judge: template={judge.template!r}: must be one of {', '.join(TEMPLATES)}")
    return judge


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
    """Calls the judge on an event loop of its own thread, so the run's main thread keeps grading and
    storing while the judge works: one ``EndpointClient`` (``concurrency`` calls per base URL, kept-alive
    connections, retried like an endpoint arm's requests)."""

    def __init__(self, judge: Judge) -> None:
        self.judge = judge
        self._client = EndpointClient(judge.endpoint, "judge")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flyspec-judge", daemon=True)
        self._thread.start()
        self._asked: set[Future[Verdict]] = set()
        self._calls = 0

    def submit(self, question: Question, position: str, first: str, second: str) -> Future[Verdict]:
        """Ask the judge about one position of one question's pair (in the background)."""
        a, b = (first, second) if position == "AB" else (second, first)
        # What was asked, as the judge sees it: the prompt, or the chat's turns (one user turn as is).
        turns = question.messages or []
        if question.prompt is not None:
            request = question.prompt
        elif len(turns) == 1:
            request = turns[0]["content"]
        else:
            request = "\n".join(f"{m['role']}: {m['content']}" for m in turns)
        prompt = judge_prompt(self.judge.template, request, question.answer, a, b)
        body: Settings = {
            "model": self.judge.endpoint.model,
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0.0,
            "max_tokens": self.judge.max_tokens,
            "seed": self.judge.seed,
        }
        failure = f"no verdict for question {question.dataset}/{question.id} ({position})"
        first_url = self._calls
        self._calls += 1
        asked = asyncio.run_coroutine_threadsafe(self._ask(position, body, first_url, failure), self._loop)
        self._asked.add(asked)
        asked.add_done_callback(self._asked.discard)
        return asked

    async def _ask(self, position: str, body: Settings, first_url: int, failure: str) -> Verdict:
        reply = await self._client.complete("/chat/completions", body, first_url, failure)
        verdict = parse_verdict(reply.text)
        chose = preferred(position, verdict)
        return Verdict(position, verdict, chose, reply.text, reply.latency_s, reply.source)

    def close(self, wait: bool = True) -> None:
        """Wait for the calls in flight (``wait=False``: cancel them), then close the connections and the
        loop."""
        if not self._thread.is_alive():
            return
        if wait:
            futures_wait(list(self._asked))
        for asked in list(self._asked):
            asked.cancel()
        asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
