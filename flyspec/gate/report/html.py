"""The gate report as a self-contained HTML page: the markdown plus a plot of each interval against the
margin."""

from __future__ import annotations

import base64
import html
import io

from flyspec.gate.report.markdown import markdown
from flyspec.gate.report.model import ReportData
from flyspec.gate.stats.decide import FAIL, INCONCLUSIVE, PASS


def plot_png(report: ReportData) -> bytes:
    """A PNG of each interval against the margin (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [c for c in report.comparisons if c.ci_low is not None and c.ci_high is not None]
    fig, ax = plt.subplots(figsize=(7, 1.2 + 0.6 * max(len(rows), 1)))
    colours = {PASS: "tab:green", FAIL: "tab:red", INCONCLUSIVE: "tab:orange"}
    for i, c in enumerate(rows):
        assert c.ci_low is not None and c.ci_high is not None
        y = len(rows) - 1 - i
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
