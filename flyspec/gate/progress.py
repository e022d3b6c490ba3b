"""The gate's progress bar on stderr (stdout carries only the report).

A fixed run shows answers stored and each arm's accuracy so far. A sequential run shows the pairs along
the registered order, the current confidence interval against the margin, and the time left of the
budget.
"""

from __future__ import annotations

import time
from collections import defaultdict

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flyspec.gate.monitor import SequentialMonitor

Lane = tuple[str, int]


class GateProgress:
    """A rich progress bar; ``add`` after each stored answer."""

    def __init__(
        self,
        lanes: list[Lane],
        total: int,
        done: int,
        *,
        monitor: SequentialMonitor | None,
        deadline: float | None,
        enabled: bool,
    ) -> None:
        self.lanes = lanes
        self.monitor = monitor
        self.deadline = deadline
        self.answers = done
        self.right: dict[Lane, int] = defaultdict(int)
        self.count: dict[Lane, int] = defaultdict(int)
        self.bar = Progress(
            TextColumn("[bold]gate[/bold]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        bar_total = monitor.plan.max_questions if monitor is not None else total
        self.task = self.bar.add_task(self._text(), total=bar_total, completed=self._completed(done))

    def _completed(self, answers: int) -> int:
        return self.monitor.prefix if self.monitor is not None else answers

    def _label(self, lane: Lane) -> str:
        arms = {arm for arm, _ in self.lanes}
        return lane[0] if len(arms) == len(self.lanes) else f"{lane[0]}#{lane[1]}"

    def _text(self) -> str:
        if self.monitor is not None:
            m = self.monitor
            text = (
                f"pairs in order | {m.gained} gained {m.lost} lost | interval "
                f"[{100 * m.low:+.1f}, {100 * m.high:+.1f}] pts vs -{100 * m.plan.margin:g}"
            )
        else:
            parts = []
            for lane in self.lanes:
                n = self.count[lane]
                parts.append(
                    f"{self._label(lane)} {100 * self.right[lane] / n:.1f}%" if n else f"{lane[0]} -"
                )
            text = " | ".join(parts)
        if self.deadline is not None:
            left = max(0.0, self.deadline - time.monotonic())
            text += f" | {int(left // 60)}:{int(left % 60):02d} left"
        return text

    def add(self, lane: Lane, correct: bool, *, new: bool = True) -> None:
        """Count one answer (``new=False``: one stored by an earlier session, for the accuracies)."""
        self.count[lane] += 1
        self.right[lane] += int(correct)
        self.answers += int(new)
        self.refresh()

    def refresh(self) -> None:
        """Redraw (the time left moves even when no answer arrives)."""
        self.bar.update(self.task, completed=self._completed(self.answers), description=self._text())

    def __enter__(self) -> GateProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()
