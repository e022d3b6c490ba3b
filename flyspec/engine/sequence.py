"""Per-request state: token ids, target cache length, status, random stream, stop handling, metrics,
logprobs, and the group of samples (SamplingParams.n) that makes one RequestOutput."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from flyspec.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from flyspec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from flyspec.engine.logits_processing import RequestLogitsState


class SequenceStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request.

    The target cache's length for this request is owned here, not by the cache: `num_computed` is how
    many of the request's tokens the target cache holds, in the KV blocks of `block_table` (handed out by
    engine/kv_blocks.py). Once the prompt is prefilled, `num_computed == num_tokens - 1`: the newest token
    is always the next one fed to the target. Rolling back is just setting that number lower. (The drafter
    keeps its own draft-side lengths.) A preempted request gives its blocks back and later computes its
    tokens again from the start (`preempt`).

    `request_id` is unique among running sequences: the request's own id, or for sample i of an n > 1
    request `f"{i}_{request_id}"` (vLLM's spelling); `group_id` is the request's id in both cases.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        eos_token_ids: frozenset[int],
        *,
        group_id: str | None = None,
        index: int = 0,
        logits_state: RequestLogitsState | None = None,
    ) -> None:
        self.request_id = request_id
        self.group_id = group_id if group_id is not None else request_id
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = eos_token_ids
        # A CPU generator of its own, so a seeded request draws the same numbers whatever the batch.
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        self.num_computed = 0
        self.text = ""
        self.metrics = RequestMetrics(arrival_time=time.monotonic())
        self.error: str | None = None
        self.logits_state = logits_state
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # Filled by the prefill when asked (for an n > 1 request only by sample 0: one prompt, one score).
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.wants_prompt_logprobs = params.prompt_logprobs is not None and index == 0

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
    def num_prefill_tokens(self) -> int:
        """Tokens to compute before decoding: the prompt, or after a preemption every token but the
        newest (which the next decode step feeds)."""
        return self.num_tokens - 1 if self.output_token_ids else self.num_prompt_tokens

    @property
    def is_prefilling(self) -> bool:
        """True until the prompt (or, after a preemption, every token but the newest) is in the cache."""
        return self.num_computed < self.num_prefill_tokens

    @property
    def is_running(self) -> bool:
        """True while admitted (holding KV blocks) and not finished."""
        return self.status is SequenceStatus.RUNNING

    @property
    def is_finished(self) -> bool:
        """True once a stop condition, the length limit or an abort ended the request."""
        return self.status is SequenceStatus.FINISHED

    def draw_uniforms(self, n: int) -> torch.Tensor:
        """n float64 numbers in (0, 1) from this request's own stream (0 is excluded: a p/q test
        against u = 0 would keep a zero-probability draft token)."""
        u = torch.rand(n, generator=self.generator, dtype=torch.float64)
        return u.clamp_(min=torch.finfo(torch.float64).tiny)

    def start(self) -> None:
        """Admit the request (its blocks are in `block_table`)."""
        self.status = SequenceStatus.RUNNING

    def preempt(self) -> None:
        """Back to waiting with nothing cached (its blocks were given back); its tokens, random stream and
        logits state stay, so it continues where it stopped once its tokens are computed again."""
        self.status = SequenceStatus.WAITING
        self.num_computed = 0

    def finish(self, reason: str) -> None:
        """Mark the request finished with reason "stop", "length", "abort" or "error"."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finished_time = time.monotonic()

    def fail(self, message: str) -> None:
        """Finish this request alone with an error (the rest of its batch goes on)."""
        self.error = message
        self.finish("error")

    def add_logprobs(self, entries: list[PositionLogprobs]) -> None:
        """Record the logprobs of tokens just committed (one entry per kept token)."""
        assert self.logprobs is not None
        if not entries:
            return
        self.logprobs.extend(entries)
        for entry, token in zip(entries, self.output_token_ids[-len(entries) :], strict=True):
            self.cumulative_logprob += entry[token].logprob

    def append_tokens(
        self, new_token_ids: list[int], detokenize: Callable[[list[int]], str], max_model_len: int
    ) -> int:
        """Commit generated tokens in order until a stop condition; return how many were kept.

        Stop order per token: a stop string completed by this token (text cut before it), a stop token
        id or end-of-sequence (kept in token_ids, hidden from text by the detokeniser), a grammar that is
        complete (structured output), max_tokens, and max_model_len. A token the grammar forbids raises
        ValueError (the engine fails this request alone).
        """
        params = self.params
        if self.metrics.first_token_time is None and new_token_ids:
            self.metrics.first_token_time = time.monotonic()
        kept = 0
        stop_text: str | None = None
        state = self.logits_state
        for token in new_token_ids:
            if state is not None:
                state.accept(token)
            self.output_token_ids.append(token)
            kept += 1
            if params.stop:
                stop_text = _cut_at_stop(detokenize(self.output_token_ids), params.stop)
                if stop_text is not None:
                    self.finish("stop")
                    break
            stop_token = token in params.stop_token_ids or (
                token in self.eos_token_ids and not params.ignore_eos
            )
            if stop_token or (state is not None and state.grammar is not None and state.grammar.is_finished):
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

    def completion(self) -> CompletionOutput:
        """This sample's cumulative output."""
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,  # type: ignore[arg-type]
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            metrics=self.metrics_snapshot(),
        )

    def metrics_snapshot(self) -> RequestMetrics:
        """A copy of the metrics that later steps do not change."""
        return dataclasses.replace(self.metrics, forgiven_positions=list(self.metrics.forgiven_positions))


