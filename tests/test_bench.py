"""`flyspec bench`: the sweep plan, the report arithmetic, and one real end-to-end run on tiny models."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from flyspec.bench.prompts import BenchPrompt, waves
from flyspec.bench.report import BenchRow, batch_scaling, ratios, summarise
from flyspec.bench.runner import BenchRunner, Measurement, engine_keys
from flyspec.bench.sweep import Arm, plan_arms, split_format
from flyspec.outputs import AcceptanceCounts
from flyspec.policy_grid import expand_grid

EPS, DELTA = "typical_acceptance_sampler_posterior_threshold", "typical_acceptance_sampler_posterior_alpha"

RESULT_FIELDS = {
    "label", "backend", "method", "batch_size", "drafter", "k", "settings", "tag", "requests", "repeats",
    "generated_tokens", "seconds", "tokens_per_s", "tokens_per_s_runs", "decode_tokens_per_s",
    "mean_acceptance_length", "acceptance_rate", "forgiven_share", "peak_rss_mb", "prefix_match",
    "quantization", "lossless_prefix",
}  # fmt: skip
TOP_FIELDS = {
    "schema", "command", "finished_at", "machine", "settings", "results", "ratios", "batch_scaling",
    "breakdown", "peak_rss_mb", "load_s",
}  # fmt: skip


FLY_AT_4 = {"fly_window_size": 3, "fly_entropy_threshold": 0.3, "fly_entropy_top_k": 3}
"""FLy's defaults at K=4."""
WINDOWS = [{"rejection_sample_method": "fly", "fly_window_size": [3, 1, 2]}]
"""A --policies grid: FLy's windows 3 (its default at K=4, so the --methods arm), 1 and 2."""


def _plan(**overrides):
    args = dict(
        methods=["target", "standard", "fly"],
        batch_sizes=[1, 4],
        ks=[2, 3, 4],
        headline_k=4,
        policies=expand_grid(WINDOWS),
        drafters=["draft"],
        peer="hf",
    )
    args.update(overrides)
    return plan_arms(**args)


def test_plan_sweeps_k_at_batch_one_and_every_lossy_setting_at_the_headline_k():
    """The planning rule: standard SD at every K at batch 1, each lossy setting (FLy's defaults, then the
    grid's settings, a repeat of the defaults once) at the headline K, larger batches at the headline K
    only, and the peer at batch 1 for every K. A label names the settings that differ from the policy's
    defaults; the arm's speculative config carries them all."""
    labels = [a.label for a in _plan()]
    assert labels == [
        "flyspec target-only b=1",
        "flyspec standard K=2 b=1",
        "flyspec standard K=3 b=1",
        "flyspec standard K=4 b=1",
        "flyspec fly K=4 b=1",
        "flyspec fly K=4 W=1 b=1",
        "flyspec fly K=4 W=2 b=1",
        "flyspec target-only b=4",
        "flyspec standard K=4 b=4",
        "flyspec fly K=4 b=4",
        "flyspec fly K=4 W=1 b=4",
        "flyspec fly K=4 W=2 b=4",
        "hf generate b=1",
        "hf assisted K=2 b=1",
        "hf assisted K=3 b=1",
        "hf assisted K=4 b=1",
    ]
    fly4 = [a for a in _plan() if a.method == "fly" and a.k == 4 and a.batch_size == 1]
    assert [(a.settings["fly_window_size"], a.tag, a.at_defaults) for a in fly4] == [
        (3, "", True), (1, "W=1", False), (2, "W=2", False),
    ]  # fmt: skip
    assert fly4[1].speculative_config() == {
        "num_speculative_tokens": 4,
        "method": "draft_model",
        "model": "draft",
        "rejection_sample_method": "fly",
        **FLY_AT_4,
        "fly_window_size": 1,
    }
    theta = _plan(methods=["standard"], policies=[{"fly_entropy_threshold": 0.6, "fly_entropy_top_k": 5}])
    assert [a.label for a in theta if a.batch_size == 1 and a.k == 4][
        1
    ] == "flyspec fly K=4 theta=0.6 top-k=5 b=1"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"methods": ["target", "medusa"]}, "methods="),
        ({"headline_k": 5}, "headline_k=5"),
        (
            {"policies": [{"rejection_sample_method": "fly", "fly_window_size": 4}]},
            "--policies: setting 1 .*: fly_window_size=4 is invalid: it must satisfy 1 <= fly_window_size",
        ),
        (
            {"policies": [{"fly_window_size": 2, "num_speculative_tokens": 5}]},
            "'num_speculative_tokens' is not",
        ),
        ({"policies": [{"lossless_prefix_tokens": 8}]}, "setting 1 .*: name its policy"),
        ({"policies": [{"rejection_sample_method": "standard"}]}, "'standard' is lossless"),
        ({"methods": [], "policies": []}, "nothing to measure"),
        (
            {"ks": [1], "headline_k": 1, "policies": []},
            "headline_k=1: fly: .*needs num_speculative_tokens >= 2",
        ),
        ({"methods": ["typical"], "lossless_prefixes": [0, 0]}, "lossless_prefixes=[0, 0]"),
        ({"methods": ["typical"], "lossless_prefixes": [-1]}, "lossless_prefixes=[-1]"),
        ({"drafters": []}, "drafter"),
        ({"peer": "vllm"}, "peer='vllm'"),
        ({"batch_sizes": []}, "batch_sizes"),
    ],
)
def test_plan_rejects_bad_options_naming_them(overrides, message):
    """A sweep that cannot run fails before any model loads, with a message naming the option."""
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _plan(**overrides)


