"""The gate report as markdown, each section a function of the built report (``SECTIONS``), and as an
HTML page with a plot. Nothing here computes a statistic: the report was built with its numbers and words."""

from __future__ import annotations

import base64
import html
import io
import json

from flyspec.gate.data.spec import SamplingRecord
from flyspec.gate.report.advice import control_sentence, judged_proof, position_bias
from flyspec.gate.report.model import POWER_PCT, Comparison, ReportData, num, pct, points
from flyspec.gate.stats.decide import FAIL, INCONCLUSIVE, PASS
from flyspec.gate.stats.sequence import check_bet


def _exploratory_lines(report: ReportData) -> list[str]:
    e = report.exploratory
    if e is None:
        return []
    interval = f"interval [{points(e.low)}, {points(e.high)}] points" if e.low is not None else "no interval"
    return [
        f"### Exploratory, not the decision: margin {100 * e.margin:g} points",
        "",
        f"At a margin of {100 * e.margin:g} points the same {e.n} pairs read **{e.decision}** ({interval}). "
        f"This margin was chosen after the data; the registered decision above ({report.decision}, margin "
        f"{report.margin_points} points) is the one that counts.",
        "",
    ]


def _gate_lines(report: ReportData) -> list[str]:
    pooled = report.pooled
    assert pooled is not None
    loss = " (loss detected)" if pooled.decision == INCONCLUSIVE and pooled.loss_detected else ""
    lines = [f"## Decision: **{pooled.decision}**{loss}", "", " ".join(report.explanation), ""]
    lines += _gold_lines(report)
    if pooled.n and report.gold is None:
        sig = (
            " The candidate loses significantly more questions than it gains."
            if pooled.significant_loss
            else " The arms do not differ significantly by this test."
        )
        when = " (descriptive at a stopping point the data chose)" if report.sequential is not None else ""
        lines += [
            f"Exact McNemar test, beside the decision{when}: lost {pooled.lost}, gained {pooled.gained}, "
            f"two-sided p = {pooled.exact_p:.3g} (mid-p {pooled.mid_p:.3g}).{sig}",
            "",
        ]
    noise = report.noise
    if noise is not None and pooled.n:
        lines += [
            f"The baseline's own noise, next to the candidate's flips: pilot `{noise.run_id}` answered "
            f"{noise.n} questions twice with the baseline and {noise.flips} flipped ({pct(noise.flip_rate)}, "
            f"95% interval [{pct(noise.low)}, {pct(noise.high)}]); here the candidate flipped "
            f"{pooled.lost + pooled.gained} of {pooled.n} against the baseline ({pct(pooled.flip_rate)}).",
            "",
        ]
    if report.advice:
        lines += [" ".join(report.advice), ""]
    if report.ledger is not None:
        lines += [report.ledger.describe(), ""]
    lines += _exploratory_lines(report)
    lines += judge_lines(report)
    lines += [f"**Rule.** {report.rule()}", ""]
    if report.sequential is not None:
        lines += _sequential_lines(report)
    return lines + (gold_table(report) if report.gold is not None else _paired_table(report))


def _sequential_lines(report: ReportData) -> list[str]:
    stop, plan = report.sequential, report.sequential_plan
    assert stop is not None and plan is not None
    return [
        "## Sequential stopping",
        "",
        f"- registered before the first answer: margin {report.margin_points} points, alpha {plan.alpha:g}, "
        f"at most {plan.max_questions} questions in the seeded order (seed {plan.order_seed}) drawn from "
        f"{plan.population_size}",
        f"- stopped at question {stop.stopped_at} ({stop.reason})"
        + (
            f"; the answers in flight then were finished and stored, so {stop.complete_prefix} pairs are "
            "complete along the order now: a rerun counts them first"
            if stop.complete_prefix > stop.stopped_at
            else f"; pairs complete along the order: {stop.complete_prefix}"
        ),
        f"- interval at the stop: [{points(stop.low)}, {points(stop.high)}] points",
        "- the sequence follows the registered order up to the first question still missing an answer, so "
        "the stop depends only on the answers in that order, not on which answers finished first",
        "",
    ]


def _verdict_cells(c: Comparison) -> tuple[str, str]:
    ci = "-"
    if c.ci_low is not None and c.ci_high is not None:
        ci = f"[{100 * c.ci_low:+.2f}, {100 * c.ci_high:+.2f}]"
    if c.interim_decision is not None:
        return ci, f"{c.decision} (interim {c.interim_decision})"
    return ci, c.decision or "-"


