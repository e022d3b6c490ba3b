"""The offline API, mirroring vLLM's: `LLM(...).generate(prompts, sampling_params)`, `LLM.chat(...)`, and
`LLM.stream(requests)` for callers that feed work continuously and want each answer the moment it is done.

This is the one API every face builds on (the CLI, the gate, the benchmarks). Only the server drives
`LLMEngine` itself, from its own engine thread, because it must interleave steps with requests arriving
and aborting over HTTP.
"""

from __future__ import annotations

import itertools
import queue
import time
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flyspec.chat import Message, render_chat
from flyspec.checks import is_int
from flyspec.config import EngineConfig
from flyspec.engine.engine import LLMEngine
from flyspec.engine.timing import StepTiming
from flyspec.engine.warmup import WARMUP_TIME_LIMIT_S, WARMUP_TOKENS, TooSlowError
from flyspec.models.footprint import streamed_weight_bytes
from flyspec.models.loader import LoadedModel
from flyspec.outputs import RequestOutput
from flyspec.sampling_params import SamplingParams
from flyspec.spec_decode.metrics import SpecDecodeStats

Prompt = str | list[int]

__all__ = [
    "LLM",
    "GenerationRequest",
    "Prompt",
    "RequestRejected",
    "StepProfile",
    "TooSlowError",
    "prompt_lengths",
]


@dataclass(frozen=True)
class GenerationRequest:
    """One request for `LLM.stream`: a prompt (text or token ids) or a chat conversation, its sampling
    parameters (None = SamplingParams() defaults), and an id to find its output by (None = generated)."""

    prompt: Prompt | None = None
    messages: list[Message] | None = None
    params: SamplingParams | None = None
    request_id: str | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a GenerationRequest needs exactly one of prompt or messages")


class RequestRejected(ValueError):
    """The engine refused one request (its id and the reason are attributes as well as the message)."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r}: {reason}")
        self.request_id = request_id
        self.reason = reason


@dataclass(frozen=True)
class StepProfile:
    """One generation timed step by step (``LLM.profile_steps``): its output, each engine step's
    ``StepTiming`` (the whole step, the target's and the draft's forward passes, verification, the rest),
    the first one the prompt's prefill, and the wall time of the whole call."""

    output: RequestOutput
    steps: list[StepTiming]
    wall_s: float