def test_standard_arms_share_the_default_fly_engine():
    """Standard arms run on the lossy engine of the same weight format, drafter and K (a policy at its
    defaults preferred, without a prefix), so the sweep loads one engine per (format, drafter, K,
    verifier) rather than one per arm."""

    def verifier(method: str, settings: dict, prefix: int = 0) -> tuple:
        return (method, json.dumps(settings, sort_keys=True), prefix)

    fly = verifier("fly", FLY_AT_4)
    keys = engine_keys(_plan(peer=None))
    assert keys["flyspec standard K=4 b=1"] == (None, "draft", 4, fly)
    assert keys["flyspec standard K=4 b=4"] == (None, "draft", 4, fly)
    assert keys["flyspec fly K=4 W=1 b=1"] == (
        None,
        "draft",
        4,
        verifier("fly", {**FLY_AT_4, "fly_window_size": 1}),
    )
    assert keys["flyspec target-only b=1"] == keys["flyspec target-only b=4"] == (None, None, None, None)
    only_standard = engine_keys(_plan(methods=["standard"], policies=[], peer=None))
    assert only_standard["flyspec standard K=4 b=1"] == (None, "draft", 4, None)
    both = engine_keys(_plan(peer=None, quantizations=[None, "int8"]))
    assert both["flyspec int8 standard K=4 b=1"] == ("int8", "draft", 4, fly)
    assert both["flyspec standard K=4 b=1"] == (None, "draft", 4, fly)
    typical = {EPS: 0.09, DELTA: 0.3}
    prefixed = engine_keys(
        _plan(methods=["standard", "typical"], policies=[], peer=None, lossless_prefixes=[16, 0])
    )
    assert prefixed["flyspec standard K=4 b=1"] == (None, "draft", 4, verifier("typical", typical))
    assert prefixed["flyspec typical K=4 prefix=16 b=1"] == (
        None,
        "draft",
        4,
        verifier("typical", typical, 16),
    )


def test_plan_runs_each_lossy_policy_with_each_lossless_prefix():
    """--methods takes any lossy policy (typical acceptance at its defaults) and --lossless-prefix gives
    every lossy arm once per prefix, at the headline K; their speculative configs ask for exactly that."""
    arms = _plan(methods=["standard", "fly", "typical"], batch_sizes=[1, 16], ks=[4], policies=[],
                 peer=None, lossless_prefixes=[0, 16])  # fmt: skip
    assert [a.label for a in arms] == [
        "flyspec standard K=4 b=1",
        "flyspec fly K=4 b=1",
        "flyspec fly K=4 prefix=16 b=1",
        "flyspec typical K=4 b=1",
        "flyspec typical K=4 prefix=16 b=1",
        "flyspec standard K=4 b=16",
        "flyspec fly K=4 b=16",
        "flyspec fly K=4 prefix=16 b=16",
        "flyspec typical K=4 b=16",
        "flyspec typical K=4 prefix=16 b=16",
    ]
    assert arms[4].speculative_config() == {
        "num_speculative_tokens": 4,
        "method": "draft_model",
        "model": "draft",
        "rejection_sample_method": "typical",
        EPS: 0.09,
        DELTA: 0.3,
        "lossless_prefix_tokens": 16,
    }
    assert arms[2].speculative_config()["lossless_prefix_tokens"] == 16
    assert "lossless_prefix_tokens" not in arms[3].speculative_config()


