"""Per-request state: token ids, target cache length, status, random stream, stop handling, metrics."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable

import torch

from flyspec.outputs import CompletionOutput, RequestMetrics, RequestOutput
from flyspec.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request.

    The target cache's length for this request is owned here, not by the cache: `num_computed` is how
    many of the request's tokens the target cache holds. Once the prompt is prefilled,
    `num_computed == num_tokens - 1`: the newest token is always the next one fed to the target. Rolling
    back is just setting that number lower. (The drafter keeps its own draft-side lengths.)
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = eos_token_ids
        # A CPU generator of its own, so a seeded request draws the same numbers whatever the batch.
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.slot: int | None = None
        self.num_computed = 0
        self.text = ""
        self.metrics = RequestMetrics(arrival_time=time.monotonic())

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_prefilling(self) -> bool:
        """True until the whole prompt is in the target cache."""
        return self.num_computed < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        """True once a stop condition, the length limit or an abort ended the request."""
        return self.status is SequenceStatus.FINISHED

    def draw_uniforms(self, n: int) -> torch.Tensor:
        """n float64 numbers in (0, 1) from this request's own stream (0 is excluded: a p/q test
        against u = 0 would keep a zero-probability draft token)."""
        u = torch.rand(n, generator=self.generator, dtype=torch.float64)
        return u.clamp_(min=torch.finfo(torch.float64).tiny)

    def start(self, slot: int) -> None:
        """Admit the request into cache slot `slot`."""
        self.status = SequenceStatus.RUNNING
        self.slot = slot

    def finish(self, reason: str) -> None:
        """Mark the request finished with reason "stop", "length" or "abort"."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finished_time = time.monotonic()

    def append_tokens(
        self, new_token_ids: list[int], detokenize: Callable[[list[int]], str], max_model_len: int
    ) -> int:
        """Commit generated tokens in order until a stop condition; return how many were kept.

        Stop order per token: a stop string completed by this token (text cut before it), a stop token
        id or end-of-sequence (kept in token_ids, hidden from text by the detokeniser), max_tokens, and
        max_model_len.
        """
        params = self.params
        if self.metrics.first_token_time is None and new_token_ids:
            self.metrics.first_token_time = time.monotonic()
        kept = 0
        stop_text: str | None = None
        for token in new_token_ids:
            self.output_token_ids.append(token)
            kept += 1
            if params.stop:
                stop_text = _cut_at_stop(detokenize(self.output_token_ids), params.stop)
                if stop_text is not None:
                    self.finish("stop")
                    break
            if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
                self.finish("stop")
            elif len(self.output_token_ids) >= params.max_tokens or self.num_tokens >= max_model_len:
                self.finish("length")
            if self.is_finished:
                break
        if stop_text is not None:
            self.text = stop_text
        else:
            text = detokenize(self.output_token_ids)
            # A token that ends inside a multi-byte character decodes to U+FFFD; hold it back until the
            # character is complete so that streamed text never has to take characters back.
            self.text = text if self.is_finished else text.rstrip("\ufffd")
        return kept

    def to_output(self) -> RequestOutput:
        """Cumulative snapshot of this request for the caller."""
        completion = CompletionOutput(
            index=0,
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,  # type: ignore[arg-type]
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            outputs=[completion],
            finished=self.is_finished,
            metrics=dataclasses.replace(
                self.metrics, forgiven_positions=list(self.metrics.forgiven_positions)
            ),
        )


def _cut_at_stop(text: str, stops: list[str]) -> str | None:
    """The text before the earliest stop string, or None when no stop string occurs."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(hits)] if hits else None
