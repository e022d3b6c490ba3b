"""The gate report: paired counts, exact tests, the interval against the margin, the decision, and speed.

Decision (SPEC 11.2), evaluated in this order on the complete pairs (questions answered by both arms):

- PASS: the lower end of the ``1 - 2 alpha`` Tango interval of ``candidate - baseline`` lies above
  ``-margin``: the candidate is shown to lose less than the margin (non-inferior);
- FAIL: the upper end lies below ``-margin`` (shown to lose more than the margin), or the exact McNemar
  test shows a significant loss (two-sided p < 2 alpha with more lost than gained questions);
- INCONCLUSIVE otherwise: the data cannot tell yet; the report says how many questions the observed flip
  rate needs.

A significant loss that is nevertheless shown to be smaller than the margin is a PASS (that is what a
margin means), and the report says so in a note.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flyspec.gate.stats import (
    mcnemar,
    net_difference_ci,
    noninferiority,
    questions_needed_noninferiority,
    wilson_interval,
)
from flyspec.gate.store import AnswerRecord, GateStore, RunRecord

PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
POWER = 0.80


@dataclass
class Comparison:
    """Baseline vs candidate on one dataset (or pooled over all of them)."""

    scope: str
    n: int
    registered: int
    baseline_accuracy: float | None
    candidate_accuracy: float | None
    lost: int
    gained: int
    net: int
    net_difference: float | None
    flip_rate: float | None
    exact_p: float
    mid_p: float
    ci_low: float | None
    ci_high: float | None
    noninferiority_p: float | None
    significant_loss: bool
    decision: str
    questions_needed: int | None = None
    more_questions: int | None = None
    interim_decision: str | None = None


@dataclass
class ArmSpeed:
    """Speed of one arm (one repeat) measured in this run."""

    arm: str
    repeat: int
    answers: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float | None
    mean_latency_s: float | None
    mean_acceptance_length: float | None
    acceptance_rate: float | None
    forgiven_share: float | None


@dataclass
class PilotSummary:
    """The pilot's flip rate between two passes of the baseline, and the sample size it implies."""

    n: int
    flips: int
    flip_rate: float
    flip_rate_low: float
    flip_rate_high: float
    accuracy_first: float
    accuracy_second: float
    exact_p: float
    questions_needed: int
    questions_needed_high: int