def test_a_grid_setting_with_its_own_prefixes_runs_exactly_those():
    """A --policies fragment that sets lossless_prefix_tokens runs with exactly those prefixes, the others
    with every --lossless-prefix; a setting equal to another (typical at its defaults) runs once."""
    grid = [
        {"rejection_sample_method": "typical", EPS: 0.2, "lossless_prefix_tokens": [0, 8]},
        {"rejection_sample_method": "typical"},
    ]
    arms = _plan(methods=["typical"], batch_sizes=[1], ks=[4], policies=expand_grid(grid), peer=None,
                 lossless_prefixes=[0, 16])  # fmt: skip
    assert [a.label for a in arms] == [
        "flyspec typical K=4 b=1",
        "flyspec typical K=4 prefix=16 b=1",
        "flyspec typical K=4 eps=0.2 b=1",
        "flyspec typical K=4 eps=0.2 prefix=8 b=1",
    ]
    assert arms[3].speculative_config()[EPS] == 0.2 and arms[3].lossless_prefix == 8


def test_re_measure_command_of_a_grid_setting_plans_that_arm():
    """The Markdown's re-measure command for an arm off its policy's defaults names the setting as a
    one-entry --policies grid, which plans an arm of the same label; an arm at the defaults is named by
    --methods."""
    from flyspec.bench.markdown import arm_command
    from flyspec.bench.report import BenchReport

    arms = _plan(batch_sizes=[1], peer=None)
    rows = [_row(a, 10, 1.0) for a in arms]
    settings = {"model": "m", "dtype": "auto", "device": "cpu", "dataset": "gsm8k", "num_prompts": 1,
                "max_tokens": 4, "repeats": 1, "ignore_eos": True}  # fmt: skip
    report = BenchReport("flyspec bench", "now", {}, settings, rows, [], [])
    w1 = next(r for r in rows if r.label == "flyspec fly K=4 W=1 b=1")
    args = shlex.split(arm_command(report, w1))
    assert args[args.index("--methods") + 1] == "none"
    grid = expand_grid(args[args.index("--policies") + 1])
    again = plan_arms(methods=[], batch_sizes=[1], ks=[4], headline_k=4, drafters=["draft"], peer=None,
                      policies=grid)  # fmt: skip
    assert [a.label for a in again] == ["flyspec fly K=4 W=1 b=1"]
    default = next(r for r in rows if r.label == "flyspec fly K=4 b=1")
    assert "--policies" not in arm_command(report, default) and "--methods fly" in arm_command(
        report, default
    )


def test_every_weight_format_gets_every_flyspec_arm_and_its_own_baselines():
    """--quantization none,int8 plans each flyspec arm once per format (the peer once, unquantized), and
    the report compares an int8 arm with int8 target-only and with its unquantized twin."""
    arms = _plan(quantizations=[None, "int8"])
    plain = [a.label for a in arms if a.backend == "flyspec" and a.quantization is None]
    int8 = [a.label for a in arms if a.quantization == "int8"]
    assert [label.replace("flyspec int8 ", "flyspec ") for label in int8] == plain
    assert all(a.quantization is None for a in arms if a.backend == "hf")
    rows = [_row(a, tokens=10 + i, seconds=1.0) for i, a in enumerate(arms)]
    names = {r.name: r for r in ratios(rows)}
    vs_target = names["flyspec int8 standard K=4 b=4 / target-only"]
    assert vs_target.denominator == "flyspec int8 target-only b=4"
    assert names["flyspec int8 standard K=4 b=4 / unquantized"].denominator == "flyspec standard K=4 b=4"
    assert names["flyspec int8 fly K=4 W=1 b=4 / unquantized"].denominator == "flyspec fly K=4 W=1 b=4"
    scaling = batch_scaling(rows, drafter="draft", headline_k=4)
    assert {(s.quantization, s.method) for s in scaling} == {
        (q, m) for q in (None, "int8") for m in ("standard", "fly")
    }
    with pytest.raises(ValueError, match="quantization=\\['int3'\\]"):
        _plan(quantizations=["int3"])
    with pytest.raises(ValueError, match="or TARGET/DRAFT of those"):
        _plan(quantizations=["int8/fp8"])


