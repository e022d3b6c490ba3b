"""The benchmark PNG: throughput vs batch size per method, and each lossy arm's speed-up vs its acceptance
gain."""

from __future__ import annotations

from pathlib import Path

from flyspec.bench.report import BenchReport, BenchRow


def write_plot(report: BenchReport, path: Path) -> None:
    """Two panels from a bench report (see flyspec.bench.report for its layout).

    Left: tokens/s against batch size, one line per flyspec method and lossless prefix at the headline K
    (a lossy policy at its defaults), the peer's batch-1 numbers as markers. Right: for every lossy arm,
    its tokens/s gain over standard SD at the same K and batch size against
    its gain in mean acceptance length; points on the diagonal turn all extra acceptance into speed.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display on a server; must precede pyplot
    import matplotlib.pyplot as plt

    rows = report.results
    k = report.settings.get("headline_k")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))

    lines: dict[str, list[BenchRow]] = {
        "target-only": [r for r in rows if r.backend == "flyspec" and r.method == "target"]
    }
    for r in rows:
        if r.backend != "flyspec" or r.method == "target" or r.k != k or not r.at_defaults:
            continue
        prefix = f" prefix={r.lossless_prefix}" if r.lossless_prefix else ""
        lines.setdefault(f"{r.method} K={k}{prefix}", []).append(r)
    for name, series in lines.items():
        series = sorted((r for r in series if r.tokens_per_s), key=lambda r: r.batch_size)
        if series:
            left.plot(
                [r.batch_size for r in series], [r.tokens_per_s for r in series], marker="o", label=name
            )
    for r in rows:
        if r.backend == "hf" and r.tokens_per_s and (r.method == "target" or r.k == k):
            name = "hf generate" if r.method == "target" else f"hf assisted K={r.k}"
            left.scatter([1], [r.tokens_per_s], marker="x", s=60, label=name, zorder=3)
    batches = sorted({r.batch_size for r in rows})
    left.set_xscale("log", base=2)
    left.set_xticks(batches, [str(b) for b in batches])
    left.set_xlabel("batch size (concurrent requests)")
    left.set_ylabel("output tokens/s")
    left.set_title("Throughput vs batch size")
    left.grid(True, alpha=0.3)
    left.legend(fontsize=8)

    points = [r for r in report.ratios if r.name.endswith("/ standard") and r.acceptance_gain is not None]
    xs = [100 * p.acceptance_gain for p in points]  # type: ignore[operator]
    ys = [100 * (p.value - 1) for p in points]
    right.scatter(xs, ys, zorder=3)
    for p, x, y in zip(points, xs, ys, strict=True):
        right.annotate(
            p.numerator.removeprefix("flyspec "),
            (x, y),
            fontsize=7,
            xytext=(3, 3),
            textcoords="offset points",
        )
    if xs:
        lo, hi = min([0.0, *xs, *ys]), max([0.0, *xs, *ys])
        right.plot([lo, hi], [lo, hi], linestyle="--", color="grey", label="speed-up = acceptance gain")
        right.legend(fontsize=8)
    right.axhline(0, color="black", linewidth=0.5)
    right.set_xlabel("acceptance-length gain over standard SD (%)")
    right.set_ylabel("tokens/s gain over standard SD (%)")
    right.set_title("Lossy verification: speed-up vs acceptance gain")
    right.grid(True, alpha=0.3)

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