@dataclass
class Report:
    """Everything ``gate report`` shows; ``to_markdown``, ``to_dict`` and ``to_html`` render it."""

    store: str
    run: RunRecord
    margin: float
    margin_overridden: bool
    alpha: float
    level: float
    comparisons: list[Comparison] = field(default_factory=list)
    speeds: list[ArmSpeed] = field(default_factory=list)
    pilot: PilotSummary | None = None
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def decision(self) -> str | None:
        """The pooled decision of a gate run (None for a pilot)."""
        pooled = [c for c in self.comparisons if c.scope == "pooled"]
        return pooled[0].decision if pooled else None

    @property
    def pooled(self) -> Comparison | None:
        """The pooled comparison (None for a pilot)."""
        return next((c for c in self.comparisons if c.scope == "pooled"), None)

    def rule(self) -> str:
        """The decision rule in plain words."""
        pct = f"{100 * self.margin:g}"
        lvl = f"{100 * self.level:g}%"
        return (
            f"We estimate how much accuracy the candidate loses or gains against the baseline on the same "
            f"questions, with a {lvl} confidence interval. PASS if even the pessimistic end of that interval "
            f"loses less than the margin of {pct} points (the candidate is non-inferior). FAIL if even the "
            f"optimistic end loses more than {pct} points, or if the candidate loses significantly more "
            f"questions than it gains (exact McNemar test, p < {2 * self.alpha:g}) without being shown to "
            f"stay within the margin. Otherwise INCONCLUSIVE: more questions are needed."
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready report; for a gate run the last key is ``decision``."""
        out: dict[str, Any] = {
            "store": self.store,
            "run_id": self.run.run_id,
            "kind": self.run.kind,
            "registered_margin": self.run.margin,
            "margin": self.margin,
            "margin_overridden": self.margin_overridden,
            "alpha": self.alpha,
            "level": self.level,
            "registration": self.run.registration,
            "run_notes": self.run.notes,
            "comparisons": [asdict(c) for c in self.comparisons],
            "speeds": [asdict(s) for s in self.speeds],
            "warnings": self.warnings,
            "notes": self.notes,
        }
        if self.run.kind == "pilot":
            out["pilot"] = asdict(self.pilot) if self.pilot is not None else None
            return out
        pooled = self.pooled
        assert pooled is not None
        out["decision"] = {
            "decision": pooled.decision,
            "scope": "pooled",
            "margin": self.margin,
            "alpha": self.alpha,
            "level": self.level,
            "n": pooled.n,
            "lost": pooled.lost,
            "gained": pooled.gained,
            "net_difference": pooled.net_difference,
            "ci": [pooled.ci_low, pooled.ci_high],
            "exact_p": pooled.exact_p,
            "noninferiority_p": pooled.noninferiority_p,
            "questions_needed": pooled.questions_needed,
            "more_questions": pooled.more_questions,
            "interim_decision": pooled.interim_decision,
            "rule": self.rule(),
        }
        return out

    # ------------------------------------------------------------------------------------ markdown

    def to_markdown(self) -> str:
        """The report as markdown (what ``gate report`` prints)."""
        reg = self.run.registration
        lines = [f"# flyspec quality gate: run `{self.run.run_id}` ({self.run.kind})", ""]
        for warning in self.warnings:
            lines += [f"> **WARNING:** {warning}", ""]
        if self.run.kind == "pilot":
            lines += self._pilot_markdown()
        else:
            lines += self._gate_markdown()
        if self.speeds:
            lines += [
                "## Speed (measured in this run)",
                "",
                "| arm | answers | output tokens/s | mean latency (s) | mean acceptance length | "
                "acceptance rate | forgiven share |",
                "|---|---:|---:|---:|---:|---:|---:|",
            ]
            for s in self.speeds:
                label = s.arm if self.run.kind != "pilot" else f"{s.arm} (pass {s.repeat + 1})"
                lines.append(
                    f"| {label} | {s.answers} | {_num(s.tokens_per_s, 1)} | {_num(s.mean_latency_s, 2)} | "
                    f"{_num(s.mean_acceptance_length, 2)} | {_pct(s.acceptance_rate)} | "
                    f"{_pct(s.forgiven_share)} |"
                )
            lines += [
                "",
                "Output tokens/s = generated tokens / wall time of the arm's batches (same questions, same "
                "concurrency, arms interleaved). Mean acceptance length = 1 + accepted / drafts (tokens per "
                "target forward). Forgiven share = accepted draft tokens that only FLy's rule kept.",
                "",
            ]
        lines += ["## Registration", ""]
        lines.append(
            f"- margin {self.run.margin:g} ({100 * self.run.margin:g} points), alpha {self.run.alpha:g} "
            f"(one-sided), seed {self.run.seed}, registered before the first answer"
        )
        sampling = reg.get("sampling", {})
        lines.append(
            f"- sampling: temperature {sampling.get('temperature')}, top_p {sampling.get('top_p')}, "
            f"max_tokens {sampling.get('max_tokens')}; per-question seeds shared by the arms"
        )
        for name, info in reg.get("datasets", {}).items():
            lines.append(
                f"- dataset `{name}`: {info['questions']} questions, sha256 {info['sha256'][:16]}..."
            )
        for name, arm in reg.get("arms", {}).items():
            lines.append(f"- arm `{name}`: `{json.dumps(arm, sort_keys=True)}`")
        if self.run.notes.get("shared_engine"):
            lines.append(f"- {self.run.notes.get('shared_engine_note', 'arms shared one engine')}")
        for note in self.notes:
            lines.append(f"- note: {note}")
        return "\n".join(lines) + "\n"

    def _gate_markdown(self) -> list[str]:
        pooled = self.pooled
        assert pooled is not None
        pts = f"{100 * self.margin:g}"
        lines = [f"## Decision: **{pooled.decision}**", ""]
        if pooled.n == 0:
            lines += ["No question has been answered by both arms yet.", ""]
        elif pooled.interim_decision is not None:
            lines += [
                f"The run is incomplete ({pooled.n} of {pooled.registered} questions answered by both arms), "
                f"so there is no decision yet; the interim estimate reads {pooled.interim_decision}. Finish "
                "the run by repeating the same `gate run` command.",
                "",
            ]
        elif pooled.decision == PASS:
            lines += [
                f"The candidate is non-inferior: with {100 * self.level:g}% confidence it loses less than "
                f"{pts} points of accuracy against the baseline (it lost {pooled.lost} and gained "
                f"{pooled.gained} of {pooled.n} questions).",
                "",
            ]
        elif pooled.decision == FAIL:
            why = (
                f"it loses more than {pts} points even at the optimistic end of the interval"
                if pooled.ci_high is not None and pooled.ci_high < -self.margin
                else f"it loses significantly more questions than it gains (exact p = {pooled.exact_p:.3g})"
            )
            lines += [
                f"The candidate is worse than the baseline: {why} (lost {pooled.lost}, gained "
                f"{pooled.gained} of {pooled.n}).",
                "",
            ]
        else:
            more = (
                f" At the observed flip rate ({_pct(pooled.flip_rate)}), about {pooled.questions_needed} "
                f"questions in total ({pooled.more_questions} more) give {100 * POWER:g}% power to show "
                f"non-inferiority if the candidate is truly as accurate as the baseline. Adding questions to "
                f"this run after seeing its result is optional stopping; register a new, larger run instead."
                if pooled.questions_needed is not None
                else ""
            )
            lines += [f"The data cannot tell yet whether the candidate stays within {pts} points.{more}", ""]
        lines += [f"**Rule.** {self.rule()}", "", "## Paired results", ""]
        lines += [
            f"| dataset | n | baseline acc | candidate acc | lost | gained | net | exact p | mid-p | "
            f"{100 * self.level:g}% CI of net (points) | margin | decision |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
        ]
        for c in self.comparisons:
            ci = (
                f"[{100 * c.ci_low:+.2f}, {100 * c.ci_high:+.2f}]"
                if c.ci_low is not None and c.ci_high is not None
                else "-"
            )
            n = f"{c.n}" if c.n == c.registered else f"{c.n} of {c.registered}"
            decision = (
                c.decision if c.interim_decision is None else f"{c.decision} (interim {c.interim_decision})"
            )
            lines.append(
                f"| {c.scope} | {n} | {_pct(c.baseline_accuracy)} | {_pct(c.candidate_accuracy)} | "
                f"{c.lost} | {c.gained} | {c.net:+d} | {c.exact_p:.3g} | {c.mid_p:.3g} | {ci} | -{pts} | "
                f"{decision} |"
            )
        lines += [
            "",
            "lost = baseline right, candidate wrong; gained = the reverse; net = gained - lost. The interval "
            "is Tango's score interval for (gained - lost) / n; the exact p is McNemar's conditional "
            "binomial test. The pooled row decides.",
            "",
        ]
        return lines

    def _pilot_markdown(self) -> list[str]:
        p = self.pilot
        if p is None:
            return ["## Pilot", "", "No question has been answered twice yet.", ""]
        pts = f"{100 * self.margin:g}"
        return [
            "## Pilot: run-to-run noise of the baseline",
            "",
            f"The baseline answered {p.n} questions twice (the second pass with fresh per-question seeds, "
            f"nothing cached). {p.flips} questions flipped between the passes: flip rate "
            f"{_pct(p.flip_rate)}, 95% Wilson interval [{_pct(p.flip_rate_low)}, {_pct(p.flip_rate_high)}]. "
            f"Accuracy: {_pct(p.accuracy_first)} then {_pct(p.accuracy_second)} (exact McNemar p = "
            f"{p.exact_p:.3g}).",
            "",
            f"To show non-inferiority within the registered margin of {pts} points with "
            f"{100 * POWER:g}% power (alpha {self.alpha:g}), if the candidate flips questions as often as "
            f"the baseline's own noise and is truly as accurate: about **{p.questions_needed}** questions; "
            f"at the upper end of the flip-rate interval: {p.questions_needed_high}. A candidate that "
            "changes more answers than noise does needs more.",
            "",
        ]

    # ---------------------------------------------------------------------------------------- html

    def plot_png(self) -> bytes:
        """A PNG of each interval against the margin (matplotlib, no display needed)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [c for c in self.comparisons if c.ci_low is not None and c.ci_high is not None]
        fig, ax = plt.subplots(figsize=(7, 1.2 + 0.6 * max(len(rows), 1)))
        colours = {PASS: "tab:green", FAIL: "tab:red", INCONCLUSIVE: "tab:orange"}
        for i, c in enumerate(rows):
            assert c.ci_low is not None and c.ci_high is not None and c.net_difference is not None
            y = len(rows) - 1 - i
            ax.plot([100 * c.ci_low, 100 * c.ci_high], [y, y], color=colours[c.decision], linewidth=3)
            ax.plot([100 * c.net_difference], [y], "o", color="black")
        ax.axvline(
            -100 * self.margin, color="tab:red", linestyle="--", label=f"-margin ({-100 * self.margin:g})"
        )
        ax.axvline(0, color="grey", linewidth=1)
        ax.set_yticks(range(len(rows)), [c.scope for c in reversed(rows)])
        ax.set_xlabel(f"candidate - baseline accuracy (points), {100 * self.level:g}% Tango interval")
        ax.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=110)
        plt.close(fig)
        return buffer.getvalue()

    def to_html(self) -> str:
        """A self-contained HTML page: the markdown report as preformatted text plus the embedded plot."""
        image = ""
        if self.run.kind != "pilot" and any(c.ci_low is not None for c in self.comparisons):
            encoded = base64.b64encode(self.plot_png()).decode()
            image = f'<img alt="interval vs margin" src="data:image/png;base64,{encoded}">'
        title = html.escape(f"flyspec gate: {self.run.run_id}")
        return (
            f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
            "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
            "pre{white-space:pre-wrap}</style></head><body>"
            f"<h1>{title}</h1>{image}<pre>{html.escape(self.to_markdown())}</pre></body></html>\n"
        )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def decide(
    n: int, lost: int, gained: int, margin: float, alpha: float
) -> tuple[str, tuple[float, float], bool]:
    """The decision, the ``1 - 2 alpha`` Tango interval and whether McNemar shows a significant loss."""
    ci = net_difference_ci(n, lost, gained, level=1 - 2 * alpha)
    significant_loss = lost > gained and mcnemar(lost, gained).exact_p < 2 * alpha
    if ci[0] > -margin:
        return PASS, ci, significant_loss
    if ci[1] < -margin or significant_loss:
        return FAIL, ci, significant_loss
    return INCONCLUSIVE, ci, significant_loss


