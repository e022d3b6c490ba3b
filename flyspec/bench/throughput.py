"""`flyspec bench` as functions: the sweep's settings (a preset with options applied), its arms, and the
run that measures them (throughput of target-only, standard and lossy decoding, optionally against a
peer, with the step breakdown), returning the report (`BenchReport`, layout in flyspec.bench.report).

Settings are validated and the arms planned before torch is imported or any weights load.
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flyspec.bench.sweep import Arm, plan_arms

if TYPE_CHECKING:
    from flyspec.bench.report import BenchReport, BenchRow

DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

OnProgress = Callable[[str, int], None]
"""Called before each step of a run with its label and the number of steps in all."""


@dataclass(frozen=True)
class Settings:
    """A fully resolved sweep (preset values with explicit options applied). `methods`: target, standard
    and lossy policies at their defaults; `policies`: more lossy settings, the fragments of a
    `--policies` grid (flyspec/policy_grid.py)."""

    model: str = DEFAULT_MODEL
    drafters: tuple[str, ...] = (DEFAULT_DRAFT,)
    methods: tuple[str, ...] = ("target", "standard", "fly")
    batch_sizes: tuple[int, ...] = (1,)
    ks: tuple[int, ...] = (4,)
    headline_k: int = 4
    policies: tuple[dict[str, Any], ...] = ()
    lossless_prefixes: tuple[int, ...] = (0,)
    peer: str | None = None
    dataset: str = "gsm8k"
    num_prompts: int = 4
    max_tokens: int = 128
    repeats: int = 1
    warmup_tokens: int = 16
    breakdown: bool = False
    ignore_eos: bool = True
    dtype: str = "auto"
    device: str = "cpu"
    seed: int = 0
    threads: int | None = None
    quantizations: tuple[str | None, ...] = (None,)


PRESETS = {
    "quick": Settings(),
    # What BENCHMARKS.md shows: both weight formats at the batch sizes the gate and the server use, K=2
    # (best at batch 1 before) and 4 (the demo's), about 35 minutes on 2 idle cores. Wider sweeps (K up
    # to 6, more batch sizes, FLy windows) are a matter of options.
    "reference": Settings(
        batch_sizes=(1, 16, 32),
        quantizations=(None, "int8"),
        ks=(2, 4),
        peer="hf",
        breakdown=True,
    ),
}


def resolve_settings(preset: str, overrides: dict[str, Any]) -> Settings:
    """The preset with every override that is not None applied (``peer="none"``: no peer); a ``ks``
    override without the headline K moves the headline to its first value; ``policies`` without
    ``methods`` measures target-only, standard and the grid's settings. ValueError names a bad one."""
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r}: must be one of {', '.join(PRESETS)}")
    for name in ("num_prompts", "max_tokens", "repeats", "headline_k", "threads", "warmup_tokens"):
        value = overrides.get(name)
        if value is not None and value < 1:
            raise ValueError(f"{name}={value}: must be >= 1")
    given = {k: v for k, v in overrides.items() if v is not None}
    if given.get("policies") and "methods" not in given:
        given["methods"] = ("target", "standard")
    if isinstance(given.get("peer"), str) and given["peer"].lower() == "none":
        given["peer"] = None
    settings = replace(PRESETS[preset], **given)
    if "ks" in given and "headline_k" not in given and settings.headline_k not in settings.ks:
        settings = replace(settings, headline_k=settings.ks[0])
    return settings


def plan(settings: Settings) -> list[Arm]:
    """The sweep's arms (see flyspec.bench.sweep for the rule)."""
    return plan_arms(
        methods=settings.methods,
        batch_sizes=settings.batch_sizes,
        ks=settings.ks,
        headline_k=settings.headline_k,
        drafters=settings.drafters,
        peer=settings.peer,
        policies=settings.policies,
        quantizations=settings.quantizations,
        lossless_prefixes=settings.lossless_prefixes,
    )


