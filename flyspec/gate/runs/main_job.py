"""The main job (``flyspec demo``, docs/gate.md): its arms, its registered design and the words around it.

Three arms share one engine and one baseline (flyspec/gate/arms/engine.py):

- the **baseline**, lossless: standard speculative decoding (the same draft model, drafts verified
  exactly: the target's own distribution), in the same batches as the others. Target-only requests
  (``verification="target_only"``) follow the same distribution too, but in the demo's mixed batch they
  cost more per token: a target-only request needs about three times the steps of a speculating one and
  holds its slot longer (0.74-0.91x the tokens per CPU second, measured on an AMX Xeon and with AVX2
  emulated; docs/performance.md), so the baseline speculates;
- a **control** the gate must catch: the draft model's own answers (``verification="draft_only"``), the
  limit of lossy verification where every draft token is accepted. It is cheap (only the small model
  runs) and clearly worse, so the gate should FAIL it within minutes: the demo shows that the gate
  decides, and which way, before it speaks of FLy;
- **FLy** (K=4, vLLM's defaults): the comparison the user came for.

Both comparisons share alpha (Bonferroni: the control gets CONTROL_ALPHA, FLy the rest, so the chance of
any wrong decision stays at most ALPHA). FLy's margin is registered before the first answer, chosen by
simulating the registered design (docs/gate.md, "Questions to a decision") at the flip rate FLy showed
in earlier demo runs and no true effect: the narrowest margin that GSM8K and MATH-500 together can decide
in nine runs of ten. A 2-point margin needs thousands of questions more than the two sets hold; the demo
says so at its start, with what would reach it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flyspec.gate.stats.designs import Design, DesignOutcome, design_outcome

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DATASETS = ("gsm8k", "math500")
ALPHA = 0.025
CONTROL_ALPHA = 0.005
"""The control's share of alpha: a fifth. It is expected to lose far more than the margin, where a
smaller alpha costs few questions (the betting sequence's threshold grows like log(1 / alpha))."""
CONTROL_MARGIN = 0.02
"""The control is tested at the 2-point margin users ask about: catching a loss beyond 2 points is the
claim the demo shows the gate making."""
PRIOR_FLIP_RATE = 0.16
"""FLy against standard speculative decoding, questions flipped per question in earlier demo runs of this
setting (11 of 69 on an Ice Lake Xeon, 2026-12-03). It fixes the margin before any answer of this run."""
CONTROL_PRIOR = (0.35, -0.25)
"""The control's expected flip rate and net difference (the 0.5B against the 1.5B on GSM8K), for its
forecast only; the decision never uses it."""
MARGINS = (0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.10)
DECIDE_SHARE = 0.9
"""A margin is reachable when this share of simulated runs decides within the pool."""
TOKENS_PER_ANSWER = 300
"""Mean answer length of the 1.5B target on GSM8K at max_tokens 512 (about 290 in earlier demo runs)."""
GPU_TOKENS_PER_S = 3000.0
"""An assumed serving rate for a GPU endpoint running FLy (vLLM) on a model of this size; not measured
here (no GPU on the machines this project runs on), used only for the 'what it takes' arithmetic."""


def demo_arms(
    target: str,
    draft: str,
    num_speculative_tokens: int,
    dtype: str,
    max_num_seqs: int,
    quantization: str | None = "auto",
    *,
    batch_invariant: bool = False,
) -> dict[str, dict[str, Any]]:
    """The baseline (standard speculative decoding), the control (the draft model alone) and FLy: one engine
    configuration (same models, K, dtype, weights) so that all three share one engine and its batches;
    only who decodes and how drafts are verified differ."""

    def arm(method: str, mode: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "quantization": quantization,
            "kind": "engine",
            "model": target,
            "speculative_config": {
                "method": "draft_model",
                "model": draft,
                "num_speculative_tokens": num_speculative_tokens,
                "rejection_sample_method": method,
            },
            "dtype": dtype,
            "max_num_seqs": max_num_seqs,
        }
        if batch_invariant:
            out["batch_invariant"] = True
        if mode is not None:
            out["verification"] = mode
        return out

    return {
        "baseline": arm("standard", None),
        "control": arm("standard", "draft_only"),
        "candidate": arm("fly", None),
    }


@dataclass(frozen=True)
class MarginChoice:
    """FLy's registered margin, the pool, and what the simulated design expects (no true effect, at
    ``flip_rate``); ``two_points``: the same design at a 2-point margin without a question limit."""

    margin: float
    pool: int
    flip_rate: float
    outcome: DesignOutcome
    two_points: DesignOutcome
    two_points_questions: int


def choose_margin(
    pool: int,
    flip_rate: float = PRIOR_FLIP_RATE,
    alpha: float = ALPHA - CONTROL_ALPHA,
    margin: float | None = None,
) -> MarginChoice:
    """The narrowest margin of MARGINS whose sequential design over ``pool`` questions decides in at least
    DECIDE_SHARE of simulated runs at ``flip_rate`` with no true effect (the widest margin when none does),
    or ``margin`` when the user gave one; with the design's simulated outlook either way."""
    outcome = None
    for m in (margin,) if margin is not None else MARGINS:
        outcome = design_outcome(Design("sequential", pool), flip_rate, m, alpha)
        if 1.0 - outcome.undecided >= DECIDE_SHARE:
            break
    assert outcome is not None and m is not None
    margin = m
    unlimited = 100_000
    two = design_outcome(Design("sequential", unlimited), flip_rate, 0.02, alpha, runs=200)
    return MarginChoice(margin, pool, flip_rate, outcome, two, unlimited)


def control_outlook(pool: int) -> DesignOutcome:
    """The control's simulated questions to a decision at its expected effect (CONTROL_PRIOR)."""
    flip_rate, delta = CONTROL_PRIOR
    return design_outcome(Design("sequential", pool), flip_rate, CONTROL_MARGIN, CONTROL_ALPHA, delta)


def _names(datasets: tuple[str, ...]) -> str:
    known = {"gsm8k": "GSM8K", "math500": "MATH-500"}
    names = [known.get(d, d) for d in datasets]
    return " and ".join(names) if len(names) < 3 else ", ".join(names[:-1]) + " and " + names[-1]


def _count(questions: int | None) -> str:
    return f"{questions:,}" if questions is not None else "more than the pool's"


def _by(questions: int | None) -> str:
    return _count(questions) if questions is not None else "the end of the pool"


def _hours(questions: int | None, per_minute: float | None) -> str:
    if questions is None:
        return "more time than the pool allows (most simulated runs did not decide within it)"
    if not per_minute:
        return "unknown"
    hours = questions / per_minute / 60
    return f"{hours * 60:.0f} minutes" if hours < 1 else f"{hours:.1f} hours"


def opening_lines(
    choice: MarginChoice, control: DesignOutcome, datasets: tuple[str, ...] = DATASETS
) -> list[str]:
    """What the demo says before anything loads: the registered design of both comparisons, the simulated
    questions to each decision and what a 2-point margin would take (``timing_line`` adds the time on
    this machine once the engine is up)."""
    m = f"{100 * choice.margin:g}"
    o, two = choice.outcome, choice.two_points
    gpu_per_minute = GPU_TOKENS_PER_S * 60 / (2 * TOKENS_PER_ANSWER)
    lines = [
        f"flyspec demo: FLy (lossy) against standard speculative decoding (lossless), on {_names(datasets)} "
        f"({choice.pool:,} questions in one seeded random order).",
        f"Registered before the first answer: FLy's margin {m} points at alpha {ALPHA - CONTROL_ALPHA:g}; a "
        f"control, the draft model's own answers, at a {100 * CONTROL_MARGIN:g}-point margin and alpha "
        f"{CONTROL_ALPHA:g} (together at most {ALPHA:g}). The claim is about the method on questions like "
        "these (questions and outputs as random draws), not about one run's outputs.",
        f"Control: the gate must FAIL it. Simulated at {100 * CONTROL_PRIOR[0]:.0f}% flips and a "
        f"{-100 * CONTROL_PRIOR[1]:.0f}-point loss, it FAILs after {_count(control.median)} questions in "
        f"half the runs, {_count(control.q90)} in 90%.",
        f"FLy: simulated at {100 * choice.flip_rate:.0f}% of questions flipping (--flip-rate; earlier demo "
        f"runs saw {100 * PRIOR_FLIP_RATE:.0f}%) and no true loss, the {m}-point design decides after a "
        f"median of {_count(o.median)} questions (90% of runs by {_by(o.q90)}). "
        "`flyspec demo --until-decided` runs on until then (it survives a kill: rerun to continue).",
    ]
    if choice.margin > 0.02:
        lines.append(
            f"A 2-point margin is out of reach here: it needs a median of {_count(two.median)} questions "
            f"(90% by {_count(two.q90)}), more than {_names(datasets)} hold ({choice.pool:,}). It would take "
            "more questions (your own traffic), or a GPU endpoint serving FLy: at an assumed "
            f"{GPU_TOKENS_PER_S:,.0f} output tokens/s (vLLM on one GPU; not measured here) that is about "
            f"{_hours(two.median, gpu_per_minute)}."
        )
    return lines


def timing_line(choice: MarginChoice, control: DesignOutcome, questions_per_minute: float) -> str:
    """The simulated questions to each decision as time on this machine, at the probed rate."""
    rate = questions_per_minute
    return (
        f"On this machine: about {rate:.1f} questions a minute (all three arms together, measured just "
        f"now), so the control's decision in about {_hours(control.median, rate)} and FLy's in about "
        f"{_hours(choice.outcome.median, rate)} (simulated medians; the progress line updates both from the "
        "answers as they come)."
    )


PROBE_TOKENS = 48
PROBE_PROMPT = (
    "A baker sells muffins for $3 each and cookies for $2 each. On Monday she sold 14 muffins and twice as "
    "many cookies. How much money did she make? Think step by step."
)


def probe_rate(llm: Any, modes: dict[str, str | None]) -> float:
    """Questions a minute this engine answers at the demo's batch, from a short probe: the batch filled
    with requests of every arm's mode side by side (``modes``: arm name -> verification), PROBE_TOKENS
    tokens each, then output tokens/s converted at TOKENS_PER_ANSWER tokens per answer and one answer per
    arm per question. A forecast aid only: nothing of it is stored or graded."""
    import time

    from flyspec.sampling_params import SamplingParams

    per_arm = max(1, llm.max_running // len(modes))
    params = [
        SamplingParams(temperature=0.0, max_tokens=PROBE_TOKENS, ignore_eos=True, verification=mode)
        for mode in modes.values()
        for _ in range(per_arm)
    ]
    started = time.perf_counter()
    outs = llm.generate([PROBE_PROMPT] * len(params), params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / seconds * 60 / (TOKENS_PER_ANSWER * len(modes))