def _compare(
    scope: str, pairs: list[tuple[bool, bool]], registered: int, margin: float, alpha: float
) -> Comparison:
    n = len(pairs)
    lost = sum(1 for b, c in pairs if b and not c)
    gained = sum(1 for b, c in pairs if c and not b)
    test = mcnemar(lost, gained)
    if n == 0:
        return Comparison(
            scope,
            0,
            registered,
            None,
            None,
            0,
            0,
            0,
            None,
            None,
            1.0,
            test.mid_p,
            None,
            None,
            None,
            False,
            INCONCLUSIVE,
        )
    decision, (low, high), significant_loss = decide(n, lost, gained, margin, alpha)
    needed = more = None
    flip_rate = (lost + gained) / n
    if decision == INCONCLUSIVE:
        needed = questions_needed_noninferiority(margin, flip_rate, 0.0, alpha, POWER)
        more = max(0, needed - n)
    return Comparison(
        scope=scope,
        n=n,
        registered=registered,
        baseline_accuracy=sum(b for b, _ in pairs) / n,
        candidate_accuracy=sum(c for _, c in pairs) / n,
        lost=lost,
        gained=gained,
        net=gained - lost,
        net_difference=(gained - lost) / n,
        flip_rate=flip_rate,
        exact_p=test.exact_p,
        mid_p=test.mid_p,
        ci_low=low,
        ci_high=high,
        noninferiority_p=noninferiority(n, lost, gained, margin, alpha).p_value,
        significant_loss=significant_loss,
        decision=decision,
        questions_needed=needed,
        more_questions=more,
    )