def run_bench(
    settings: Settings, arms: list[Arm], command: str, on_progress: OnProgress = lambda label, total: None
) -> BenchReport:
    """Run the planned sweep (``plan(settings)``) and return its report; ``command`` is recorded in it."""
    from flyspec.bench import report as rep
    from flyspec.bench.machine import describe_machine
    from flyspec.bench.prompts import load_prompts, waves
    from flyspec.bench.runner import BenchRunner, run_interleaved

    if settings.threads is not None:
        import torch

        torch.set_num_threads(settings.threads)
    machine = describe_machine(settings.device)
    runner = BenchRunner(
        settings.model,
        arms,
        dtype=settings.dtype,
        device=settings.device,
        ignore_eos=settings.ignore_eos,
        seed=settings.seed,
    )
    largest = max(a.batch_size for a in arms)
    prompts = load_prompts(settings.dataset, max(settings.num_prompts, largest), runner.tokenizer)
    arm_waves = {a.label: waves(prompts, settings.num_prompts, a.batch_size) for a in arms}
    profiled = _breakdown_arms(settings, arms) if settings.breakdown else []
    total = len(arms) * (1 + settings.repeats) + len(profiled)
    results = run_interleaved(
        runner,
        arms,
        arm_waves,
        max_tokens=settings.max_tokens,
        repeats=settings.repeats,
        warmup_tokens=settings.warmup_tokens,
        on_progress=lambda label: on_progress(label, total),
    )
    breakdowns = _breakdowns(runner, profiled, prompts[0].token_ids, settings, total, on_progress)
    requests = {label: sum(len(w) for w in arm_waves[label]) for label in arm_waves}
    machine["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    rows = _rows(arms, results, requests)
    headline_drafter = settings.drafters[0] if settings.drafters else None
    return rep.BenchReport(
        command=command,
        finished_at=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        machine=machine,
        settings=_settings_json(settings, prompts, runner),
        results=rows,
        ratios=rep.ratios(rows),
        batch_scaling=rep.batch_scaling(rows, drafter=headline_drafter, headline_k=settings.headline_k),
        breakdown=breakdowns,
        # ru_maxrss is in KiB on Linux.
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        load_s=runner.load_seconds,
    )


def _rows(arms: list[Arm], results: dict[str, list[Any]], requests: dict[str, int]) -> list[BenchRow]:
    """Each arm's row, its outputs compared with the batch-1 target-only arm's."""
    from flyspec.bench.report import summarise

    reference_label = next(
        (a.label for a in arms if a.backend == "flyspec" and a.method == "target" and a.batch_size == 1), None
    )
    reference = results[reference_label][0].outputs if reference_label and results[reference_label] else None
    return [summarise(a, results[a.label], requests[a.label], reference) for a in arms]


def _breakdowns(
    runner: Any,
    arms: list[Arm],
    prompt_ids: list[int],
    settings: Settings,
    total: int,
    on_progress: OnProgress,
) -> dict[str, dict[str, Any]]:
    """label -> step breakdown of each profiled arm (flyspec.bench.breakdown)."""
    from flyspec.bench.breakdown import step_breakdown

    out = {}
    for arm in arms:
        on_progress(f"breakdown: {arm.label}", total)
        params = runner.sampling_params(arm, settings.max_tokens)
        out[arm.label] = step_breakdown(runner.engine_for(arm), prompt_ids, params)
    return out


def _settings_json(settings: Settings, prompts: list[Any], runner: Any) -> dict[str, Any]:
    """The report's `settings` object: the resolved sweep plus the prompts and weight dtype it used."""
    from flyspec.bench.prompts import prompts_sha256

    return {
        "model": settings.model,
        "drafters": list(settings.drafters),
        "methods": list(settings.methods),
        "batch_sizes": list(settings.batch_sizes),
        "ks": list(settings.ks),
        "headline_k": settings.headline_k,
        "policies": list(settings.policies),
        "lossless_prefixes": list(settings.lossless_prefixes),
        "peer": settings.peer,
        "dataset": settings.dataset,
        "num_prompts": settings.num_prompts,
        "prompt_ids": [p.id for p in prompts],
        "prompts_sha256": prompts_sha256(prompts),
        "max_tokens": settings.max_tokens,
        "repeats": settings.repeats,
        "warmup_tokens": settings.warmup_tokens,
        "ignore_eos": settings.ignore_eos,
        "dtype": settings.dtype,
        "weight_dtype": str(runner.target_dtype).removeprefix("torch."),
        "device": settings.device,
        "seed": settings.seed,
        "threads": settings.threads,
        "quantizations": list(settings.quantizations),
    }


def _breakdown_arms(settings: Settings, arms: list[Arm]) -> list[Arm]:
    """Batch-1 flyspec arms to profile: target-only, and standard and each lossy policy at its defaults
    (no prefix) at the headline K with the first drafter."""
    drafter = settings.drafters[0] if settings.drafters else None
    picked = []
    for arm in arms:
        if arm.backend != "flyspec" or arm.batch_size != 1:
            continue
        default = arm.method == "standard" or arm.at_defaults
        if arm.method == "target" or (arm.k == settings.headline_k and arm.drafter == drafter and default):
            picked.append(arm)
    return picked


def load_report(path: Path) -> BenchReport:
    """A report saved by `--json`; ValueError when the file is not one."""
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"--from-json {path}: not valid JSON ({exc})") from exc
    from flyspec.bench.report import READABLE_SCHEMAS, BenchReport

    if not isinstance(report, dict) or report.get("schema") not in READABLE_SCHEMAS:
        schemas = " or ".join(repr(schema) for schema in READABLE_SCHEMAS)
        raise ValueError(f"--from-json {path}: not a flyspec bench report (schema {schemas})")
    return BenchReport.from_dict(report)


def read_analysis(path: Path | None) -> str | None:
    """The text of a --analysis file (None without one); ValueError when it does not exist."""
    if path is None:
        return None
    if not path.is_file():
        raise ValueError(f"--analysis {path}: no such file")
    return path.read_text()
