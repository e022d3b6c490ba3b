"""Where a decode step's time goes: target forward, draft forward, verify(), and the rest of the engine.

One extra, untimed-for-throughput generation per selected arm runs with the engine's own step timings on
(`LLM.profile_steps`, see flyspec/engine/timing.py): the target's and the draft model's
forward passes (weights, attention, lm_head and their input building), the `verify()` calls, and each
`LLMEngine.step`. "engine other" is step time not spent in those (probabilities, sampling, bookkeeping,
detokenisation, scheduling); "outside step" is the time `LLM.generate` spends around the steps. The first
step of the request (its prefill) is reported separately, so the shares describe decode steps only.
"""

from __future__ import annotations

from typing import Any

PARTS = ("target_forward", "draft_forward", "verify", "engine_other", "outside_step")


def step_breakdown(llm: Any, prompt_ids: list[int], params: Any) -> dict[str, Any]:
    """Generate once for `prompt_ids` with step timings on (`LLM.profile_steps`); seconds per part for
    decode steps, plus prefill.

    Returns {"decode_steps", "decode_tokens", "prefill_s", "decode_s", "<part>_s" for each of PARTS,
    "<part>_share" (of decode time), "ms_per_step" (part -> milliseconds per decode step)}.
    """
    profile = llm.profile_steps(prompt_ids, params)
    steps, wall = profile.steps, profile.wall_s
    generated = len(profile.output.outputs[0].token_ids)
    if len(steps) < 2:
        raise ValueError("the breakdown needs at least two engine steps (a prefill and a decode step)")
    prefill, decode = steps[0], steps[1:]
    total = {
        "target_forward": sum(s.target_forward_s for s in decode),
        "draft_forward": sum(s.draft_forward_s for s in decode),
        "verify": sum(s.verify_s for s in decode),
        "engine_other": sum(s.other_s for s in decode),
    }
    step_time = sum(s.step_s for s in decode)
    total["outside_step"] = wall - step_time - prefill.step_s
    decode_s = step_time + total["outside_step"]
    result: dict[str, Any] = {
        "decode_steps": len(decode),
        "decode_tokens": generated - 1,  # the prefill step samples the first token
        "prefill_s": prefill.step_s,
        "decode_s": decode_s,
    }
    for part in PARTS:
        result[f"{part}_s"] = total[part]
        result[f"{part}_share"] = total[part] / decode_s if decode_s > 0 else 0.0
    result["ms_per_step"] = {part: 1000 * total[part] / len(decode) for part in PARTS}
    return result