def _speeds(answers: list[AnswerRecord], batches: list[tuple[str, int, int, int, float]]) -> list[ArmSpeed]:
    wall: dict[tuple[str, int], float] = defaultdict(float)
    tokens: dict[tuple[str, int], int] = defaultdict(int)
    for arm, repeat, _, batch_tokens, wall_s in batches:
        wall[(arm, repeat)] += wall_s
        tokens[(arm, repeat)] += batch_tokens
    grouped: dict[tuple[str, int], list[AnswerRecord]] = defaultdict(list)
    for a in answers:
        grouped[(a.arm, a.repeat)].append(a)
    out = []
    for (arm, repeat), rows in sorted(grouped.items()):
        drafts = [r for r in rows if r.num_drafts is not None]
        num_drafts = sum(r.num_drafts or 0 for r in drafts)
        draft_tokens = sum(r.num_draft_tokens or 0 for r in drafts)
        accepted = sum(r.num_accepted_tokens or 0 for r in drafts)
        forgiven = sum(r.num_forgiven_tokens or 0 for r in drafts)
        w = wall.get((arm, repeat), 0.0)
        out.append(
            ArmSpeed(
                arm=arm,
                repeat=repeat,
                answers=len(rows),
                completion_tokens=sum(r.completion_tokens for r in rows),
                wall_s=w,
                tokens_per_s=tokens[(arm, repeat)] / w if w > 0 else None,
                mean_latency_s=sum(r.latency_s for r in rows) / len(rows),
                mean_acceptance_length=1 + accepted / num_drafts if num_drafts else None,
                acceptance_rate=accepted / draft_tokens if draft_tokens else None,
                forgiven_share=forgiven / accepted if accepted else None,
            )
        )
    return out