def test_a_target_draft_format_quantizes_the_draft_on_its_own(tiny_pair):
    """A format "T/D" splits into the target's and the draft's quantization, and the sweep's engine for
    such an arm really runs a T target with a D draft (its target-only arm runs T)."""

    assert split_format("int8/int4") == ("int8", "int4") and split_format("none/int4") == (None, "int4")
    assert split_format("int8") == ("int8", None) and split_format(None) == (None, None)
    target, draft = tiny_pair
    arms = plan_arms(
        methods=["target", "standard"], batch_sizes=[1], ks=[2], headline_k=2, drafters=[str(draft)],
        peer=None, quantizations=["int8/int4"],
    )  # fmt: skip
    assert [a.label for a in arms] == [
        "flyspec int8/int4 target-only b=1",
        "flyspec int8/int4 standard K=2 b=1",
    ]
    runner = BenchRunner(str(target), arms, dtype="float32", device="cpu", ignore_eos=True)
    assert runner.engine_for(arms[1]).weight_formats == {"target": "int8", "draft": "int4"}
    assert runner.engine_for(arms[0]).weight_formats == {"target": "int8"}


def test_waves_fill_every_batch_and_reuse_prompts_cyclically():
    """Requests are rounded up to whole waves of the batch size; a small prompt set is reused in order."""
    prompts = [BenchPrompt(str(i), [i]) for i in range(3)]
    assert [[p.id for p in w] for w in waves(prompts, 4, 1)] == [["0"], ["1"], ["2"], ["0"]]
    assert [[p.id for p in w] for w in waves(prompts, 4, 8)] == [["0", "1", "2", "0", "1", "2", "0", "1"]]
    assert [[p.id for p in w] for w in waves(prompts, 3, 2)] == [["0", "1"], ["2", "0"]]


def _row(
    arm: Arm, tokens: int, seconds: float, drafts: int = 0, accepted: int = 0, forgiven: int = 0
) -> BenchRow:
    m = Measurement(
        tokens=tokens,
        seconds=seconds,
        peak_rss_bytes=2**30,
        counts=AcceptanceCounts(drafts, 4 * drafts, accepted, forgiven),
        target_forwards=drafts if arm.backend == "hf" else None,
        outputs={"0": list(range(tokens))},
    )
    return summarise(arm, [m], 1, {"0": list(range(tokens))})


def test_report_ratios_and_crossover_from_rows():
    """Ratios are tokens/s quotients of same-run rows, FLy rows carry their acceptance gain, and the
    crossover is the first batch where speculation falls below target-only."""
    rows = [
        _row(Arm("flyspec", "target", 1), 100, 10.0),  # 10 tok/s
        _row(Arm("flyspec", "standard", 1, "d", 4), 100, 6.0, drafts=25, accepted=75),  # MAL 4.0
        _row(Arm("flyspec", "fly", 1, "d", 4, FLY_AT_4), 100, 5.5, drafts=23, accepted=77, forgiven=7),
        _row(Arm("flyspec", "target", 16), 1600, 20.0),  # 80 tok/s: 8x batch 1
        _row(Arm("flyspec", "standard", 16, "d", 4), 1600, 25.0, drafts=400, accepted=1200),
        _row(Arm("flyspec", "fly", 16, "d", 4, FLY_AT_4), 1600, 24.0, drafts=380, accepted=1220),
        _row(Arm("hf", "target", 1), 100, 12.5),  # 8 tok/s
        _row(Arm("hf", "standard", 1, "d", 4), 100, 8.0, drafts=25),
    ]
    by_name = {r.name: r for r in ratios(rows)}
    assert by_name["flyspec target-only / hf generate (batch 1)"].value == pytest.approx(1.25)
    assert by_name["flyspec standard K=4 b=1 / target-only"].value == pytest.approx(10 / 6)
    assert by_name["flyspec standard K=4 b=1 / hf assisted"].value == pytest.approx(8 / 6)
    fly = by_name["flyspec fly K=4 b=1 / standard"]
    assert fly.value == pytest.approx(6 / 5.5)
    assert fly.acceptance_gain == pytest.approx((1 + 77 / 23) / 4.0 - 1)
    assert rows[2].forgiven_share == pytest.approx(7 / 77)
    assert rows[7].mean_acceptance_length == pytest.approx(4.0)  # hf: tokens per target forward

    assert by_name["target-only batch 16 / batch 1"].value == pytest.approx(8.0)
    assert by_name["flyspec target-only / hf generate (batch 1)"].acceptance_gain is None

    scaling = {s.method: s for s in batch_scaling(rows, drafter="d", headline_k=4)}
    assert [p.batch_size for p in scaling["standard"].points] == [1, 16]
    assert scaling["standard"].stops_paying_at == 16  # 64 tok/s < 80 tok/s at batch 16
    assert scaling["fly"].stops_paying_at == 16


