"""Where a decode step's time goes: target forward, draft forward, verify(), and the rest of the engine.

One extra, untimed-for-throughput generation per selected arm runs with wall-clock timers around the
engine's parts: the target and draft `ModelRunner.forward` calls (weights, attention, lm_head and their
input building), the `verify` call, and each `LLMEngine.step`. "engine other" is step time not spent in
those (probabilities, sampling, bookkeeping, detokenisation, scheduling); "outside step" is the time
`LLM.generate` spends around the steps. The first step of the request (its prefill) is reported
separately, so the shares describe decode steps only.

The timers wrap instance attributes and the engine module's `verify` name for the duration of the run
and restore them afterwards; on CUDA each timer synchronises first so the times are real.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

PARTS = ("target_forward", "draft_forward", "verify", "engine_other", "outside_step")


def _sync(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.synchronize
    return lambda: None


@contextlib.contextmanager
def _patched(
    obj: Any, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
    original = getattr(obj, name)
    had_own = name in vars(obj)
    setattr(obj, name, wrapper(original))
    try:
        yield
    finally:
        if had_own:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


def step_breakdown(llm: Any, prompt_ids: list[int], params: Any, device: str = "cpu") -> dict[str, Any]:
    """Generate once for `prompt_ids` with timers on; seconds per part for decode steps, plus prefill.

    Returns {"decode_steps", "decode_tokens", "prefill_s", "decode_s", "<part>_s" for each of PARTS,
    "<part>_share" (of decode time), "ms_per_step" (part -> milliseconds per decode step)}.
    """
    import flyspec.engine.engine as engine_module

    engine = llm.engine
    sync = _sync(device)
    steps: list[dict[str, float]] = []

    def timed(part: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(fn)
            def inner(*args: Any, **kwargs: Any) -> Any:
                sync()
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    sync()
                    if steps:
                        steps[-1][part] = steps[-1].get(part, 0.0) + time.perf_counter() - start

            return inner

        return wrap

    def step_wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            steps.append({})
            sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            steps[-1]["step"] = time.perf_counter() - start
            return out

        return inner

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(engine, "step", step_wrap))
        stack.enter_context(_patched(engine.target, "forward", timed("target_forward")))
        if engine.draft is not None:
            stack.enter_context(_patched(engine.draft, "forward", timed("draft_forward")))
        stack.enter_context(_patched(engine_module, "verify", timed("verify")))
        sync()
        start = time.perf_counter()
        outs = llm.generate([prompt_ids], params, use_tqdm=False)
        sync()
        wall = time.perf_counter() - start
    generated = len(outs[0].outputs[0].token_ids)
    if len(steps) < 2:
        raise ValueError("the breakdown needs at least two engine steps (a prefill and a decode step)")
    prefill, decode = steps[0], steps[1:]
    total = {
        part: sum(s.get(part, 0.0) for s in decode) for part in ("target_forward", "draft_forward", "verify")
    }
    step_time = sum(s["step"] for s in decode)
    total["engine_other"] = step_time - sum(total.values())
    total["outside_step"] = wall - step_time - prefill["step"]
    decode_s = step_time + total["outside_step"]
    result: dict[str, Any] = {
        "decode_steps": len(decode),
        "decode_tokens": generated - 1,  # the prefill step samples the first token
        "prefill_s": prefill["step"],
        "decode_s": decode_s,
    }
    for part in PARTS:
        result[f"{part}_s"] = total[part]
        result[f"{part}_share"] = total[part] / decode_s if decode_s > 0 else 0.0
    result["ms_per_step"] = {part: 1000 * total[part] / len(decode) for part in PARTS}
    return result
