"""The settings of one gate run or pilot: one type for the CLI commands and the Python API.

``gate run``, ``gate pilot``, ``flyspec demo``, ``run_gate`` and ``run_pilot`` all build a ``GateOptions``
and hand it to ``flyspec.gate.run.runner.run``; every rule about which settings go together lives here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from flyspec.gate.arms.base import Sampling

ArmSpec = dict[str, Any] | str | Path
KINDS = ("gate", "pilot")


def check_margin_alpha(margin: float, alpha: float) -> None:
    """Validate the pre-registered non-inferiority margin and one-sided alpha."""
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 < margin < 1:
        raise ValueError(
            f"margin={margin!r}: must lie in (0, 1); it is the tolerated accuracy loss as a fraction "
            "(0.02 = 2 points)"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 < alpha < 0.5:
        raise ValueError(f"alpha={alpha!r}: must lie in (0, 0.5); it is the one-sided level (0.025 usual)")


def _check_count(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r}: must be a positive integer")


def _check_seed(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r}: must be an integer >= 0")


@dataclass(frozen=True)
class GateOptions:
    """One gate run (``kind="gate"``) or pilot (``kind="pilot"``).

    store: the SQLite file. datasets: names or paths. baseline / candidate: arms (dicts, JSON strings or
    JSON files; a pilot without a candidate runs the baseline twice). margin: tolerated accuracy loss
    (0.02 = 2 points); alpha: one-sided level. sequential: stop at the first crossing of an anytime-valid
    confidence sequence (gate runs only), over at most ``max_questions`` questions. max_minutes: a time
    budget for answering (a run stopped by it resumes on the next call). limit: the first N questions
    of each dataset's seeded order; max_questions: the first N of the interleaved order. order_seed:
    the question order (default: ``seed``, which also derives the per-question sampling seeds).
    exclude_runs: leave out the questions these runs of the store used (pilots are always left out of
    gate runs). judge: the judge endpoint of ``judge`` questions (flyspec/gate/grading/judge.py), as a
    dict, JSON string or JSON file.
    """

    store: str | Path
    datasets: tuple[str, ...]
    baseline: ArmSpec
    margin: float
    candidate: ArmSpec | None = None
    alpha: float = 0.025
    kind: str = "gate"
    sequential: bool = False
    max_questions: int | None = None
    max_minutes: float | None = None
    limit: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 512
    seed: int = 0
    order_seed: int | None = None
    run_id: str | None = None
    shuffle_seed: int = 0
    exclude_runs: tuple[str, ...] = field(default_factory=tuple)
    progress: bool = True
    judge: ArmSpec | None = None

    def __post_init__(self) -> None:
        datasets = (self.datasets,) if isinstance(self.datasets, str) else tuple(self.datasets)
        object.__setattr__(self, "datasets", datasets)
        object.__setattr__(self, "exclude_runs", tuple(self.exclude_runs))
        self._check()

    def _check(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r}: must be 'gate' or 'pilot'")
        if not self.datasets:
            raise ValueError("datasets: give at least one dataset name or path")
        check_margin_alpha(self.margin, self.alpha)
        self.sampling  # noqa: B018 - validates temperature, top_p and max_tokens
        _check_seed("seed", self.seed)
        if self.order_seed is not None:
            _check_seed("order_seed", self.order_seed)
        _check_seed("shuffle_seed", self.shuffle_seed)
        _check_count("limit", self.limit)
        _check_count("max_questions", self.max_questions)
        if self.max_minutes is not None and (
            isinstance(self.max_minutes, bool)
            or not isinstance(self.max_minutes, int | float)
            or not math.isfinite(self.max_minutes)
            or self.max_minutes <= 0
        ):
            raise ValueError(f"max_minutes={self.max_minutes!r}: must be a positive number of minutes")
        if self.run_id is not None and (not isinstance(self.run_id, str) or not self.run_id.strip()):
            raise ValueError(f"run={self.run_id!r}: must be a non-empty name")
        if self.kind == "gate" and self.candidate is None:
            raise ValueError("candidate: a gate run compares two arms; give --candidate")
        if self.sequential and self.kind != "gate":
            raise ValueError("sequential: only `gate run` is sequential; a pilot answers a fixed set")
        if self.sequential and self.limit is not None:
            raise ValueError(
                f"limit={self.limit}: a sequential run takes --max-questions (the first N of the seeded "
                "order over all datasets), not --limit"
            )

    @property
    def sampling(self) -> Sampling:
        """The sampling every arm uses."""
        return Sampling(self.temperature, self.top_p, self.max_tokens)

    @property
    def name(self) -> str:
        """The run's name in the store."""
        return self.run_id or self.kind

    @property
    def question_order_seed(self) -> int:
        """The seed of the question order."""
        return self.seed if self.order_seed is None else self.order_seed

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every field name (what a --config file may set)."""
        return tuple(f.name for f in fields(cls))