class LLM:
    """A target model (optionally with a drafter) for batched offline generation.

    model: an HF folder, a .gguf file, or a zoo name. The other settings are EngineConfig's fields
    (flyspec/config.py), by keyword, with its defaults and rules: speculative_config (a dict or
    SpeculativeConfig; None = no speculation), dtype, device, max_num_seqs, max_num_batched_tokens,
    max_model_len (None = min(the model's max_position_embeddings, 4096)), seed, quantization (None,
    "int8", "int4" or "auto": weights quantized at load time, CPU only; "auto" takes the format the
    load-time kernel check finds fastest on this CPU; docs/performance.md), kv_cache_request_len (the
    longest prompt plus max_tokens the caller will send: the KV cache holds max_running such requests;
    `prompt_lengths` counts prompts), kv_cache_memory_bytes (a cap on the KV cache of target and draft
    instead; with neither, what max_running requests of max_model_len need, at most a quarter of the
    machine's memory), enable_prefix_caching (share the KV blocks of identical prompt
    prefixes), batch_invariant (a request's output does not depend on the other requests in the batch).
    """

    def __init__(self, model: str, **engine_args: Any) -> None:
        self._start(LLMEngine(EngineConfig(model=model, **engine_args)))

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, target: LoadedModel | None = None, draft: LoadedModel | None = None
    ) -> LLM:
        """An LLM for an EngineConfig; `target` / `draft` reuse models already loaded for that config
        (the benchmarks start many engines over the same weights and load them once)."""
        llm = cls.__new__(cls)
        llm._start(LLMEngine(config, target=target, draft=draft))
        return llm

    def _start(self, engine: LLMEngine) -> None:
        # Private: the one LLM API is its methods; only the server drives an engine itself.
        self._engine = engine
        self._ids = itertools.count()
        # Aborts asked for from other threads; the stream that owns the request applies them between
        # steps, since the engine itself is driven by one thread.
        self._aborts: queue.SimpleQueue[str] = queue.SimpleQueue()

    @property
    def max_running(self) -> int:
        """How many requests can run at once (the admission cap of the token budget and max_num_seqs)."""
        return self._engine.max_running

    @property
    def max_model_len(self) -> int:
        """The context length of one sequence (prompt plus output), as resolved at load: the given
        max_model_len, or min(the model's max_position_embeddings, 4096)."""
        return self._engine.max_model_len

    def has_unfinished_requests(self) -> bool:
        """True while the engine holds a request, waiting or running: False once every generate / chat /
        stream call has returned or been closed (a closed stream aborts what it had in flight)."""
        return self._engine.has_unfinished_requests()

    def abort(self, request_id: str) -> None:
        """Abort a request that a `stream` call has in flight, from any thread: before its next step that
        stream frees the request's slot and KV blocks and yields nothing for it (like vLLM's
        `abort_request`). An id that is not in flight is ignored."""
        self._aborts.put(request_id)

    def warm_up(self, max_tokens: int = WARMUP_TOKENS, time_limit_s: float = WARMUP_TIME_LIMIT_S) -> float:
        """Generate a few tokens so that one-time costs are paid before real work, and return the seconds
        it took. Raises TooSlowError (a ValueError naming the faster options) when `max_tokens` take
        longer than `time_limit_s` on this machine. Call it before adding work."""
        return self._engine.warm_up(max_tokens, time_limit_s)

    @property
    def weight_formats(self) -> dict[str, str]:
        """How the target's (and a draft model's) weights were loaded, e.g. {"target": "int8", "draft":
        "int4"}: what quantization="auto" chose on this CPU, or "bfloat16 (prepacked)"."""
        return dict(self._engine.weight_formats)

    @property
    def target_weight_bytes(self) -> int:
        """Bytes of the target's weights one decode step of one sequence reads: its linear layers in the
        format they run in, the lm_head included (flyspec/models/footprint.py). Over the machine's memory
        bandwidth it bounds one sequence's tokens/s."""
        return streamed_weight_bytes(self._engine.target.model)

    @property
    def stats(self) -> SpecDecodeStats:
        """The engine's cumulative counters (live, not a copy): prompt and generated tokens, acceptance,
        `prefix_cache_hits` (prompt tokens whose KV was shared, so their prefill was saved) of
        `prefix_cache_queries`, `num_preemptions`, and the `kv_cache_usage` gauge."""
        return self._engine.stats

    @property
    def kv_cache_capacity_bytes(self) -> int:
        """Bytes of KV cache the engine may use, target and draft together (on the CPU only the blocks
        ever written are resident)."""
        return self._engine.kv_cache_capacity_bytes

    def get_tokenizer(self) -> Any:
        """The target model's tokenizer."""
        return self._engine.tokenizer

    def profile_steps(self, prompt: Prompt, params: SamplingParams | None = None) -> StepProfile:
        """Generate once for ``prompt`` with the engine's per-step timings on (engine/timing.py; off again
        afterwards), for profiling: the output, each step's timings, and the wall time of the whole
        call (on CUDA the device is synchronised around it). Use it on an idle LLM: other requests'
        steps would be timed too."""
        engine = self._engine
        sync = torch.cuda.synchronize if engine.config.device.startswith("cuda") else (lambda: None)
        engine.record_step_timings()
        try:
            sync()
            start = time.perf_counter()
            (output,) = self.generate([prompt], params, use_tqdm=False)
            sync()
            wall = time.perf_counter() - start
            steps = list(engine.step_timings or ())
        finally:
            engine.record_step_timings(False)
        return StepProfile(output, steps, wall)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for a prompt or a list of prompts (text or token ids); outputs in prompt order.

        sampling_params: one for all prompts, one per prompt, or None (SamplingParams() defaults).
        use_tqdm: show a progress bar (rich, on stderr) of finished requests.
        """
        items = _prompt_list(prompts)
        params = _per_prompt(sampling_params, len(items))
        return self._run(
            [GenerationRequest(prompt=p, params=sp) for p, sp in zip(items, params, strict=True)], use_tqdm
        )

    def chat(
        self,
        messages: list[Message] | Seq[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, applying the tokenizer's chat template
        (with the assistant turn opened, add_generation_prompt=True)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = _per_prompt(sampling_params, len(conversations))
        requests = [
            GenerationRequest(messages=c, params=sp)  # type: ignore[arg-type]
            for c, sp in zip(conversations, params, strict=True)
        ]
        return self._run(requests, use_tqdm)

    def stream(
        self,
        requests: Iterable[GenerationRequest] | Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        max_in_flight: int | None = None,
        use_tqdm: bool = False,
        total: int | None = None,
    ) -> Iterator[RequestOutput]:
        """Stream outputs, in one of two forms.

        - **Prompts** (a text prompt, a token-id list, or a list of them) with `sampling_params` (one for
          all or one per prompt): yields *incremental* outputs as the tokens arrive, as vLLM's streaming
          does: each RequestOutput carries only the text and token ids (and logprobs) new since the last
          one of that request, `finished` on its last.
              for delta in llm.stream("Count to five:", SamplingParams(max_tokens=16)):
                  print(delta.outputs[0].text, end="")
        - **Requests** (an iterable of GenerationRequest, each with its own params): yields each request's
          *final* output as soon as it finishes (in finish order). Requests are pulled lazily, keeping up
          to `max_in_flight` of them in the engine (default: as many as can run at once), so a caller can
          feed an open-ended sequence and stop early by ending it; requests already in flight still
          finish and are yielded.

        Either way, closing the generator (e.g. `break`) aborts whatever is still in flight, and a request
        the engine refuses (e.g. a prompt longer than max_model_len) raises ValueError naming it, after
        aborting the others.
        """
        if _is_prompts(requests):
            prompts = _prompt_list(requests)  # type: ignore[arg-type]
            params = _per_prompt(sampling_params, len(prompts))
            items = [GenerationRequest(prompt=p, params=sp) for p, sp in zip(prompts, params, strict=True)]
            return self._stream(items, max_in_flight, use_tqdm, total, deltas=True)
        if sampling_params is not None:
            raise ValueError(
                "sampling_params goes with prompts; GenerationRequest items carry their own params"
            )
        return self._stream(requests, max_in_flight, use_tqdm, total, deltas=False)  # type: ignore[arg-type]

    def _stream(
        self,
        requests: Iterable[GenerationRequest],
        max_in_flight: int | None,
        use_tqdm: bool,
        total: int | None,
        *,
        deltas: bool,
    ) -> Iterator[RequestOutput]:
        engine = self._engine
        limit = max_in_flight if max_in_flight is not None else engine.max_running
        if not is_int(limit, 1):
            raise ValueError(f"max_in_flight={limit!r}: must be a positive integer")
        source = iter(requests)
        exhausted = False
        in_flight: set[str] = set()
        seen: dict[str, dict[int, tuple[int, int]]] = {}
        with _progress(use_tqdm, total) as bar:
            try:
                while True:
                    while not exhausted and len(in_flight) < limit:
                        request = next(source, None)
                        if request is None:
                            exhausted = True
                            break
                        in_flight.add(self._add(request))
                    if not in_flight:
                        return
                    while not self._aborts.empty():
                        request_id = self._aborts.get()
                        if request_id in in_flight:
                            engine.abort_request(request_id)
                            in_flight.discard(request_id)
                    if not in_flight:
                        continue
                    for out in engine.step():
                        if out.request_id not in in_flight:
                            continue
                        if deltas:
                            yield _delta(out, seen)
                        if out.finished:
                            in_flight.discard(out.request_id)
                            bar.advance(sum(len(o.token_ids) for o in out.outputs))
                            if not deltas:
                                yield out
            finally:
                # Reached on errors, Ctrl-C and a consumer that stops early: leave the engine clean.
                for request_id in in_flight:
                    engine.abort_request(request_id)

    def _add(self, request: GenerationRequest) -> str:
        if not isinstance(request, GenerationRequest):
            raise ValueError(f"stream() takes GenerationRequest items, got {type(request).__name__}")
        request_id = request.request_id if request.request_id is not None else f"llm-{next(self._ids)}"
        params = request.params if request.params is not None else SamplingParams()
        prompt: Prompt
        text: str | None = None
        try:
            if request.messages is not None:
                prompt, text = render_chat(self._engine.tokenizer, request.messages)
            else:
                assert request.prompt is not None
                prompt = request.prompt
            self._engine.add_request(request_id, prompt, params, prompt_text=text)
        except ValueError as exc:
            raise RequestRejected(request_id, str(exc)) from None
        return request_id

    def _run(self, requests: list[GenerationRequest], use_tqdm: bool) -> list[RequestOutput]:
        ids = [f"llm-{next(self._ids)}" for _ in requests]
        named = [
            GenerationRequest(r.prompt, r.messages, r.params, request_id)
            for r, request_id in zip(requests, ids, strict=True)
        ]
        # Everything is queued at once: the scheduler admits as slots free up, as vLLM's generate() does.
        try:
            done = {
                out.request_id: out
                for out in self._stream(named, len(named) or 1, use_tqdm, len(named), deltas=False)
            }
        except RequestRejected as exc:
            raise ValueError(f"prompt {ids.index(exc.request_id)}: {exc.reason}") from None
        return [done[request_id] for request_id in ids]


def prompt_lengths(model: str, requests: Iterable[GenerationRequest]) -> list[int]:
    """The token count of each request's prompt as an engine over `model` (a folder, .gguf file or zoo
    name) will see it: chat messages through the chat template, text through the tokenizer. Loads only
    the tokenizer, so that a caller can size an engine's KV cache for its work (kv_cache_request_len)
    before the weights load. Raises ValueError as `LLM.stream` rejects a request (no chat template)."""
    import transformers

    from flyspec.assets import resolve_model
    from flyspec.models.tokenizer import load_tokenizer

    path = resolve_model(model)
    if path.is_dir():
        tokenizer = load_tokenizer(path)
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    lengths = []
    for request in requests:
        if request.messages is not None:
            lengths.append(len(render_chat(tokenizer, request.messages)[0]))
        elif isinstance(request.prompt, str):
            lengths.append(len(tokenizer(request.prompt).input_ids))
        else:
            lengths.append(len(request.prompt or ()))
    return lengths


def _is_prompts(value: object) -> bool:
    """A text prompt, a token-id list, or a list of either (rather than GenerationRequest items)."""
    if isinstance(value, str):
        return True
    if not isinstance(value, list | tuple) or not value:
        return False
    return all(is_int(v) for v in value) or all(
        isinstance(v, str) or (isinstance(v, list) and all(isinstance(t, int) for t in v)) for v in value
    )


def _prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    """One prompt (text or token ids) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, str) or (
        isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _delta(out: RequestOutput, seen: dict[str, dict[int, tuple[int, int]]]) -> RequestOutput:
    """`out` (cumulative) cut to what is new since the last delta of its request; `seen` remembers, per
    request and sample, how many tokens and characters were already handed out."""
    first = out.request_id not in seen
    done = seen.setdefault(out.request_id, {})
    outputs = []
    for o in out.outputs:
        tokens, chars = done.get(o.index, (0, 0))
        logprobs = o.logprobs[tokens:] if o.logprobs is not None else None
        outputs.append(replace(o, text=o.text[chars:], token_ids=o.token_ids[tokens:], logprobs=logprobs))
        done[o.index] = (len(o.token_ids), len(o.text))
    if out.finished:
        del seen[out.request_id]
    return replace(out, outputs=outputs, prompt_logprobs=out.prompt_logprobs if first else None)


def _per_prompt(sampling_params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling_params for {n} prompts; pass one, or one per prompt")
    return params


class _Bar:
    """Finished requests and output tokens/s on a rich progress bar (stderr keeps stdout for results)."""

    def __init__(self, progress: Progress | None, total: int | None) -> None:
        self.progress = progress
        self.tokens = 0
        self.task = progress.add_task("generate", total=total, speed="") if progress is not None else None

    def advance(self, num_tokens: int) -> None:
        if self.progress is None or self.task is None:
            return
        self.tokens += num_tokens
        elapsed = self.progress.tasks[0].elapsed or 0.0
        speed = f"{self.tokens / elapsed:.1f} tok/s" if elapsed > 0 else ""
        self.progress.update(self.task, advance=1, speed=speed)


@contextmanager
def _progress(enabled: bool, total: int | None) -> Iterator[_Bar]:
    if not enabled:
        yield _Bar(None, total)
        return
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    speed = TextColumn("{task.fields[speed]}")
    with Progress(*columns, speed, console=Console(stderr=True), transient=True) as progress:
        yield _Bar(progress, total)