def test_typical_and_prefixed_arms_are_compared_with_standard():
    """Every lossy arm, typical acceptance and prefixed ones included, gets its ratio to standard SD of the
    same K and batch size, and batch scaling has one series per method and prefix."""
    rows = [
        _row(Arm("flyspec", "target", 1), 100, 10.0),
        _row(Arm("flyspec", "standard", 1, "d", 4), 100, 6.0, drafts=25, accepted=75),
        _row(Arm("flyspec", "typical", 1, "d", 4), 100, 5.0, drafts=22, accepted=78, forgiven=9),
        _row(Arm("flyspec", "typical", 1, "d", 4, lossless_prefix=16), 100, 5.5, drafts=23, accepted=77),
    ]
    by_name = {r.name: r for r in ratios(rows)}
    assert by_name["flyspec typical K=4 b=1 / standard"].value == pytest.approx(6 / 5)
    assert by_name["flyspec typical K=4 prefix=16 b=1 / standard"].value == pytest.approx(6 / 5.5)
    assert rows[2].forgiven_share == pytest.approx(9 / 78) and rows[3].lossless_prefix == 16
    scaling = batch_scaling(rows, drafter="d", headline_k=4)
    assert [(s.method, s.lossless_prefix) for s in scaling] == [
        ("standard", 0),
        ("typical", 0),
        ("typical", 16),
    ]


def test_bad_option_is_one_line_error_before_any_model_loads():
    """User mistakes end with `error: ...` on stderr and exit code 2, without loading torch models."""
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "flyspec"), "bench", "--batch-sizes", "1,0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: batch_sizes='1,0': every value must be >= 1, got 0"]


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from tiny_llm import save_perturbed, save_tiny

    root = tmp_path_factory.mktemp("bench_models")
    target = save_tiny(root / "target", seed=0, arch="qwen2")
    draft = save_perturbed(target, root / "draft", seed=1, noise=0.02)
    return target, draft


