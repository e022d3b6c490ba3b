"""Choices of a response: what one engine sample becomes in the OpenAI shapes, whole or streamed.

An HTTP request runs as one engine request per prompt, each with n samples; the OpenAI choice index is
`prompt_index * n + sample_index`. A choice carries its text (after the echoed prompt, with `echo`), its
finish and stop reason, its logprobs when asked, and for an enforced tool call the parsed `tool_calls`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from flyspec.outputs import CompletionOutput, RequestOutput
from flyspec.sampling_params import SamplingParams
from flyspec.server.logprobs_json import CompletionLogprobs, chat_logprobs, prompt_logprobs_json
from flyspec.server.responses import stop_reason
from flyspec.server.tool_calls import ToolCallFormat

Decode = Callable[[list[int]], Awaitable[str]]
"""The text of token ids as the engine decodes output (the server's prompt worker)."""


@dataclass(frozen=True)
class Echo:
    """What an echoed prompt adds before each of its choices: its text, and the text of its first token
    (which has no logprob)."""

    text: str
    first_token: str


@dataclass
class Ending:
    """How a finished choice ended, as the response reports it."""

    finish_reason: str | None
    stop_reason: str | int | None
    tool_calls: list[dict[str, Any]] | None = None


@dataclass
class ChoiceShaper:
    """Shapes the samples of one HTTP request's engine outputs into choices.

    logprobs: None when not asked, else the number of alternatives per token. prompt_logprobs: whether
    vLLM's `prompt_logprobs` is returned. echo: per prompt, or None without echo (completions only).
    """

    params: SamplingParams
    decode: Decode
    logprobs: int | None = None
    prompt_logprobs: bool = False
    echo: list[Echo] | None = None
    tool_format: ToolCallFormat | None = None

    def index(self, prompt_index: int, sample: CompletionOutput) -> int:
        """The OpenAI choice index of a sample."""
        return prompt_index * self.params.n + sample.index

    async def ending(self, sample: CompletionOutput) -> Ending:
        """The finish reason, stop reason and (for an enforced tool call) the tool calls of a finished
        sample; the generated tokens are decoded only when a stop string may have ended it."""
        stops, ids = self.params.stop, self.params.stop_token_ids
        assert isinstance(stops, list) and ids is not None  # SamplingParams normalises both
        decoded = await self.decode(sample.token_ids) if stops and sample.finish_reason == "stop" else None
        ending = Ending(sample.finish_reason, stop_reason(sample, stops, ids, decoded))
        if self.tool_format is not None and sample.finish_reason == "stop":
            calls = self.tool_format.parse(sample.text)
            if calls is not None:
                ending = Ending(self.tool_format.finish_reason, None, calls)
        return ending

    def prompt_entries(self, out: RequestOutput, prompt_index: int, into: CompletionLogprobs) -> None:
        """Add an echoed prompt's tokens to a completions logprobs object."""
        assert self.echo is not None and out.prompt_logprobs is not None
        into.add_unscored(self.echo[prompt_index].first_token)
        for token_id, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True):
            assert position is not None
            into.add(token_id, position)

    def vllm_prompt_logprobs(self, out: RequestOutput) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs` field, when asked and computed."""
        if not self.prompt_logprobs or out.prompt_logprobs is None:
            return None
        return prompt_logprobs_json(out.prompt_logprobs)

    async def completion_choice(
        self, prompt_index: int, out: RequestOutput, sample: CompletionOutput
    ) -> dict:
        """A finished sample as a non-streaming /v1/completions choice."""
        logprobs = None
        if self.logprobs is not None:
            built = CompletionLogprobs()
            if self.echo is not None:
                self.prompt_entries(out, prompt_index, built)
            for token_id, position in zip(sample.token_ids, sample.logprobs or [], strict=True):
                built.add(token_id, position)
            logprobs = built.take()
        ending = await self.ending(sample)
        echoed = self.echo[prompt_index].text if self.echo is not None else ""
        choice = {
            "index": self.index(prompt_index, sample),
            "text": echoed + sample.text,
            "logprobs": logprobs,
            "finish_reason": ending.finish_reason,
            "stop_reason": ending.stop_reason,
        }
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = self.vllm_prompt_logprobs(out)
        return choice

    async def chat_choice(self, sample: CompletionOutput) -> dict:
        """A finished sample as a non-streaming /v1/chat/completions choice."""
        ending = await self.ending(sample)
        message = {
            "role": "assistant",
            "content": None if ending.tool_calls else sample.text,
            "tool_calls": ending.tool_calls or [],
        }
        logprobs = None
        if self.logprobs is not None:
            logprobs = chat_logprobs(sample.token_ids, sample.logprobs or [], self.logprobs)
        return {
            "index": sample.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": ending.finish_reason,
            "stop_reason": ending.stop_reason,
        }


@dataclass
class StreamCursor:
    """How much of one choice a stream has sent: logprob tokens, whether it began (echo, prompt
    logprobs), whether it ended; `logprobs` keeps completions' text offsets running."""

    tokens_sent: int = 0
    started: bool = False
    done: bool = False
    logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)
