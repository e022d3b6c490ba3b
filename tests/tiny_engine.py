"""Driving an `LLMEngine` in tests: build one over a checkpoint, and run prompts to completion.

The engine tests drive `LLMEngine` directly (add requests, step) rather than through `LLM`, because
they look at what happens between steps. These are the one copy of that loop: `engine(...)` builds an
engine in float32 (the tiny checkpoints' dtype, so results do not depend on bf16 rounding), `finish`
steps until nothing is left, `run` adds prompts then finishes them, `ids` takes each output's tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from flyspec.config import EngineConfig
from flyspec.engine.engine import LLMEngine
from flyspec.outputs import RequestOutput
from flyspec.sampling_params import SamplingParams


def engine(model: str, spec: dict[str, Any] | None = None, **kwargs: Any) -> LLMEngine:
    """An engine over checkpoint `model` in float32; `spec` is the speculative_config, `kwargs` the
    other EngineConfig fields."""
    return LLMEngine(EngineConfig(model=model, speculative_config=spec, dtype="float32", **kwargs))


def finish(eng: LLMEngine, each_step: Callable[[LLMEngine], None] | None = None) -> dict[str, RequestOutput]:
    """Step until no request is left; the final output of every request that finished, by id.
    `each_step(eng)` runs after every step (to watch the engine between steps)."""
    final: dict[str, RequestOutput] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        if each_step is not None:
            each_step(eng)
    return final


def run(
    eng: LLMEngine,
    prompts: Sequence[str | list[int]],
    params: SamplingParams | Sequence[SamplingParams],
    *,
    each_step: Callable[[LLMEngine], None] | None = None,
) -> list[RequestOutput]:
    """Add every prompt (ids r0, r1, ...; one SamplingParams for all or one per prompt), step to
    completion, and return the final outputs in prompt order."""
    per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    for i, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
        eng.add_request(f"r{i}", prompt, p)
    final = finish(eng, each_step)
    return [final[f"r{i}"] for i in range(len(prompts))]


def ids(outs: Sequence[RequestOutput]) -> list[list[int]]:
    """The token ids of each output's first sample."""
    return [o.outputs[0].token_ids for o in outs]