def test_bench_runs_end_to_end_with_json_plot_and_markdown(tiny_pair, tmp_path):
    """A real sweep on tiny models (our engine and transformers as the peer): the JSON file and the last
    stdout line hold the same report with the documented fields, every request generated exactly
    max_tokens tokens, standard SD reproduces target-only output (float32, greedy), and the PNG and
    Markdown are written. No timing assertions."""
    from typer.testing import CliRunner

    from flyspec.cli import app

    target, draft = tiny_pair
    out_json, out_png, out_md = tmp_path / "bench.json", tmp_path / "bench.png", tmp_path / "BENCH.md"
    args = [
        "bench", "--model", str(target), "--draft", str(draft), "--batch-sizes", "1,2", "--k", "2",
        "--peer", "hf", "--num-prompts", "2", "--max-tokens", "6", "--warmup-tokens", "2", "--breakdown",
        "--json", str(out_json), "--plot", str(out_png), "--markdown", str(out_md),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out_json.read_text())
    assert json.loads(result.stdout.strip().splitlines()[-1]) == report
    assert set(report) == TOP_FIELDS
    assert report["schema"] == "flyspec.bench/3"
    labels = [r["label"] for r in report["results"]]
    assert labels == [
        "flyspec target-only b=1",
        "flyspec standard K=2 b=1",
        "flyspec fly K=2 b=1",
        "flyspec target-only b=2",
        "flyspec standard K=2 b=2",
        "flyspec fly K=2 b=2",
        "hf generate b=1",
        "hf assisted K=2 b=1",
    ]
    for row in report["results"]:
        assert set(row) == RESULT_FIELDS, row["label"]
        assert row["generated_tokens"] == row["requests"] * 6 * row["repeats"]
        assert row["tokens_per_s"] > 0 and row["peak_rss_mb"] > 0
        assert (row["decode_tokens_per_s"] is not None) == (row["backend"] == "flyspec")
        if row["backend"] == "flyspec" and row["method"] != "target":
            assert 1.0 <= row["mean_acceptance_length"] <= 3.0
            assert 0.0 <= row["acceptance_rate"] <= 1.0
        if row["backend"] == "flyspec" and row["method"] == "standard":
            assert row["prefix_match"] == 1.0  # lossless: same tokens as target-only
    names = {r["name"] for r in report["ratios"]}
    assert "flyspec target-only / hf generate (batch 1)" in names
    assert "flyspec standard K=2 b=1 / hf assisted" in names
    assert "flyspec fly K=2 b=1 / standard" in names
    assert set(report["breakdown"]) == {"flyspec target-only b=1", "flyspec standard K=2 b=1",
                                        "flyspec fly K=2 b=1"}  # fmt: skip
    for part in report["breakdown"].values():
        shares = [part[f"{p}_share"] for p in ("target_forward", "draft_forward", "verify", "engine_other",
                                               "outside_step")]  # fmt: skip
        assert sum(shares) == pytest.approx(1.0)
    assert len(report["settings"]["prompt_ids"]) == 2
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = out_md.read_text()
    assert "## Results" in markdown and all(label in markdown for label in labels)

    # The saved JSON re-renders the same Markdown without measuring anything.
    again = tmp_path / "AGAIN.md"
    result = CliRunner().invoke(
        app, ["bench", "--from-json", str(out_json), "--plot", str(out_png), "--markdown", str(again)]
    )
    assert result.exit_code == 0, result.output
    assert again.read_text() == markdown
    # A hand-written analysis goes in under its own heading, before the generated tables.
    notes = tmp_path / "analysis.md"
    notes.write_text("Target-only is memory-bound here.\n")
    args = ["bench", "--from-json", str(out_json), "--analysis", str(notes), "--markdown", str(again)]
    assert CliRunner().invoke(app, args).exit_code == 0
    text = again.read_text()
    assert (
        text.index("## Analysis (written after the run)")
        < text.index("Target-only is memory-bound")
        < (text.index("## Results"))
    )
    missing = ["bench", "--from-json", str(out_json), "--analysis", str(tmp_path / "nope.md")]
    result = CliRunner().invoke(app, [*missing, "--markdown", str(again)])
    assert isinstance(result.exception, ValueError) and "--analysis" in str(result.exception)
    not_a_report = tmp_path / "other.json"
    not_a_report.write_text('{"schema": "something-else"}')
    result = CliRunner().invoke(app, ["bench", "--from-json", str(not_a_report)])
    assert isinstance(result.exception, ValueError) and "not a flyspec bench report" in str(result.exception)


def test_a_schema_1_report_still_renders_without_its_targets(tmp_path):
    """The 2026-11-29 reference report (schema flyspec.bench/1, with the issue-labelled `targets` list the
    library no longer computes, kept as test data) re-renders with --from-json: every arm and ratio, no
    targets section."""
    from typer.testing import CliRunner

    from flyspec.cli import app

    saved = Path(__file__).resolve().parent / "data" / "bench-report-schema1.json"
    report = json.loads(saved.read_text())
    assert report["schema"] == "flyspec.bench/1" and report["targets"]
    out = tmp_path / "BENCH.md"
    result = CliRunner().invoke(app, ["bench", "--from-json", str(saved), "--markdown", str(out)])
    assert result.exit_code == 0, result.output
    markdown = out.read_text()
    assert all(row["label"] in markdown for row in report["results"])
    assert all(r["name"] in markdown for r in report["ratios"])
    assert "## Ratios" in markdown and "Targets" not in markdown and "issue 10" not in markdown