def _paired_table(report: ReportData) -> list[str]:
    m = report.margin_points
    kind = "confidence sequence" if report.sequential is not None else "CI"
    scope = "task" if report.run.kind == "compare" else "dataset"
    lines = [
        "## Paired results",
        "",
        f"| {scope} | n | baseline acc | candidate acc | lost | gained | net | exact p | mid-p | "
        f"{100 * report.level:g}% {kind} of net (points) | margin | decision |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for c in report.comparisons:
        ci, decision = _verdict_cells(c)
        n = f"{c.n}" if c.n == c.registered else f"{c.n} of {c.registered}"
        lines.append(
            f"| {c.scope} | {n} | {pct(c.baseline_accuracy)} | {pct(c.candidate_accuracy)} | {c.lost} | "
            f"{c.gained} | {c.net:+d} | {c.exact_p:.3g} | {c.mid_p:.3g} | {ci} | -{m} | {decision} |"
        )
    detail = (
        "The pooled row's bounds are the confidence sequence at the stop; dataset rows give counts only."
        if report.sequential is not None
        else "The interval is Tango's score interval for (gained - lost) / n."
    )
    return [
        *lines,
        "",
        f"lost = baseline right, candidate wrong; gained = the reverse; net = gained - lost. {detail} The "
        "exact p is McNemar's conditional binomial test. The pooled row decides.",
        "",
    ]


def _gold_lines(report: ReportData) -> list[str]:
    """Beside a judged run's decision: its gold labels, the judge's agreement and McNemar's test on them."""
    g = report.gold
    if g is None:
        return []
    who = "the exact grader" if g.source == "exact" else "a person (`flyspec gate label`)"
    agreement = (
        f"The judge agreed with gold on {pct(g.agreement)} of the {g.labelled} labelled pairs (95% interval "
        f"[{pct(g.agreement_low)}, {pct(g.agreement_high)}])."
        if g.agreement is not None
        else "No pair has a gold label yet, so the run decides nothing: a judge's verdicts alone cannot show "
        "that the candidate is within the margin, whatever they say."
    )
    waiting = (
        f" {g.awaiting} drawn pair(s) wait for a label, and the decision's prefix stops at the first of "
        f"them: `flyspec gate label --store {report.store} --run {report.run.run_id}` labels them."
        if g.awaiting
        else ""
    )
    advice = f" {g.advice}" if g.advice and report.decision == INCONCLUSIVE else ""
    lines = [
        f"Gold labels: {g.labelled} of the {g.selected} pairs drawn for one ({100 * g.rate:g}% of the pairs "
        "whose answers differ, drawn at random, independently of the question order, by a rule fixed before "
        f"the first answer), labelled by {who}. {agreement}{waiting}{advice}",
        "",
    ]
    if g.gold_exact_p is None:
        return lines
    row = g.rows[-1]
    return [
        *lines,
        f"Exact McNemar test on the gold labels, beside the decision: of the {row.labelled} labelled pairs, "
        f"the label found the baseline's answer better in {row.gold_baseline}, the candidate's in "
        f"{row.gold_candidate} and neither in {row.gold_equal} (two-sided p = {g.gold_exact_p:.3g}).",
        "",
    ]


def judge_lines(report: ReportData) -> list[str]:
    """How a judged run decides on its gold labels (prediction-powered inference), in words and counts."""
    j, g, judge = report.judge, report.gold, report.registered.judge
    if j is None or g is None or judge is None:
        return []
    lines = [
        "## Judge and gold labels",
        "",
        f"The judge model `{j.model}` (prompt {j.template}; temperature 0, max_tokens "
        f"{judge.sampling.get('max_tokens')}) saw each request and both answers and said which is better, "
        "twice, with the answers' positions swapped; two identical answers are a tie without asking it. "
        "Its verdicts are predictions, not the truth: a judge can be biased, noisy or useless (a coin "
        "agrees with itself on the wrong winner a quarter of the time). So the decision rests on gold "
        f"labels for a random subset of the pairs ({100 * g.rate:g}% of the pairs whose answers differ, "
        "drawn by a rule registered before the first answer), combined with the judge's verdicts on every "
        "pair by prediction-powered inference (docs/statistics.md): per question, the judge's verdict, "
        "corrected by the gold label (weighted by 1 / rate) where the pair was drawn; the verdicts narrow "
        "the interval as far as the labels show them to be right.",
        "",
        judged_proof(report, g),
        "",
        "| pairs | identical (tie) | judge: baseline better | judge: candidate better | judge: other | drawn "
        "for gold | labelled | waiting | agreement with gold |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {g.pairs} | {g.identical} | {g.lost} | {g.gained} | {g.undecided} | {g.selected} | "
        f"{g.labelled} | {g.awaiting} | {pct(g.agreement)} "
        f"[{pct(g.agreement_low)}, {pct(g.agreement_high)}] |",
        "",
    ]
    return [*lines, position_bias(j), ""]


def gold_table(report: ReportData) -> list[str]:
    """A judged run's pairs per dataset: the judge's verdicts and the gold labels, never an accuracy."""
    g = report.gold
    pooled = report.pooled
    assert g is not None and pooled is not None
    m = report.margin_points
    kind = "confidence sequence" if report.sequential is not None else "interval"
    scope = "task" if report.run.kind == "compare" else "dataset"
    lines = [
        "## Judged pairs and gold labels",
        "",
        f"| {scope} | pairs | identical | judge: baseline better | judge: candidate better | judge: other | "
        "drawn for gold | labelled | gold: baseline better | gold: equal | gold: candidate better | "
        f"{100 * report.level:g}% {kind} of net (points) | margin | decision |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for row in g.rows:
        decided = row.scope == "pooled" and pooled.ci_low is not None and pooled.ci_high is not None
        interval, decision = _verdict_cells(pooled) if decided else ("-", "-")
        lines.append(
            f"| {row.scope} | {row.pairs} | {row.identical} | {row.judge_baseline} | {row.judge_candidate} | "
            f"{row.judge_other} | {row.selected} | {row.labelled} | {row.gold_baseline} | {row.gold_equal} | "
            f"{row.gold_candidate} | {interval} | -{m} | {decision} |"
        )
    estimate = f"{100 * g.estimate:+.2f} points" if g.estimate is not None else "none yet"
    return [
        *lines,
        "",
        "judge: what the judge said in both orders (other: the orders disagreed, a tie, or a verdict could "
        "not be read); gold: what the label said on the pairs drawn and labelled. No accuracy is shown: a "
        "judge's verdict says which answer is better, not whether either is right. The pooled row counts "
        "the pairs the decision used and decides, on the prediction-powered "
        f"{kind} (its estimate of the difference: {estimate}).",
        "",
    ]


def _pilot_lines(report: ReportData) -> list[str]:
    p = report.pilot
    if p is None:
        return ["## Pilot", "", "No question has both of its answers yet.", ""]
    if p.mode == "noise":
        head = [
            "## Pilot: run-to-run noise of the baseline",
            "",
            f"The baseline answered {p.n} questions twice (the second pass with fresh per-question seeds, "
            f"nothing cached). {p.flips} questions flipped between the passes.",
        ]
        if report.registered.sampling is not None and report.registered.sampling.temperature == 0:
            head.append(
                "At temperature 0 this measures only the nondeterminism of the engine or server "
                "(the other requests in a batch, floating point), not sampling noise."
            )
    else:
        head = [
            "## Pilot: how often the candidate changes the baseline's outcome",
            "",
            f"Both arms answered {p.n} questions: the candidate lost {p.lost} and gained {p.gained} "
            f"({p.flips} flips). Later gate runs in this store leave these questions out, so the run that "
            "decides is not the one that planned it.",
        ]
    rate = (
        f"No question flipped, so the flip rate is not known: zero flips in {p.n} questions are also likely "
        f"at rates up to {pct(p.flip_rate_upper)} (one-sided 95% upper confidence bound)."
        if p.flips == 0
        else f"Flip rate {pct(p.flip_rate)}, 95% Wilson interval [{pct(p.flip_rate_low)}, "
        f"{pct(p.flip_rate_high)}], one-sided 95% upper bound {pct(p.flip_rate_upper)}."
    )
    observed = "" if p.questions_needed is None else f" (at the observed rate: {p.questions_needed})"
    m = report.margin_points
    return [
        *head,
        rate,
        f"Accuracy: {pct(p.accuracy_first)} then {pct(p.accuracy_second)} (exact McNemar p = "
        f"{p.exact_p:.3g}).",
        "",
        f"To show non-inferiority within the registered margin of {m} points with {POWER_PCT} power (alpha "
        f"{report.alpha:g}) if the candidate is truly as accurate, a fixed run needs about "
        f"**{p.questions_needed_upper}** questions, planned from the upper bound of the flip rate{observed}. "
        "A sequential run (`gate run --sequential`) can stop earlier when the evidence is clear.",
        "",
    ]


def _speed_lines(report: ReportData) -> list[str]:
    if not report.speeds:
        return []
    lines = [
        "## Speed (measured in this run)",
        "",
        "| arm | answers | output tokens/s | tokens/s per request | mean latency (s) | "
        "mean acceptance length | acceptance rate | forgiven share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in report.speeds:
        label = (
            s.arm if report.run.kind != "pilot" or s.arm == "candidate" else f"{s.arm} (pass {s.repeat + 1})"
        )
        absent = "not reported"
        length = num(s.mean_acceptance_length, 2) if s.acceptance_reported else absent
        rate = pct(s.acceptance_rate) if s.acceptance_reported else absent
        forgiven = pct(s.forgiven_share) if s.forgiven_reported else absent
        tps = num(s.tokens_per_s, 1) if s.tokens_per_s is not None else "shared engine"
        lines.append(
            f"| {label} | {s.answers} | {tps} | {num(s.request_tokens_per_s, 1)} | "
            f"{num(s.mean_latency_s, 2)} | {length} | {rate} | {forgiven} |"
        )
    lines.append("")
    for shared in report.shared:
        lines.append(
            f"One engine answered {shared.lanes.replace('#0', '').replace('+', ' and ')} side by side in the "
            f"same batches: {num(shared.tokens_per_s, 1)} output tokens/s together over its busy time."
        )
    lines += [
        "",
        "Output tokens/s = an arm's generated tokens over its engine's busy time (or, for an endpoint, the "
        "wall time of its requests). Tokens/s per request = tokens over the summed request latencies: for "
        "arms in one engine, the same batches at the same time, so they compare directly. Mean acceptance "
        "length = 1 + accepted / drafts (tokens per target forward); forgiven share = accepted draft tokens "
        "that only the lossy policy's rule kept; 'not reported' means the server did not return the counter.",
        "",
    ]
    return lines


def _registration_lines(report: ReportData) -> list[str]:
    """What was compared: the run's registration, or the logs of ``gate compare``."""
    if report.run.kind == "compare":
        return _source_lines(report)
    run, reg = report.run, report.registered
    sampling = reg.sampling or SamplingRecord()
    lines = [
        "## Registration",
        "",
        f"- margin {reg.margin:g} ({report.margin_points} points), alpha {reg.alpha:g} (one-sided), seed "
        f"{run.seed}, registered before the first answer; design: {reg.design_name}",
        f"- sampling: temperature {sampling.temperature}, top_p {sampling.top_p}, "
        f"max_tokens {sampling.max_tokens}; per-question seeds shared by the arms",
    ]
    order = reg.order
    if order is not None:
        lines.append(f"- question order: {order.rule} with seed {order.seed} (pool {order.pool})")
    if reg.excluded is not None and reg.excluded.runs:
        lines.append(f"- left out: {reg.excluded.questions} questions used by {', '.join(reg.excluded.runs)}")
    for name, info in reg.datasets.items():
        lines.append(f"- dataset `{name}`: {info.questions} questions, sha256 {str(info.sha256)[:16]}...")
    lines += _arm_lines(report)
    judge = reg.judge
    if judge is not None:
        served = judge.served_model or {}
        lines.append(
            f"- judge: model `{judge.model}` (served id {served.get('id') or 'not reported'}), prompt "
            f"template {judge.template} (sha256 {judge.template_sha256}), sampling "
            f"{json.dumps(judge.sampling, sort_keys=True)}, both positions per question"
        )
    g = report.gold
    if g is not None:
        lines.append(
            f"- gold labels: {100 * g.rate:g}% of the pairs whose answers differ, draw {g.draw} (independent "
            f"of the question order), seed {reg.gold.seed if reg.gold is not None else None}, labelled by "
            f"{'the exact grader' if g.source == 'exact' else 'a person'}; interval bets version {g.bet} "
            f"({check_bet(g.bet).words})"
        )
    if run.notes.get("shared_engine"):
        lines.append(f"- {run.notes.get('shared_engine_note', 'arms shared one engine')}")
    lines += [f"- note: {note}" for note in report.notes]
    return lines


def _arm_lines(report: ReportData) -> list[str]:
    run = report.run
    fingerprints = run.notes.get("system_fingerprints", {})
    lines = []
    for name, arm in report.registered.arms.items():
        lines.append(f"- arm `{name}`: `{json.dumps(arm, sort_keys=True)}`")
        for executor in run.notes.get("executors", []):
            if "models" not in executor or name not in executor.get("arms", []):
                continue
            for url, card in executor.get("models", {}).items():
                seen = fingerprints.get(name, {}).get(url) or ["not reported"]
                root = card.get("root") or "not reported"
                lines.append(
                    f"  - served at {url}: model id {card.get('id') or 'not reported'}, root {root}, "
                    f"system_fingerprint {', '.join(seen)}"
                )
    return lines


def _source_lines(report: ReportData) -> list[str]:
    """What ``gate compare`` read, and how the margin came about (it replaces the registration)."""
    reg = report.run.registration
    lines = [
        "## Logs compared",
        "",
        f"- margin {report.registered_margin:g} ({report.margin_points} points), alpha {report.alpha:g} "
        "(one-sided): declared now, after the data (not a pre-registered run)",
    ]
    for side, info in reg.get("sources", {}).items():
        chosen = f", filter {info['filter']}" if info.get("filter") else ""
        lines.append(
            f"- {side}: `{info['source']}` ({info['kind']} log, scored by {info['metric']}{chosen}; "
            f"{info['samples']} samples)"
        )
    epochs = reg.get("epochs") or {}
    chosen = ", ".join(f"{side} epoch {v}" for side, v in epochs.items() if v is not None)
    if reg.get("epoch") is not None:
        chosen = f"epoch {reg['epoch']}"
    each = f"{chosen} of each question only" if chosen else "one epoch per question"
    return [
        *lines,
        f"- {each} (one independent pair per question)",
        "- paired by task and question id, with the prompt, document or input hashes checked wherever both "
        "logs carry them",
    ]


def _title_lines(report: ReportData) -> list[str]:
    kind = report.run.kind
    title = "comparing existing logs (margin declared after the data)"
    if kind != "compare":
        design = f", {report.design}" if kind == "gate" else ""
        title = f"run `{report.run.run_id}` ({kind}{design})"
    warnings = [line for warning in report.warnings for line in (f"> **WARNING:** {warning}", "")]
    return [f"# flyspec quality gate: {title}", "", *warnings]


def _result_lines(report: ReportData) -> list[str]:
    """A pilot's flips, or a run's decision and paired results: first each control's (a setting known to
    be harmful, which the gate must catch), then the candidate's."""
    if report.run.kind == "pilot":
        return _pilot_lines(report)
    lines: list[str] = []
    for control in report.family:
        alpha = f"alpha {control.alpha:g} of the run's {control.family_alpha or control.alpha:g}"
        lines += [f"# Control: `{control.comparison}` against the baseline (must FAIL; {alpha})", ""]
        lines += [control_sentence(control), "", *_gate_lines(control)]
    if report.family:
        lines += [f"# The candidate: `{report.comparison}` against the baseline", ""]
    return lines + _gate_lines(report)


# The report's sections, in order: a new section is a function of the report here.
SECTIONS = (_title_lines, _result_lines, _speed_lines, _registration_lines)


def markdown(report: ReportData) -> str:
    """The whole report as markdown: every section of SECTIONS in turn."""
    return "\n".join(line for section in SECTIONS for line in section(report)) + "\n"


def plot_png(report: ReportData) -> bytes:
    """A PNG of each interval against the margin (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [c for c in report.comparisons if c.ci_low is not None and c.ci_high is not None]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.6 * max(len(rows), 1)))
    colours = {PASS: "tab:green", FAIL: "tab:red", INCONCLUSIVE: "tab:orange"}
    for y, c in enumerate(reversed(rows)):  # the first row on top
        assert c.ci_low is not None and c.ci_high is not None
        colour = colours.get(c.decision or "", "grey")
        ax.plot([100 * c.ci_low, 100 * c.ci_high], [y, y], color=colour, linewidth=3)
        if c.net_difference is not None:
            ax.plot([100 * c.net_difference], [y], "o", color="black")
    margin = report.registered_margin
    ax.axvline(-100 * margin, color="tab:red", linestyle="--", label=f"-margin ({-100 * margin:g})")
    ax.axvline(0, color="grey", linewidth=1)
    ax.set_yticks(range(len(rows)), [c.scope for c in reversed(rows)])
    kind = "confidence sequence at the stop" if report.sequential is not None else "Tango interval"
    if report.gold is not None:
        kind = f"prediction-powered {'confidence sequence at the stop' if report.sequential else 'interval'}"
    ax.set_xlabel(f"candidate - baseline accuracy (points), {100 * report.level:g}% {kind}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def html_page(report: ReportData) -> str:
    """A self-contained HTML page: the markdown report as preformatted text plus the embedded plot."""
    image = ""
    if report.run.kind != "pilot" and any(c.ci_low is not None for c in report.comparisons):
        encoded = base64.b64encode(plot_png(report)).decode()
        image = f'<img alt="interval vs margin" src="data:image/png;base64,{encoded}">'
    title = html.escape(f"flyspec gate: {report.run.run_id}")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>"
        "<style>body{font-family:sans-serif;max-width:60em;margin:2em auto}"
        "pre{white-space:pre-wrap}</style></head><body>"
        f"<h1>{title}</h1>{image}<pre>{html.escape(markdown(report))}</pre></body></html>\n"
    )