def build_report(
    store: str | Path | GateStore, run_id: str | None = None, margin: float | None = None
) -> Report:
    """Build the report of a run (the latest one when ``run_id`` is None) from the stored answers.

    ``margin`` overrides the registered margin; the report then carries a loud warning, because a margin
    chosen after seeing the data invalidates the test.
    """
    if isinstance(store, GateStore):
        return _build(store, run_id, margin)
    path = Path(store)
    if not path.is_file():
        raise FileNotFoundError(f"store {path} does not exist")
    with GateStore(path) as opened:
        return _build(opened, run_id, margin)


def _build(store: GateStore, run_id: str | None, margin: float | None) -> Report:
    runs = store.runs()
    if not runs:
        raise ValueError(f"store {store.path} holds no runs")
    notes: list[str] = []
    if run_id is None:
        run = runs[-1]
        if len(runs) > 1:
            notes.append(
                f"store holds {len(runs)} runs; reporting the latest, {run.run_id!r} (pick with --run)"
            )
    else:
        found = store.get_run(run_id)
        if found is None:
            raise ValueError(
                f"run {run_id!r} is not in {store.path}; runs: {', '.join(r.run_id for r in runs)}"
            )
        run = found
    warnings: list[str] = []
    used_margin = run.margin
    if margin is not None and margin != run.margin:
        if isinstance(margin, bool) or not isinstance(margin, int | float) or not 0 < margin < 1:
            raise ValueError(f"margin={margin!r}: must lie in (0, 1)")
        warnings.append(
            f"USING MARGIN {margin:g} INSTEAD OF THE REGISTERED {run.margin:g}. A margin chosen after seeing "
            "results invalidates the non-inferiority test; the registered decision is the one that counts."
        )
        used_margin = float(margin)
    report = Report(
        store=str(store.path),
        run=run,
        margin=used_margin,
        margin_overridden=bool(warnings),
        alpha=run.alpha,
        level=1 - 2 * run.alpha,
        warnings=warnings,
        notes=notes,
    )
    questions = store.questions(run.run_id)
    answers = store.answers(run.run_id)
    correct = {(a.arm, a.repeat, a.dataset, a.question_id): a.correct for a in answers}
    report.speeds = _speeds(answers, store.batches(run.run_id))
    # The two lanes being paired: two passes of the baseline in a pilot, baseline vs candidate otherwise.
    lanes = [("baseline", 0), ("baseline", 1)] if run.kind == "pilot" else [("baseline", 0), ("candidate", 0)]
    pairs: dict[str, list[tuple[bool, bool]]] = defaultdict(list)
    registered: dict[str, int] = defaultdict(int)
    for q in questions:
        registered[q.dataset] += 1
        first = correct.get((*lanes[0], q.dataset, q.question_id))
        second = correct.get((*lanes[1], q.dataset, q.question_id))
        if first is not None and second is not None:
            pairs[q.dataset].append((first, second))
    all_pairs = [p for ds in registered for p in pairs[ds]]
    if len(all_pairs) < len(questions):
        warnings.append(
            f"only {len(all_pairs)} of {len(questions)} registered questions have both answers; the run is "
            "incomplete (rerun `gate run` with the same arguments to finish it). Counts cover complete "
            "pairs; the decision stays INCONCLUSIVE until every registered question is answered."
        )
    if run.kind == "pilot":
        report.pilot = _pilot(all_pairs, used_margin, run.alpha)
        return report
    report.comparisons = [
        _compare(ds, pairs[ds], registered[ds], used_margin, run.alpha) for ds in registered
    ]
    report.comparisons.append(_compare("pooled", all_pairs, len(questions), used_margin, run.alpha))
    # A pre-registered run is decided at its registered size: deciding on a partial run would be
    # optional stopping. The interim reading is kept, labelled as such.
    for c in report.comparisons:
        if c.n < c.registered and c.n > 0:
            c.interim_decision, c.decision = c.decision, INCONCLUSIVE
    pooled = report.comparisons[-1]
    if pooled.decision == PASS and pooled.significant_loss:
        notes.append(
            "the candidate loses significantly more questions than it gains, but the loss is shown to be "
            "smaller than the margin, so it passes; check that the margin is really acceptable"
        )
    return report


def _pilot(pairs: list[tuple[bool, bool]], margin: float, alpha: float) -> PilotSummary | None:
    n = len(pairs)
    if n == 0:
        return None
    lost = sum(1 for a, b in pairs if a and not b)
    gained = sum(1 for a, b in pairs if b and not a)
    flips = lost + gained
    low, high = wilson_interval(flips, n)
    return PilotSummary(
        n=n,
        flips=flips,
        flip_rate=flips / n,
        flip_rate_low=low,
        flip_rate_high=high,
        accuracy_first=sum(a for a, _ in pairs) / n,
        accuracy_second=sum(b for _, b in pairs) / n,
        exact_p=mcnemar(lost, gained).exact_p,
        questions_needed=questions_needed_noninferiority(margin, flips / n, 0.0, alpha, POWER),
        questions_needed_high=questions_needed_noninferiority(margin, high, 0.0, alpha, POWER),
    )