class RequestGroup:
    """The samples of one request (one Sequence unless SamplingParams.n > 1) and its RequestOutput.

    The request is finished when every sample is; if one sample fails, the request fails (`error`) and
    the engine aborts the others.
    """

    def __init__(self, request_id: str, seqs: list[Sequence]) -> None:
        self.request_id = request_id
        self.seqs = seqs

    @property
    def is_running(self) -> bool:
        """True while admitted (holding KV blocks) and not finished."""
        return self.status is SequenceStatus.RUNNING

    @property
    def is_finished(self) -> bool:
        """True once every sample finished."""
        return all(s.is_finished for s in self.seqs)

    @property
    def error(self) -> str | None:
        """The first failed sample's error, or None."""
        return next((s.error for s in self.seqs if s.error is not None), None)

    def to_output(self) -> RequestOutput:
        """Cumulative snapshot of this request for the caller."""
        first = self.seqs[0]
        completions = [s.completion() for s in self.seqs]
        metrics = completions[0].metrics if len(self.seqs) == 1 else _combined(completions)
        assert metrics is not None
        return RequestOutput(
            request_id=self.request_id,
            prompt=first.prompt,
            prompt_token_ids=list(first.prompt_token_ids),
            outputs=completions,
            finished=self.is_finished,
            metrics=metrics,
            prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
            error=self.error,
        )


def _combined(completions: list[CompletionOutput]) -> RequestMetrics:
    """The request's metrics over its samples: counters add up, the first token and the last finish
    count; forgiven positions stay per sample (CompletionOutput.metrics)."""
    each = [c.metrics for c in completions if c.metrics is not None]
    firsts = [m.first_token_time for m in each if m.first_token_time is not None]
    finishes = [m.finished_time for m in each]
    return RequestMetrics(
        num_drafts=sum(m.num_drafts for m in each),
        num_draft_tokens=sum(m.num_draft_tokens for m in each),
        num_accepted_tokens=sum(m.num_accepted_tokens for m in each),
        num_forgiven_tokens=sum(m.num_forgiven_tokens for m in each),
        arrival_time=min(m.arrival_time for m in each),
        first_token_time=min(firsts) if firsts else None,
        finished_time=None if None in finishes else max(f for f in finishes if f is not None),
    )


def _cut_at_stop(text: str, stops: list[str]) -> str | None:
    """The text before the earliest stop string, or None when no stop string occurs."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(hits)] if hits else None
