"""`flyspec gate compare`: a paired decision from existing per-sample logs, through the real CLI entry point.

The logs are lm-eval samples files in the format lm-eval 0.4 writes (tests/test_gate_evallogs.py builds
them; tests/test_gate_evallogs_real.py runs lm-eval itself and compares its logs), Inspect logs written
with Inspect's own API, and two arms of a gate store. The expected counts are set by construction, so
every number of the report is known.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_gate_cli import _last_json, _store, flyspec  # noqa: F401 - flyspec is a fixture
from test_gate_evallogs import STAMP, _inspect_log, _lm_eval_run, _row, _write

from flyspec.gate.logs.compare import compare_logs
from flyspec.gate.stats import decide


def _scores(n: int, lost: int, gained: int) -> tuple[list[int], list[int]]:
    """Baseline and candidate 0/1 scores with the given flips; both right elsewhere but every 4th."""
    base = [0 if lost <= i < lost + gained or (i >= lost + gained and i % 4 == 0) else 1 for i in range(n)]
    cand = [1 if lost <= i < lost + gained else (0 if i < lost else base[i]) for i in range(n)]
    return base, cand


def _lm_eval_pair(root: Path, tasks: dict[str, tuple[int, int, int]]) -> tuple[Path, Path]:
    base_scores, cand_scores = {}, {}
    for task, (n, lost, gained) in tasks.items():
        base_scores[task], cand_scores[task] = _scores(n, lost, gained)
    return _lm_eval_run(root / "base", base_scores), _lm_eval_run(root / "cand", cand_scores)


def test_compare_lm_eval_logs_per_task_and_pooled(flyspec, tmp_path: Path) -> None:  # noqa: F811
    """Two lm-eval output folders with two tasks: the JSON's last line is the report whose decision object
    has the pooled n, lost, gained, Tango bounds and decision of stats.decide; each task has its own row;
    the markdown says at the top and in the sources that the margin was declared after the data."""
    base, cand = _lm_eval_pair(tmp_path, {"arith": (300, 2, 1), "words": (200, 1, 0)})
    done = flyspec("compare", str(base), str(cand), "--margin", "0.05", "--json")
    assert done.returncode == 0, done.stderr
    assert "declared now, after the data" in done.stderr
    report = _last_json(done.stdout)
    decision = report["decision"]
    expected = decide(500, 3, 1, 0.05)
    assert (decision["n"], decision["lost"], decision["gained"]) == (500, 3, 1)
    assert decision["decision"] == expected.decision == "PASS"
    assert (decision["low"], decision["high"]) == pytest.approx((expected.low, expected.high))
    assert decision["pre_registered"] is False and report["kind"] == "compare"
    rows = {c["scope"]: c for c in report["comparisons"]}
    assert set(rows) == {"arith", "words", "pooled"}
    assert (rows["arith"]["n"], rows["arith"]["lost"], rows["arith"]["gained"]) == (300, 2, 1)
    assert report["registration"]["sources"]["baseline"]["metric"] == "exact_match"

    markdown = flyspec("compare", str(base), str(cand), "--margin", "0.05").stdout
    assert markdown.index("DECLARED NOW, AFTER THE DATA") < markdown.index("## Decision: **PASS**")
    assert "not a pre-registered run" in markdown
    assert "| arith | 300 |" in markdown and "| pooled | 500 |" in markdown
    assert "declared now, after the data (not a pre-registered run)" in markdown
    html = tmp_path / "compare.html"
    assert flyspec("compare", str(base), str(cand), "--margin", "0.05", "--html", str(html)).returncode == 0
    assert "data:image/png;base64," in html.read_text()


def test_compare_exit_codes_follow_the_decision(flyspec, tmp_path: Path) -> None:  # noqa: F811
    """FAIL exits 1; INCONCLUSIVE exits 0, or 2 with --strict; the words follow the numbers."""
    base, cand = _lm_eval_pair(tmp_path / "fail", {"t": (200, 30, 2)})
    failed = flyspec("compare", str(base), str(cand), "--margin", "0.02", "--json")
    assert failed.returncode == 1 and _last_json(failed.stdout)["decision"]["decision"] == "FAIL"
    base, cand = _lm_eval_pair(tmp_path / "open", {"t": (40, 2, 1)})
    open_ = flyspec("compare", str(base), str(cand), "--margin", "0.02")
    assert open_.returncode == 0 and "## Decision: **INCONCLUSIVE**" in open_.stdout
    assert "optional stopping" in open_.stdout and "gate run --sequential" in open_.stdout
    assert flyspec("compare", str(base), str(cand), "--margin", "0.02", "--strict").returncode == 2


def test_compare_refuses_what_cannot_be_paired(flyspec, tmp_path: Path) -> None:  # noqa: F811
    """Different question sets are one error line naming the ids; a missing log, a bad margin and a
    metric the log lacks are named too; nothing prints a traceback."""
    base = _lm_eval_run(tmp_path / "base", {"t": [1, 1, 1, 0]})
    cand = _lm_eval_run(tmp_path / "cand", {"t": [1, 1, 0]})
    done = flyspec("compare", str(base), str(cand), "--margin", "0.02")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "only in the baseline: 1 (t/3)" in done.stderr
    missing = flyspec("compare", str(tmp_path / "nope"), str(cand), "--margin", "0.02")
    assert missing.returncode != 0 and "no such file or folder" in missing.stderr
    bad = flyspec("compare", str(base), str(cand), "--margin", "2")
    assert bad.returncode != 0 and "margin=2.0: must lie in (0, 1)" in bad.stderr
    metric = flyspec("compare", str(base), str(base), "--margin", "0.02", "--metric", "acc")
    assert "no metric 'acc' in this row (its metrics: exact_match, chars)" in metric.stderr


def test_compare_inspect_epochs_are_refused_unless_one_is_chosen(tmp_path: Path) -> None:
    """Inspect logs with two epochs per sample are refused (epochs of one question are not independent
    pairs) naming the epochs; --epoch 2 compares that epoch only, one pair per question."""
    pytest.importorskip("inspect_ai")
    values_b = {(i, e): "C" for i in range(6) for e in (1, 2)}
    values_c = {**values_b, (0, 2): "I", (1, 1): "I"}
    base = _inspect_log(tmp_path / "base.eval", "qa", values_b, ("match",))
    cand = _inspect_log(tmp_path / "cand.eval", "qa", values_c, ("match",))
    with pytest.raises(ValueError, match=r"holds 2 epochs per question \(1, 2\).*choose one with --epoch N"):
        compare_logs(str(base), str(cand), 0.1)
    report = compare_logs(str(base), str(cand), 0.1, epoch=2)
    pooled = report.pooled
    assert pooled is not None and (pooled.n, pooled.lost, pooled.gained) == (6, 1, 0)
    assert "epoch 2 of each question only" in report.to_markdown()
    with pytest.raises(ValueError, match="--epoch 3: baseline .* has no epoch 3"):
        compare_logs(str(base), str(cand), 0.1, epoch=3)


def test_compare_two_arms_of_a_gate_store(flyspec, tmp_path: Path) -> None:  # noqa: F811
    """STORE.db:RUN:ARM on both sides compares two arms of a stored run with the same counts as the
    run's own report; the report says the margin (here another than the registered one) was declared
    after the data."""
    db = _store(tmp_path / "g.db", n=60, lost=3, gained=1, margin=0.05)
    done = flyspec("compare", f"{db}:gate:baseline", f"{db}:gate:candidate", "--margin", "0.2", "--json")
    assert done.returncode == 0, done.stderr
    decision = _last_json(done.stdout)["decision"]
    assert (decision["n"], decision["lost"], decision["gained"]) == (60, 3, 1)
    assert decision["margin"] == 0.2 and decision["decision"] == decide(60, 3, 1, 0.2).decision
    sources = json.dumps(_last_json(done.stdout)["registration"]["sources"])
    assert f"{db}:gate:baseline" in sources and '"kind": "flyspec"' in sources


def test_compare_epoch_per_side(flyspec, tmp_path: Path) -> None:  # noqa: F811
    """Two Inspect runs need not number their epochs alike: `--epoch baseline=2 --epoch candidate=3`
    compares the baseline's epoch 2 with the candidate's epoch 3 (one pair per question), says so in the
    report and records both; one --epoch for both fails on the log that lacks it; a bad side is named."""
    pytest.importorskip("inspect_ai")
    base = _inspect_log(tmp_path / "base.eval", "qa", {(i, e): "C" for i in range(6) for e in (1, 2)}, ("m",))
    values = {(i, e): "C" for i in range(6) for e in (1, 2, 3)}
    cand = _inspect_log(tmp_path / "cand.eval", "qa", {**values, (0, 3): "I", (4, 3): "I"}, ("m",))
    report = compare_logs(str(base), str(cand), 0.1, epoch={"baseline": 2, "candidate": 3})
    pooled = report.pooled
    assert pooled is not None and (pooled.n, pooled.lost, pooled.gained) == (6, 2, 0)
    done = flyspec(
        "compare", str(base), str(cand), "--margin", "0.1", "--epoch", "baseline=2", "--epoch", "candidate=3",
        "--json",
    )  # fmt: skip
    result = _last_json(done.stdout)
    assert (result["decision"]["n"], result["decision"]["lost"]) == (6, 2)
    assert result["registration"]["epochs"] == {"baseline": 2, "candidate": 3}
    text = flyspec(
        "compare", str(base), str(cand), "--margin", "0.1", "--epoch", "baseline=2", "--epoch", "candidate=3"
    )
    assert "baseline epoch 2, candidate epoch 3 of each question only" in text.stdout
    same = flyspec("compare", str(base), str(cand), "--margin", "0.1", "--epoch", "3")
    assert same.returncode == 2 and "--epoch 3: baseline" in same.stderr and "has no epoch 3" in same.stderr
    bad = flyspec("compare", str(base), str(cand), "--margin", "0.1", "--epoch", "left=1")
    assert bad.returncode == 2 and "the side is baseline or candidate" in bad.stderr


def test_compare_filter_per_task_from_the_cli(flyspec, tmp_path: Path) -> None:  # noqa: F811
    """Two lm-eval folders each mixing a two-filter task with a one-filter task compare with
    `--filter gsm=flexible-extract` (the other task uses its only filter); without it the error names the
    per-task form."""
    for side, flips in (("base", [1, 1, 1, 1]), ("cand", [1, 0, 1, 1])):
        run = _lm_eval_run(tmp_path / side, {"gsm": flips}, filters=("strict-match", "flexible-extract"))
        rows = [_row(i, 1.0, filter="none") for i in range(3)]
        _write(run / "tiny" / f"samples_arc_{STAMP}.jsonl", rows)
    base, cand = tmp_path / "base", tmp_path / "cand"
    done = flyspec("compare", str(base), str(cand), "--margin", "0.3")
    assert done.returncode == 2 and "--filter gsm=NAME" in done.stderr
    done = flyspec(
        "compare", str(base), str(cand), "--margin", "0.3", "--filter", "gsm=flexible-extract", "--json"
    )
    result = _last_json(done.stdout)
    assert (result["decision"]["n"], result["decision"]["lost"]) == (7, 1)
    assert {c["scope"] for c in result["comparisons"]} == {"arc", "gsm", "pooled"}
    assert result["registration"]["sources"]["baseline"]["filter"] == "gsm=flexible-extract, none"
