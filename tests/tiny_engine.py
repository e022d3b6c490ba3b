"""Driving an `LLMEngine` in tests: build one over a checkpoint, and run prompts to completion.

The engine tests drive `LLMEngine` directly (add requests, step) rather than through `LLM`, because
they look at what happens between steps. These are the one copy of that loop: `engine(...)` builds an
engine in float32 (the tiny checkpoints' dtype, so results do not depend on bf16 rounding), `finish`
steps until nothing is left, `run` adds prompts then finishes them, `ids` takes each output's tokens,
`greedy_differences` finds where an output left the target's greedy path, `noisy_pair` makes a
draft that disagrees with a real model.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers

from flyspec.config import EngineConfig
from flyspec.engine.engine import LLMEngine
from flyspec.models.loader import LoadedModel, load_model
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


def greedy_differences(model: str, outs: Sequence[RequestOutput]) -> list[list[int]]:
    """For each output, the positions where its tokens differ from the greedy choice of transformers'
    own copy of `model` given the prompt and the output so far: where a lossy verifier forgave a draft
    token, for greedy requests."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    differences = []
    for out in outs:
        prompt, gen = out.prompt_token_ids, out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + gen])).logits[0]
        greedy = logits[len(prompt) - 1 : -1].argmax(dim=-1).tolist()
        differences.append([j for j, (g, t) in enumerate(zip(greedy, gen, strict=True)) if g != t])
    return differences


def noisy_pair(folder: str, dtype: str, noise: float = 0.02) -> tuple[LoadedModel, LoadedModel]:
    """The model in `folder`, loaded, and an in-memory copy with `noise` times each weight tensor's std
    of Gaussian noise added (seed 0), as target and a draft that disagrees often (`LLM.from_config`)."""
    target = load_model(folder, dtype, "cpu")
    draft = copy.copy(target)
    draft.model = copy.deepcopy(target.model)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in draft.model.parameters():
            param.add_(noise * param.std() * torch.randn_like(param))
    return target, draft
