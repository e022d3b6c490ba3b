"""The gate's progress and notes (``log``) on stderr (stdout carries only the report): a rich bar on a
terminal (a fixed run's accuracies; a sequential run's interval against the margin, rate and forecast,
flyspec/gate/stats/sizing.py), else one plain line per LINE_EVERY pairs.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flyspec.gate.grading.graders import sandbox_notes
from flyspec.gate.stats.monitor import Lane, Monitor, in_order_diffs
from flyspec.gate.stats.sizing import MIN_PAIRS, Forecast, forecast

FORECAST_EVERY = 10
"""New pairs between forecasts (each simulates a few hundred continuations, well under a second)."""
LINE_EVERY = 25
"""Pairs between progress lines when stderr is not a terminal."""


def log(message: str) -> None:
    """Progress notes go to stderr, so that stdout carries only the report (and --json's last line)."""
    print(message, file=sys.stderr, flush=True)


def announce_sandbox(graders: set[str], who: str) -> None:
    """Once at the start of a run with code questions: say which protections the code sandbox lacks here."""
    sandbox = sandbox_notes(graders)
    for missing in sandbox["missing"] if sandbox is not None else []:
        log(f"{who}: WARNING: the code sandbox runs without {missing}")


class GateProgress:
    """Progress of one answering session; ``add`` after each stored answer."""

    def __init__(
        self,
        lanes: list[Lane],
        total: int,
        done: int,
        *,
        monitors: dict[str, Monitor] | None = None,
        monitor: Monitor | None = None,
        deadline: float | None,
        enabled: bool,
        interactive: bool | None = None,
    ) -> None:
        self.lanes = lanes
        self.monitors = monitors or ({"candidate": monitor} if monitor is not None else {})
        self.monitor = next(iter(self.monitors.values()), None)
        self.deadline = deadline
        self.answers = done
        self.started = time.monotonic()
        self.session_answers = 0
        # Pairs complete before this session (a resumed run) do not count in its rate.
        self.session_pairs_from = self.monitor.prefix if self.monitor is not None else None
        self.outlook: Forecast | None = None
        self._forecast_at = 0
        self._warned = False
        self.right: dict[Lane, int] = defaultdict(int)
        self.count: dict[Lane, int] = defaultdict(int)
        console = Console(stderr=True)
        self.interactive = console.is_terminal if interactive is None else interactive
        self.lines = enabled and not self.interactive
        self._line_at = self._pairs()
        self.bar = Progress(
            TextColumn("[bold]gate[/bold]"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=console,
            disable=not enabled or not self.interactive,
        )
        bar_total = self.monitor.plan.max_questions if self.monitor is not None else total
        self.task = self.bar.add_task(self._text(), total=bar_total, completed=self._completed(done))

    def _pairs(self) -> int:
        """Pairs along the order of the comparison furthest ahead (a control's pairs come first), or
        answers, for a fixed run."""
        return max((m.prefix for m in self.monitors.values()), default=self.answers)

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
            population_size=m.plan.sequence_population,
            pairs_per_minute=new_pairs / max(self._minutes(), 1e-9),
            minutes_left=left,
        )
        if self._warned or self.outlook is None:
            return
        # Said once, as a line of its own: a user watching the bar (or reading a log) should know early.
        if self.outlook.median_pairs is None:
            self._warned = True
            self._say(
                f"gate: forecast: {self.outlook.describe()}; the run will most likely reach its "
                f"{m.plan.max_questions} questions INCONCLUSIVE (a larger --max-questions continues it)"
            )
        elif left is not None and self.outlook.within_budget < 0.5:
            self._warned = True
            self._say(
                f"gate: at {self.outlook.pairs_per_minute:.1f} pairs/min, {self.outlook.describe()}: this "
                "session will most likely stop at its time budget INCONCLUSIVE; rerunning the same command "
                "continues the run"
            )

    def _say(self, line: str) -> None:
        if self.interactive:
            self.bar.console.print(line, highlight=False, soft_wrap=True)
        else:
            log(line)

    @staticmethod
    def _interval(name: str, m: Monitor, with_name: bool) -> str:
        head = f"{name} " if with_name else ""
        if m.stop is not None and m.stop.final:
            return f"{head}{m.stop.decision} at {m.stop.stopped_at}"
        return f"{head}[{100 * m.low:+.1f}, {100 * m.high:+.1f}] pts vs -{100 * m.plan.margin:g}"

    def _text(self) -> str:
        if self.monitor is not None:
            m = self.monitor
            several = len(self.monitors) > 1
            text = f"pairs in order | {m.gained} gained {m.lost} lost | " + " | ".join(
                self._interval(name, mon, several) for name, mon in self.monitors.items()
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

    def _line(self) -> None:
        """One plain line per LINE_EVERY pairs (or answers, for a fixed run) when there is no terminal."""
        if not self.lines:
            return
        done = self._pairs()
        if done - self._line_at < LINE_EVERY:
            return
        self._line_at = done - done % LINE_EVERY
        unit = "pairs" if self.monitors else "answers"
        self._say(f"gate: {done} {unit} | {self._text()}")

    def add(self, lane: Lane, correct: bool, *, new: bool = True) -> None:
        """Count one answer (``new=False``: one stored by an earlier session, for the accuracies)."""
        self.count[lane] += 1
        self.right[lane] += int(correct)
        self.answers += int(new)
        if new:
            self.session_answers += 1
            self.refresh()
            self._line()

    def refresh(self) -> None:
        """Redraw (the time left moves even when no answer arrives)."""
        self._update_forecast()
        self.bar.update(self.task, completed=self._completed(self.answers), description=self._text())

    def __enter__(self) -> GateProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()
