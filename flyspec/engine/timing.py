"""Opt-in per-step timings: where each engine step's wall time goes (read by `flyspec bench --breakdown`).

Off by default. Off, a timed region costs one attribute check on entry and one on exit, so the hot path
keeps no clock calls. On (`LLMEngine.record_step_timings()`), every `LLMEngine.step` appends one
`StepTiming`; on CUDA each boundary synchronises the device first, so the times are real rather than
launch times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter

import torch


@dataclass
class StepTiming:
    """Wall seconds of one engine step and of the parts inside it.

    target_forward_s / draft_forward_s: the target's and the draft model's `ModelRunner.forward` calls
    (weights, attention, lm_head, and building their inputs); verify_s: the `verify()` calls; other_s:
    everything else in the step (probabilities, sampling, drafting bookkeeping, detokenisation,
    scheduling).
    """

    step_s: float = 0.0
    target_forward_s: float = 0.0
    draft_forward_s: float = 0.0
    verify_s: float = 0.0

    @property
    def other_s(self) -> float:
        """Step time outside the timed parts."""
        return self.step_s - self.target_forward_s - self.draft_forward_s - self.verify_s


def _no_sync() -> None:
    return None


class StepClock:
    """The engine's record of step timings; `records` is None while recording is off."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.records: list[StepTiming] | None = None
        self.current: StepTiming | None = None
        cuda = torch.device(device).type == "cuda"
        self._sync: Callable[[], None] = torch.cuda.synchronize if cuda else _no_sync
        self._step_start = 0.0

    def start(self, enabled: bool = True) -> None:
        """Start recording with an empty list (or, with enabled=False, stop and drop the records)."""
        self.records = [] if enabled else None
        self.current = None

    def now(self) -> float:
        """perf_counter() after the device has finished its queued work."""
        self._sync()
        return perf_counter()

    def begin_step(self) -> None:
        """Open a new record (when recording)."""
        if self.records is not None:
            self.current = StepTiming()
            self._step_start = self.now()

    def end_step(self) -> None:
        """Close the open record and keep it."""
        if self.current is not None and self.records is not None:
            self.current.step_s = self.now() - self._step_start
            self.records.append(self.current)
            self.current = None

    def part(self, field: str) -> PartTimer:
        """A reusable context manager adding its wall time to `field` of the open record."""
        return PartTimer(self, field)


class PartTimer:
    """`with timer:` adds the block's wall time to one StepTiming field while a step is being recorded."""

    def __init__(self, clock: StepClock | None, field: str) -> None:
        self.clock = clock
        self.field = field
        self._start = 0.0

    def __enter__(self) -> None:
        clock = self.clock
        if clock is not None and clock.current is not None:
            self._start = clock.now()

    def __exit__(self, *_exc: object) -> None:
        clock = self.clock
        if clock is not None and clock.current is not None:
            record = clock.current
            setattr(record, self.field, getattr(record, self.field) + clock.now() - self._start)


UNTIMED = PartTimer(None, "")
"""A timer that never records: for runners built outside an engine (tests, tools)."""
