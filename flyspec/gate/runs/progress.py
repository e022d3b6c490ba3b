"""The gate's progress bar on stderr (stdout carries only the report).

A fixed run shows answers stored and each arm's accuracy so far. A sequential run shows the pairs along
the registered order, the current confidence interval against the margin, answers per minute, and from
MIN_PAIRS pairs on a forecast of when a decision is expected at the rate and effect seen so far
(flyspec/gate/stats/forecast.py), then the time left of the budget.
"""

from __future__ import annotations

import time
from collections import defaultdict

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flyspec.gate.stats.forecast import MIN_PAIRS, Forecast, forecast
from flyspec.gate.stats.monitor import SequentialMonitor, in_order_diffs

Lane = tuple[str, int]
FORECAST_EVERY = 10
"""New pairs between forecasts (each simulates a few hundred continuations, about 0.2 s)."""


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
        self.started = time.monotonic()
        self.session_answers = 0
        # Pairs complete before this session (a resumed run) do not count in its rate.
        self.session_pairs_from = monitor.prefix if monitor is not None else None
        self.outlook: Forecast | None = None
        self._forecast_at = 0
        self._warned = False
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

    def _minutes(self) -> float:
        return (time.monotonic() - self.started) / 60.0

    def _update_forecast(self) -> None:
        m = self.monitor
        if m is None or self.session_pairs_from is None or m.stop is not None:
            return
        new_pairs = m.prefix - self.session_pairs_from
        if m.prefix < MIN_PAIRS or new_pairs < 1 or m.prefix - self._forecast_at < FORECAST_EVERY:
            return
        self._forecast_at = m.prefix
        left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic()) / 60.0
        self.outlook = forecast(
            in_order_diffs(m.order, m.correct, m.lanes)[: m.prefix],
            margin=m.plan.margin,
            alpha=m.plan.alpha,
            max_questions=m.plan.max_questions,
            population_size=m.plan.population_size,
            pairs_per_minute=new_pairs / max(self._minutes(), 1e-9),
            minutes_left=left,
        )
        if left is not None and self.outlook.within_budget < 0.5 and not self._warned:
            # Said once, as a line of its own: the bar is invisible in a log or a CI job.
            self._warned = True
            self.bar.console.print(
                f"gate: at {self.outlook.pairs_per_minute:.1f} pairs/min and the effect seen in "
                f"{m.prefix} pairs, {self.outlook.describe()}: this session will most likely stop at its "
                "time budget INCONCLUSIVE; rerunning the same command continues the run",
                highlight=False,
                soft_wrap=True,
            )

    def _text(self) -> str:
        if self.monitor is not None:
            m = self.monitor
            text = (
                f"pairs in order | {m.gained} gained {m.lost} lost | interval "
                f"[{100 * m.low:+.1f}, {100 * m.high:+.1f}] pts vs -{100 * m.plan.margin:g}"
            )
            if m.prefix >= MIN_PAIRS and self.session_answers:
                text += f" | {self.session_answers / max(self._minutes(), 1e-9):.1f} answers/min"
            if self.outlook is not None:
                text += f" | {self.outlook.describe()}"
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
        if new:
            self.session_answers += 1
        self.refresh()

    def refresh(self) -> None:
        """Redraw (the time left moves even when no answer arrives)."""
        self._update_forecast()
        self.bar.update(self.task, completed=self._completed(self.answers), description=self._text())

    def __enter__(self) -> GateProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()
