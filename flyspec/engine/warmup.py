"""The engine's warm-up: a few greedy tokens before real work, bounded in time.

The first steps of a fresh engine pay one-time costs (kernel primitives, allocations) that would be
charged to whatever is measured first. The warm-up also answers a question early: is this configuration
usable on this CPU at all? A demo once sat 15 minutes in an 8-token warm-up on a reference kernel, printing
nothing. Here the warm-up stops after `time_limit_s` (checked between engine steps) and says which faster
options exist, instead of leaving the user to wait.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from flyspec.cpuinfo import describe_cpu
from flyspec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from flyspec.config import EngineConfig
    from flyspec.outputs import RequestOutput

WARMUP_TOKENS = 8
WARMUP_TIME_LIMIT_S = 30.0
_PROMPT = "Hello"
_REQUEST_ID = "flyspec-warm-up"
_log = logging.getLogger("flyspec.load")


class TooSlowError(ValueError):
    """The warm-up did not finish within its time limit: this configuration is too slow on this CPU."""


class WarmUpEngine(Protocol):
    """What the warm-up uses of an engine: engine/engine.py's LLMEngine, named by its shape here because
    engine.py imports this module (LLMEngine.warm_up)."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def k(self) -> int: ...

    def has_unfinished_requests(self) -> bool: ...

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def abort_request(self, request_id: str) -> None: ...


def faster_options(engine: WarmUpEngine) -> list[str]:
    """What would make this engine faster, in the order worth trying."""
    config = engine.config
    options = []
    if config.quantization != "auto" and config.device == "cpu":
        options.append('quantization "auto" (the fastest weight format this CPU runs, measured at load)')
    if config.max_num_seqs > 8:
        options.append(f"a smaller max_num_seqs (now {config.max_num_seqs})")
    if engine.k > 2:
        options.append(f"fewer speculative tokens (now K={engine.k})")
    options.append("a smaller model")
    return options


def warm_up(
    engine: WarmUpEngine, *, max_tokens: int = WARMUP_TOKENS, time_limit_s: float = WARMUP_TIME_LIMIT_S
) -> float:
    """Generate `max_tokens` greedy tokens for a short prompt and return the seconds it took; raise
    TooSlowError (naming the faster options) when that takes longer than `time_limit_s`. The limit is
    checked between engine steps, so one step longer than the limit is finished first."""
    if engine.has_unfinished_requests():
        raise ValueError("warm_up() runs on an idle engine, before any request is added")
    _log.info("warm-up: %d tokens ...", max_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(_REQUEST_ID, _PROMPT, params)
    started = time.perf_counter()
    produced = 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == _REQUEST_ID:
                    produced = len(out.outputs[0].token_ids)
            elapsed = time.perf_counter() - started
            if elapsed > time_limit_s and engine.has_unfinished_requests():
                raise TooSlowError(
                    f"this CPU is too slow for this configuration: {produced} of {max_tokens} warm-up tokens "
                    f"took {elapsed:.0f} s (the limit is {time_limit_s:g} s) on {describe_cpu()}. "
                    f"Faster options: {'; '.join(faster_options(engine))} (docs/performance.md)"
                )
    finally:
        engine.abort_request(_REQUEST_ID)
    elapsed = time.perf_counter() - started
    _log.info("warm-up: %d tokens in %.1f s", produced, elapsed)
    return elapsed