def test_bench_measures_int8_arms_beside_the_unquantized_ones(tiny_pair, tmp_path):
    """--quantization none,int8 runs every flyspec arm in both formats in one interleaved sweep (int8
    weights loaded once for the target and the draft), labels the int8 rows, compares them with int8
    target-only and their unquantized twins, and writes the formats into the settings and the re-measure
    commands."""
    out_md = tmp_path / "Q.md"
    args = ["--methods", "target,standard", "--quantization", "none,int8", "--dtype", "float32"]
    report, rows = _bench_json(tiny_pair, tmp_path, [*args, "--markdown", str(out_md)])
    assert list(rows) == [
        "flyspec target-only b=1",
        "flyspec standard K=2 b=1",
        "flyspec int8 target-only b=1",
        "flyspec int8 standard K=2 b=1",
    ]
    assert rows["flyspec int8 standard K=2 b=1"]["quantization"] == "int8"
    assert report["settings"]["quantizations"] == [None, "int8"]
    names = {r["name"] for r in report["ratios"]}
    assert "flyspec int8 target-only b=1 / unquantized" in names
    assert "flyspec int8 standard K=2 b=1 / target-only" in names
    assert "--quantization int8" in out_md.read_text()


def _bench_json(tiny_pair, tmp_path, args: list[str]) -> tuple[dict, dict[str, dict]]:
    """`flyspec bench` on the tiny pair with K=2, 2 prompts and 6 tokens, plus `args`, in this process;
    the report it wrote with --json, and its result rows by label."""
    from typer.testing import CliRunner

    from flyspec.cli import app

    target, draft = tiny_pair
    out_json = tmp_path / "bench.json"
    common = ["--model", str(target), "--draft", str(draft), "--k", "2", "--num-prompts", "2"]
    common += ["--max-tokens", "6", "--warmup-tokens", "2", "--json", str(out_json)]
    result = CliRunner().invoke(app, ["bench", *common, *args])
    assert result.exit_code == 0, result.output
    report = json.loads(out_json.read_text())
    return report, {r["label"]: r for r in report["results"]}


def test_busy_machine_note_discounts_the_sweeps_own_threads() -> None:
    """A 2-core sweep with 2 torch threads ends near load 2 on an idle machine: no 'other jobs' note then;
    a busy start, or load well beyond the sweep's own threads at the end, gets it."""
    from flyspec.bench.markdown import _machine

    base = {
        "cpu": "x", "usable_cores": 2, "logical_cores": 2, "memory_gb": 24, "device": "cpu", "python": "3",
        "torch": "2", "torch_threads": 2, "transformers": "4", "os": "linux", "flyspec_commit": "abc",
    }  # fmt: skip

    def noted(start: float, end: float) -> bool:
        lines = _machine({**base, "load_average_start": [start, 0, 0], "load_average_end": [end, 0, 0]})
        return any("other jobs shared" in line for line in lines)

    assert not noted(0.15, 2.05)
    assert noted(3.0, 2.05) and noted(0.1, 4.5)


def test_bench_runs_typical_and_a_lossless_prefix_end_to_end(tiny_pair, tmp_path):
    """`flyspec bench --methods target,standard,typical --lossless-prefix 0,64` on tiny models: typical
    acceptance arms run with and without a prefix, each compared with standard SD; with a prefix longer
    than max_tokens the output is target-only's (float32, greedy) and nothing is forgiven. No timing
    assertions."""
    args = ["--batch-sizes", "1", "--methods", "target,standard,typical", "--lossless-prefix", "0,64"]
    report, rows = _bench_json(tiny_pair, tmp_path, [*args, "--peer", "none"])
    assert list(rows) == [
        "flyspec target-only b=1",
        "flyspec standard K=2 b=1",
        "flyspec typical K=2 b=1",
        "flyspec typical K=2 prefix=64 b=1",
    ]
    held = rows["flyspec typical K=2 prefix=64 b=1"]
    assert held["prefix_match"] == 1.0 and held["forgiven_share"] == 0.0
    assert rows["flyspec typical K=2 b=1"]["forgiven_share"] is not None
    names = {r["name"] for r in report["ratios"]}
    assert {"flyspec typical K=2 b=1 / standard", "flyspec typical K=2 prefix=64 b=1 / standard"} <= names
    assert report["settings"]["lossless_prefixes"] == [0, 64]
