"""The main job's design (``flyspec demo``; docs/gate.md, "The demo: `flyspec demo`"): its arms, its
registered design and the words said before the first answer.

Three arms share one engine and one baseline (flyspec/gate/arms/engine.py), their requests in the same
batches, the three answers of a question side by side:

- the **baseline**, lossless: standard speculative decoding (drafts verified exactly: the target's own
  distribution, greedy outputs identical to the target alone's) at FLy's K, so that FLy's speed is
  measured against the method it replaces, in the same batches;
- a **control** the gate must catch: the draft model's own answers (``verification="draft_only"``), the
  limit of lossy verification where every draft token is accepted. It is cheap (only the small model
  runs) and clearly worse, so the gate should FAIL it within minutes; once it has, its requests in
  flight are cancelled and their slots go to FLy;
- **FLy**, the comparison the user came for, at the setting chosen from measurements on this pair
  (docs/verification.md, "FLy on the demo's pair"): FLY_SETTING.

Both comparisons share alpha (Bonferroni: the control gets CONTROL_ALPHA, FLy the rest, so the chance of
any wrong decision stays at most ALPHA). FLy's margin and question pool are registered before the first
answer, chosen by simulating the registered design (docs/statistics.md, "Questions to a decision") at the flip
rate FLy's setting showed on this pair and no true loss: the narrowest margin that GSM8K decides in nine
runs of ten, with MATH-500 added only where GSM8K alone is too small for it (its answers are longer, so
each of its questions costs more). A 2-point margin needs thousands of questions more than the two sets
hold; the demo says so at its start, with what would reach it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flyspec.gate.stats.sizing import Design, DesignOutcome, design_outcome

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DATASETS = ("gsm8k", "math500")
"""The default pool, in the order the design takes them: GSM8K, then MATH-500 where the design needs it."""
ALPHA = 0.025
CONTROL_ALPHA = 0.005
"""The control's share of alpha: a fifth. It is expected to lose far more than the margin, where a
smaller alpha costs few questions (the betting sequence's threshold grows like log(1 / alpha))."""
CONTROL_MARGIN = 0.02
"""The control is tested at the 2-point margin users ask about: catching a loss beyond 2 points is the
claim the demo shows the gate making."""
CONTROL_PRIOR = (0.35, -0.25)
"""The control's expected flip rate and net difference (the 0.5B against the 1.5B on GSM8K), for its
forecast only; the decision never uses it."""
MARGINS = (0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.10)
DECIDE_SHARE = 0.9
"""A margin is reachable when this share of simulated runs decides within the pool."""
TOKENS_PER_ANSWER = 300
"""Mean answer length of the 1.5B target on GSM8K at max_tokens 512 (295 in the measurements behind
FLY_SETTING)."""
GPU_TOKENS_PER_S = 3000.0
"""An assumed serving rate for a GPU endpoint running FLy (vLLM) on a model of this size; not measured
here (no GPU on the machines this project runs on), used only for the 'what it takes' arithmetic."""


@dataclass(frozen=True)
class FlySetting:
    """The FLy candidate: K draft tokens, the window (None: vLLM's default min(6, K - 1)) and the entropy
    threshold, with the share of questions it flipped against the lossless baseline on this pair (the
    prior that sizes the margin before any answer of a run)."""

    num_speculative_tokens: int
    window_size: int | None
    entropy_threshold: float
    flip_rate: float

    def fields(self) -> dict[str, Any]:
        """Its speculative_config fields besides the method and the draft model."""
        out: dict[str, Any] = {"num_speculative_tokens": self.num_speculative_tokens}
        if self.window_size is not None:
            out["fly_window_size"] = self.window_size
        if self.entropy_threshold != 0.3:
            out["fly_entropy_threshold"] = self.entropy_threshold
        return out

    def label(self) -> str:
        """E.g. 'K=8, W=6, theta 0.6'."""
        w = self.window_size if self.window_size is not None else min(6, self.num_speculative_tokens - 1)
        return f"K={self.num_speculative_tokens}, W={w}, theta {self.entropy_threshold:g}"


FLY_SETTING = FlySetting(num_speculative_tokens=8, window_size=6, entropy_threshold=0.6, flip_rate=0.15)
"""FLy's setting in the demo, from the measured table in docs/verification.md ("FLy on the demo's pair"):
of the four settings measured on 150 GSM8K questions, the fewest flips (23 of 150) with one of the two
largest speed gains over standard speculative decoding in the same batches; the authors' K and window."""
PRIOR_FLIP_RATE = FLY_SETTING.flip_rate


def demo_arms(
    target: str,
    draft: str,
    num_speculative_tokens: int,
    dtype: str,
    max_num_seqs: int,
    quantization: str | None = "auto",
    *,
    batch_invariant: bool = False,
    window_size: int | None = None,
    entropy_threshold: float = 0.3,
) -> dict[str, dict[str, Any]]:
    """The baseline (standard speculative decoding), the control (the draft model alone) and FLy: one
    engine configuration (same models, K, dtype, weights) so that all three share one engine and its
    batches; only who decodes and how drafts are verified differ."""
    fly = FlySetting(num_speculative_tokens, window_size, entropy_threshold, PRIOR_FLIP_RATE)

    def arm(method: str, mode: str | None) -> dict[str, Any]:
        spec: dict[str, Any] = {"method": "draft_model", "model": draft, "rejection_sample_method": method}
        spec.update(fly.fields() if method == "fly" else {"num_speculative_tokens": num_speculative_tokens})
        out: dict[str, Any] = {
            "quantization": quantization,
            "kind": "engine",
            "model": target,
            "speculative_config": spec,
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
    """FLy's registered margin, the pool (its datasets and size), and what the simulated design expects
    (no true effect, at ``flip_rate``); ``two_points``: the same design at a 2-point margin without a
    question limit."""

    margin: float
    pool: int
    flip_rate: float
    outcome: DesignOutcome
    two_points: DesignOutcome
    two_points_questions: int
    datasets: tuple[str, ...] = field(default=DATASETS)


def choose_margin(
    pool: int | list[tuple[tuple[str, ...], int]],
    flip_rate: float = PRIOR_FLIP_RATE,
    alpha: float = ALPHA - CONTROL_ALPHA,
    margin: float | None = None,
) -> MarginChoice:
    """The narrowest margin of MARGINS whose sequential design decides in at least DECIDE_SHARE of
    simulated runs at ``flip_rate`` with no true effect (the widest margin when none does), or ``margin``
    when the user gave one; with the design's simulated outlook either way. ``pool`` is a number of
    questions, or growing pools [(datasets, size), ...] tried in order for each margin: the first pool
    that decides it is registered (MATH-500 joins GSM8K only when GSM8K alone cannot decide that margin)."""
    pools = [((), pool)] if isinstance(pool, int) else pool
    outcome, chosen = None, pools[-1]
    for m in (margin,) if margin is not None else MARGINS:
        for datasets, size in pools:
            outcome = design_outcome(Design("sequential", size), flip_rate, m, alpha)
            chosen = (datasets, size)
            if 1.0 - outcome.undecided >= DECIDE_SHARE:
                break
        if 1.0 - outcome.undecided >= DECIDE_SHARE:
            break
    assert outcome is not None and m is not None
    unlimited = 100_000
    two = design_outcome(Design("sequential", unlimited), flip_rate, 0.02, alpha, runs=200)
    datasets = chosen[0] or DATASETS
    return MarginChoice(m, chosen[1], flip_rate, outcome, two, unlimited, datasets)


def control_outlook(pool: int) -> DesignOutcome:
    """The control's simulated questions to a decision at its expected effect (CONTROL_PRIOR)."""
    flip_rate, delta = CONTROL_PRIOR
    return design_outcome(Design("sequential", pool), flip_rate, CONTROL_MARGIN, CONTROL_ALPHA, delta)


def pool_words(datasets: tuple[str, ...]) -> str:
    """The question sets in words, e.g. 'GSM8K and MATH-500' (a file by its name without the suffix)."""
    known = {"gsm8k": "GSM8K", "math500": "MATH-500"}
    names = [known.get(d, Path(d).stem) for d in datasets]
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
    choice: MarginChoice, control: DesignOutcome, datasets: tuple[str, ...] | None = None, fly: str = ""
) -> list[str]:
    """What the demo says before anything loads: the registered design of both comparisons, the simulated
    questions to each decision and what a 2-point margin would take (``timing_line`` adds the time on
    this machine once the engine is up). ``datasets``: the pool's (default: the choice's); ``fly``: the
    setting's label."""
    datasets = datasets or choice.datasets
    m = f"{100 * choice.margin:g}"
    o, two = choice.outcome, choice.two_points
    gpu_per_minute = GPU_TOKENS_PER_S * 60 / (2 * TOKENS_PER_ANSWER)
    setting = f" ({fly})" if fly else ""
    lines = [
        f"flyspec demo: FLy{setting}, which is lossy, against lossless decoding of the same target, on "
        f"{pool_words(datasets)} ({choice.pool:,} questions in one seeded random order).",
        f"Registered before the first answer: FLy's margin {m} points at alpha {ALPHA - CONTROL_ALPHA:g}; a "
        f"control, the draft model's own answers, at a {100 * CONTROL_MARGIN:g}-point margin and alpha "
        f"{CONTROL_ALPHA:g} (together at most {ALPHA:g}). The claim is about the method on questions like "
        "these (questions and outputs as random draws), not about one run's outputs.",
        f"Control: the gate must FAIL it. Simulated at {100 * CONTROL_PRIOR[0]:.0f}% flips and a "
        f"{-100 * CONTROL_PRIOR[1]:.0f}-point loss, it FAILs after {_count(control.median)} questions in "
        f"half the runs, {_count(control.q90)} in 90%.",
        f"FLy: simulated at {100 * choice.flip_rate:.0f}% of questions flipping (--flip-rate; this setting "
        f"flipped {100 * PRIOR_FLIP_RATE:.0f}% on this pair when measured) and no true loss, the {m}-point "
        f"design decides after a median of {_count(o.median)} questions (90% of runs by {_by(o.q90)}). "
        "`flyspec demo --until-decided` runs on until then (it survives a kill: rerun to continue).",
    ]
    if choice.margin > 0.02:
        hold = "holds" if len(datasets) == 1 else "hold"
        lines.append(
            f"A 2-point margin is out of reach here: it needs a median of {_count(two.median)} questions "
            f"(90% by {_count(two.q90)}), more than {pool_words(datasets)} {hold} ({choice.pool:,}). It "
            "would take more questions (your own traffic), or a GPU endpoint serving FLy: at an assumed "
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


@dataclass(frozen=True)
class DemoSettings:
    """What `flyspec demo` was asked for (docs/gate.md, "The demo: `flyspec demo`")."""

    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    fly: FlySetting = FLY_SETTING
    datasets: tuple[str, ...] | None = None
    """None: GSM8K, then MATH-500 where the design needs it; else exactly these."""
    max_questions: int | None = None
    margin: float | None = None
    flip_rate: float | None = None
    max_tokens: int = 512
    max_num_seqs: int = 32
    dtype: str = "bfloat16"
    quantization: str | None = "auto"
    batch_invariant: bool = False
    seed: int = 0
    store: Path = Path("flyspec-demo.db")

    def arms(self) -> dict[str, dict[str, Any]]:
        """The three arms."""
        return demo_arms(
            self.target, self.draft, self.fly.num_speculative_tokens, self.dtype, self.max_num_seqs,
            self.quantization, batch_invariant=self.batch_invariant,
            window_size=self.fly.window_size, entropy_threshold=self.fly.entropy_threshold,
        )  # fmt: skip

    def run_id(self, choice: MarginChoice) -> str:
        """The run's name in the store: every registered setting is part of it, so the same command resumes
        and another one starts a new run. Runs of earlier versions (FLy at vLLM's defaults, both datasets)
        keep their names."""
        size = self.max_questions if self.max_questions is not None else "all"
        k = self.fly.num_speculative_tokens
        settings = f"n{size}-k{k}-t{self.max_tokens}-m{choice.margin:g}-s{self.seed}"
        if self.fly.window_size is not None:
            settings += f"-w{self.fly.window_size}"
        if self.fly.entropy_threshold != 0.3:
            settings += f"-th{self.fly.entropy_threshold:g}"
        if self.quantization is not None:
            settings += f"-{self.quantization}"
        if self.batch_invariant:
            settings += "-bi"
        if choice.datasets != DATASETS:
            settings += "-" + "+".join(Path(d).stem for d in choice.datasets)
        return f"demo-3arm-seq-{settings}-{Path(self.target).name}"

    def pools(self) -> list[tuple[tuple[str, ...], int]]:
        """The pools the margin is chosen over: GSM8K, then GSM8K and MATH-500; or the given datasets."""
        from flyspec.gate.data.questions import load_dataset

        if self.datasets:
            return [(self.datasets, sum(len(load_dataset(d)) for d in self.datasets))]
        sizes = [len(load_dataset(d)) for d in DATASETS]
        return [(DATASETS[:1], sizes[0]), (DATASETS, sum(sizes))]

    def choose(self) -> MarginChoice:
        """FLy's registered margin and pool (before anything loads)."""
        return choose_margin(self.pools(), self.flip_rate or self.fly.flip_rate, margin=self.margin)


def start(settings: DemoSettings, choice: MarginChoice) -> float:
    """Load the engine the three arms share (the run takes it over), its KV cache sized for the pool's
    longest prompt plus max_tokens, and return the questions a minute it answers here, all three arms
    together (``probe_rate``)."""
    from flyspec.gate import load_dataset
    from flyspec.gate.arms import parse_arm
    from flyspec.gate.arms.engine import preload

    arms = settings.arms()
    questions = [q for name in choice.datasets for q in load_dataset(name)]
    llm = preload([parse_arm(n, arm) for n, arm in arms.items()], questions, settings.max_tokens)
    return probe_rate(llm, {name: arm.get("verification") for name, arm in arms.items()})


def gate_options(
    settings: DemoSettings,
    choice: MarginChoice,
    max_minutes: float | None,
    progress: bool,
) -> Any:
    """The gate run of the demo: the three arms, FLy's margin and alpha, the control's, sequential over the
    chosen pool in one seeded order."""
    from flyspec.gate import GateOptions

    arms = settings.arms()
    return GateOptions(
        settings.store, choice.datasets, arms["baseline"], choice.margin, arms["candidate"], alpha=ALPHA,
        controls={"control": arms["control"]}, control_alpha=CONTROL_ALPHA, control_margin=CONTROL_MARGIN,
        sequential=True, max_questions=settings.max_questions, max_minutes=max_minutes,
        max_tokens=settings.max_tokens, seed=settings.seed, run_id=settings.run_id(choice),
        progress=progress,
    )  # fmt: skip
