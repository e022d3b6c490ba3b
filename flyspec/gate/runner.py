"""Run the paired gate: register, then answer every (arm, repeat, question) once, committing as it goes.

The order of work is what makes the numbers trustworthy:

1. everything is validated (margin, alpha, sampling, arms, datasets, reference answers) before the store
   is touched;
2. the run is registered (margin, alpha, arms, sampling, seed, dataset hashes, prompt hashes) before the
   first answer, and a resume with different settings is refused;
3. questions are answered in chunks, each chunk by every arm in turn, so that the two arms progress in
   step (an interrupted run still holds complete pairs) and each arm's speed is timed on the same
   questions at the same concurrency;
4. each answer is graded in the main thread and committed the moment it arrives.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from flyspec.gate.arms import Arm, Completion, Executor, Job, OpenAIArm, Sampling, make_executors, parse_arm
from flyspec.gate.datasets import Question, dataset_info, load_dataset
from flyspec.gate.graders import check_reference, grade
from flyspec.gate.store import AnswerRecord, GateStore, RegisteredQuestion


def question_seed(run_seed: int, dataset: str, question_id: str, repeat: int = 0) -> int:
    """Per-question seed: the same for every arm, so paired arms see the same randomness.

    Repeat 0 uses ``hash(run seed, question)``; a pilot's second pass (repeat 1) gets fresh seeds, so it
    measures how often sampling noise alone flips a question.
    """
    key = f"{run_seed}:{dataset}:{question_id}" + (f":{repeat}" if repeat else "")
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") & 0x7FFFFFFF


def _log(message: str) -> None:
    """Progress notes go to stderr, so that stdout carries only the report (and --json's last line)."""
    print(message, file=sys.stderr, flush=True)


def check_margin_alpha(margin: float, alpha: float) -> None:
    """Validate the pre-registered non-inferiority margin and one-sided alpha."""
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 < margin < 1:
        raise ValueError(
            f"margin={margin!r}: must lie in (0, 1); it is the tolerated accuracy loss as a fraction "
            "(0.02 = 2 points)"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < 0.5:
        raise ValueError(f"alpha={alpha!r}: must lie in (0, 0.5); it is the one-sided level (0.025 usual)")


def _load_questions(
    datasets: Sequence[str], limit: int | None, shuffle_seed: int
) -> dict[str, list[Question]]:
    if isinstance(datasets, str):
        datasets = [datasets]
    if not datasets:
        raise ValueError("datasets: give at least one dataset name or path")
    loaded: dict[str, list[Question]] = {}
    for spec in datasets:
        questions = load_dataset(spec, limit, shuffle_seed=shuffle_seed)
        name = questions[0].dataset
        if name in loaded:
            raise ValueError(
                f"two datasets are both named {name!r}; rename one file so reports can tell them apart"
            )
        for q in questions:
            try:
                check_reference(q.grader, q.answer)
            except ValueError as exc:
                raise ValueError(
                    f"dataset {name!r}, question {q.id!r}: bad reference answer: {exc}"
                ) from None
        loaded[name] = questions
    return loaded


class _Progress:
    """A rich progress bar on stderr: questions done, accuracy so far per lane, ETA."""

    def __init__(self, lanes: list[tuple[str, int]], total: int, done: int, enabled: bool) -> None:
        self.lanes = lanes
        self.right: dict[tuple[str, int], int] = defaultdict(int)
        self.count: dict[tuple[str, int], int] = defaultdict(int)
        self.bar = Progress(
            TextColumn("[bold]gate[/bold] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self.task = self.bar.add_task(self._text(), total=total, completed=done)

    def _label(self, lane: tuple[str, int]) -> str:
        arms = {arm for arm, _ in self.lanes}
        return lane[0] if len(arms) == len(self.lanes) else f"{lane[0]}#{lane[1]}"

    def _text(self) -> str:
        parts = []
        for lane in self.lanes:
            n = self.count[lane]
            acc = f"{100 * self.right[lane] / n:.1f}%" if n else "-"
            parts.append(f"{self._label(lane)} {acc}")
        return " | ".join(parts)

    def add(self, lane: tuple[str, int], correct: bool, *, advance: bool = True) -> None:
        self.count[lane] += 1
        self.right[lane] += int(correct)
        self.bar.update(self.task, advance=1 if advance else 0, description=self._text())

    def __enter__(self) -> _Progress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()


def _chunk_size(executors: list[Executor]) -> int:
    """Twice the largest arm's parallelism: batches stay full while the arms alternate often."""
    sizes = []
    for ex in executors:
        for arm in ex.arms.values():
            if isinstance(arm, OpenAIArm):
                sizes.append(2 * arm.concurrency * len(arm.base_urls))
            else:
                sizes.append(2 * int(arm.config["max_num_seqs"]))
    return max(sizes) if sizes else 1


def execute(
    store_path: str | Path,
    *,
    kind: str,
    run_id: str,
    arms: dict[str, Arm],
    repeats: Sequence[int],
    datasets: Sequence[str],
    margin: float,
    alpha: float,
    sampling: Sampling,
    seed: int,
    limit: int | None,
    shuffle_seed: int,
    chunk_size: int | None,
    progress: bool,
) -> str:
    """Register (or resume) a run and answer everything not yet stored; returns the run id."""
    check_margin_alpha(margin, alpha)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r}: must be an integer >= 0")
    if not isinstance(run_id, str) or not run_id.strip():
        raise ValueError(f"run={run_id!r}: must be a non-empty name")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size={chunk_size!r}: must be a positive integer")
    by_dataset = _load_questions(datasets, limit, shuffle_seed)
    questions = [q for qs in by_dataset.values() for q in qs]
    registration: dict[str, Any] = {
        "margin": float(margin),
        "alpha": float(alpha),
        "seed": seed,
        "sampling": {
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
        },
        "arms": {name: arm.identity() for name, arm in arms.items()},
        "repeats": list(repeats),
        "datasets": {
            name: {"sha256": dataset_info(spec).sha256, "questions": len(qs)}
            for spec, (name, qs) in zip(datasets, by_dataset.items(), strict=True)
        },
        "limit": limit,
        "shuffle_seed": shuffle_seed,
    }
    registered = [
        RegisteredQuestion(q.dataset, q.id, i, q.prompt_hash, q.answer, q.grader)
        for i, q in enumerate(questions)
    ]
    executors = make_executors(list(arms.values()))
    lanes = [(arm, r) for r in repeats for arm in arms]
    executor_of = {name: ex for ex in executors for name in ex.arms}

    with GateStore(store_path) as store:
        new = store.register(run_id, kind, registration, registered)
        # Where things ran may change on a resume (a moved file, a restarted server); keep the latest.
        store.update_notes(
            run_id,
            {
                "arm_settings": {name: arm.public_dict() for name, arm in arms.items()},
                "dataset_sources": dict(zip(by_dataset, datasets, strict=True)),
            },
        )
        shared = [sorted(ex.arms) for ex in executors if ex.shared]
        if shared:
            store.update_notes(
                run_id,
                {
                    "shared_engine": shared,
                    "shared_engine_note": "arms differing only in the verifier ran in one "
                    "FLy engine; the standard arm's requests used verification='standard' (lossless)",
                },
            )
        done_keys = store.answered_keys(run_id)
        total = len(lanes) * len(questions)
        _log(
            f"gate: run {run_id!r} {'registered' if new else 'resumed'} in {store.path} "
            f"({len(done_keys)} of {total} answers stored; margin {margin}, alpha {alpha})"
        )
        if len(done_keys) >= total:
            return run_id
        for ex in executors:
            _log(f"gate: starting {ex.describe()}")
            ex.prepare()

        size = chunk_size or _chunk_size(executors)
        with _Progress(lanes, total, len(done_keys), progress) as bar:
            for record in store.answers(run_id):
                bar.add((record.arm, record.repeat), record.correct, advance=False)

            batch_tokens = [0]  # completion tokens of the batch in flight (for its arm's tokens/s)

            def on_done(job: Job, completion: Completion) -> None:
                q = job.question
                g = grade(q.grader, completion.text, q.answer)
                acc = completion.acceptance
                store.add_answer(
                    run_id,
                    AnswerRecord(
                        arm=job.arm,
                        repeat=job.repeat,
                        dataset=q.dataset,
                        question_id=q.id,
                        seed=job.seed,
                        output=completion.text,
                        extracted=g.extracted,
                        correct=g.correct,
                        finish_reason=completion.finish_reason,
                        prompt_tokens=completion.prompt_tokens,
                        completion_tokens=completion.completion_tokens,
                        latency_s=completion.latency_s,
                        num_drafts=acc.get("num_drafts"),
                        num_draft_tokens=acc.get("num_draft_tokens"),
                        num_accepted_tokens=acc.get("num_accepted_tokens"),
                        num_forgiven_tokens=acc.get("num_forgiven_tokens"),
                        source=completion.source,
                    ),
                )
                batch_tokens[0] += completion.completion_tokens
                bar.add((job.arm, job.repeat), g.correct)

            for start in range(0, len(questions), size):
                chunk = questions[start : start + size]
                for arm, repeat in lanes:
                    jobs = [
                        Job(arm, repeat, q, question_seed(seed, q.dataset, q.id, repeat))
                        for q in chunk
                        if (arm, repeat, q.dataset, q.id) not in done_keys
                    ]
                    if not jobs:
                        continue
                    batch_tokens[0] = 0
                    t0 = time.perf_counter()
                    executor_of[arm].run(jobs, sampling, on_done)
                    store.add_batch(run_id, arm, repeat, len(jobs), batch_tokens[0], time.perf_counter() - t0)
    return run_id


def run_gate(
    store: str | Path,
    datasets: str | Sequence[str],
    baseline: dict[str, Any] | str,
    candidate: dict[str, Any] | str,
    margin: float,
    alpha: float = 0.025,
    *,
    limit: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_tokens: int = 512,
    seed: int = 0,
    run_id: str = "gate",
    shuffle_seed: int = 0,
    chunk_size: int | None = None,
    progress: bool = True,
) -> str:
    """Run (or resume) the paired gate of ``candidate`` against ``baseline``; returns the run id.

    Arms are dicts, JSON strings or JSON file paths (see flyspec.gate.arms). ``margin`` is the tolerated
    accuracy loss (0.02 = 2 points) and ``alpha`` the one-sided level; both are registered in the store
    before the first answer. Same prompts, per-question seeds and sampling for both arms.
    """
    check_margin_alpha(margin, alpha)
    arms = {"baseline": parse_arm("baseline", baseline), "candidate": parse_arm("candidate", candidate)}
    return execute(
        store,
        kind="gate",
        run_id=run_id,
        arms=arms,
        repeats=[0],
        datasets=[datasets] if isinstance(datasets, str) else list(datasets),
        margin=margin,
        alpha=alpha,
        sampling=Sampling(temperature, top_p, max_tokens),
        seed=seed,
        limit=limit,
        shuffle_seed=shuffle_seed,
        chunk_size=chunk_size,
        progress=progress,
    )


def run_pilot(
    store: str | Path,
    datasets: str | Sequence[str],
    baseline: dict[str, Any] | str,
    margin: float,
    alpha: float = 0.025,
    *,
    limit: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_tokens: int = 512,
    seed: int = 0,
    run_id: str = "pilot",
    shuffle_seed: int = 0,
    chunk_size: int | None = None,
    progress: bool = True,
) -> str:
    """Run the baseline arm twice (repeats 0 and 1, fresh seeds, nothing cached) to measure the flip rate
    that noise alone produces; returns the run id. ``build_report`` turns it into a sample-size plan."""
    check_margin_alpha(margin, alpha)
    arms = {"baseline": parse_arm("baseline", baseline)}
    return execute(
        store,
        kind="pilot",
        run_id=run_id,
        arms=arms,
        repeats=[0, 1],
        datasets=[datasets] if isinstance(datasets, str) else list(datasets),
        margin=margin,
        alpha=alpha,
        sampling=Sampling(temperature, top_p, max_tokens),
        seed=seed,
        limit=limit,
        shuffle_seed=shuffle_seed,
        chunk_size=chunk_size,
        progress=progress,
    )


def describe_interrupt(store_path: str | Path, run_id: str) -> str:
    """The line printed when a run is interrupted: how much is stored and how to resume."""
    with GateStore(store_path) as store:
        stored = len(store.answered_keys(run_id))
    return (
        f"interrupted: {stored} answers of run {run_id!r} are stored in {store_path}; "
        "rerun the same command to resume"
    )
