"""`flyspec gate tune` end to end on tiny random-weight models, through the real CLI entry point.

The dataset's references are the target's own greedy outputs (exact match), so the baseline (standard
speculative decoding, lossless) is right on every question and every question a FLy setting changes is a
lost one. The three settings are FLy with an entropy threshold of 2.0 (above ln 3, the largest top-3
entropy, so it never forgives: the same outputs and acceptance as standard), W=2 with theta 0.3, and the
most forgiving W=1 with theta 0; the order by speed is measured, not assumed. A mixed grid (`--policies`)
tunes FLy and typical acceptance, with and without lossless prefixes, in one fixed sequence. The
fixed-sequence procedure's error control itself is proven by simulation in
tests/test_gate_stats_validity.py.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from registrations import assert_registrations_round_trip
from test_gate_cli import _last_json, flyspec  # noqa: F401 - flyspec is a fixture
from tiny_llm import save_perturbed, save_tiny

from flyspec.gate.arms import parse_arm
from flyspec.gate.arms.engine import engine_groups
from flyspec.gate.data.results import setting_status
from flyspec.gate.data.store import GateStore
from flyspec.gate.report.tune_report import build_tune_report
from flyspec.gate.runs.tune import TuneOptions, calibration_speeds, parse_settings, tune
from flyspec.gate.stats.decide import NOT_TESTED, PASS, fixed_sequence
from flyspec.policy_grid import expand_grid

MAX_TOKENS = 10
QUESTIONS = 16
SETTINGS = [
    {"fly_window_size": 2, "fly_entropy_threshold": 2.0},
    {"fly_window_size": 2, "fly_entropy_threshold": 0.3},
    {"fly_window_size": 1, "fly_entropy_threshold": 0.0},
]


@dataclass(frozen=True)
class Setup:
    baseline: dict
    dataset: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    """A target that is unsure often (so FLy forgives), a draft close to it, and the target's greedy texts
    as references."""
    from flyspec import LLM, SamplingParams

    root = tmp_path_factory.mktemp("tune")
    target = save_tiny(root / "target", seed=3, std=0.25)
    draft = save_perturbed(target, root / "draft", seed=5, noise=0.003)
    prompts = [f"w{i} w{2 * i} w{3 * i}" for i in range(QUESTIONS)]
    outs = LLM(str(target), dtype="float32").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    dataset = root / "words.jsonl"
    dataset.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": p, "answer": o.outputs[0].text, "grader": "exact"}) + "\n"
            for i, (p, o) in enumerate(zip(prompts, outs, strict=True))
        )
    )
    spec = {"model": str(draft), "num_speculative_tokens": 3, "rejection_sample_method": "standard"}
    baseline = {"kind": "engine", "model": str(target), "dtype": "float32", "max_num_seqs": 4}
    return Setup({**baseline, "speculative_config": spec}, dataset)


def _args(setup: Setup, store: Path, *extra: str) -> list[str]:
    return [
        "tune", "--store", str(store), "--dataset", str(setup.dataset), "--baseline",
        json.dumps(setup.baseline), "--candidates", json.dumps(SETTINGS), "--max-tokens", str(MAX_TOKENS),
        "--no-progress", *extra,
    ]  # fmt: skip


def _rows(store: Path, sql: str) -> list[tuple]:
    with sqlite3.connect(store) as db:
        return db.execute(sql).fetchall()


def test_tune_three_settings_report_json_and_resume(flyspec, setup: Setup, tmp_path: Path) -> None:  # noqa: F811
    """A sequential tune of three settings ordered by calibration speed: the JSON's last line has `chosen`
    and `settings` in test order, each with its speculative_config, decision, tokens/s and mean acceptance
    length; the decisions are the fixed-sequence labels of the recomputed tests and `chosen` is the last
    PASS before the first non-PASS; a NOT TESTED setting was never run; the baseline answered each test
    question once and every setting used its seeds; the markdown has the answer, the table, the config to
    paste and the procedure; rerunning the command answers nothing and reports the same."""
    store = tmp_path / "tune.db"
    done = flyspec(*_args(setup, store, "--margin", "0.3", "--calibration-questions", "3", "--json"))
    report = _last_json(done.stdout)
    assert done.returncode == (0 if report["chosen"] is not None else 1), done.stderr
    settings = report["settings"]
    assert len(settings) == 3 and [s["position"] for s in settings] == [1, 2, 3]
    for s in settings:
        assert {"speculative_config", "decision", "tokens_per_s", "mean_acceptance_length"} <= set(s)
        assert s["speculative_config"]["rejection_sample_method"] == "fly"
        assert s["tokens_per_s"] > 0 and 1 <= s["mean_acceptance_length"] <= 4
    with GateStore(store) as opened:
        run = opened.get_run("tune")
        assert run is not None
        order = run.registration["order"]["settings"]
        assert [s["id"] for s in settings] == order
        statuses = []
        for setting_id in order:
            statuses.append(setting_status(opened, run, setting_id))
            if statuses[-1].decision != PASS:
                break
        answers = opened.answers("tune")
    expected = fixed_sequence([s.decision for s in statuses] + [None] * (3 - len(statuses)))
    assert [s["decision"] for s in settings] == expected.labels
    chosen = settings[expected.chosen]["speculative_config"] if expected.chosen is not None else None
    assert report["chosen"] == chosen
    for s in settings[: len(statuses)]:
        assert (s["n"], s["final"]) == (next(t.n for t in statuses if t.setting_id == s["id"]), True)
    untested = {s["id"] for s in settings if s["decision"] == NOT_TESTED}
    assert not untested & {a.arm for a in answers}
    baseline = {a.question_id: a.seed for a in answers if a.arm == "baseline"}
    assert len(baseline) == max(t.n for t in statuses)
    assert all(baseline[a.question_id] == a.seed for a in answers if a.arm != "baseline")

    markdown = flyspec(*_args(setup, store, "--margin", "0.3", "--calibration-questions", "3")).stdout
    assert "## Answer" in markdown and "## Settings in the registered test order" in markdown
    assert "| 0 | standard (baseline) |" in markdown and "Maurer, Hothorn and Lehmacher 1995" in markdown
    if chosen is not None:
        assert report["answer"].startswith(f"FLy {report['chosen_label']}: ")
        assert report["chosen_policy"] == "fly"
        assert "standard speed, non-inferior within 30 points on" in report["answer"]
        assert json.dumps(chosen, sort_keys=True) in markdown
    else:
        assert report["answer"].startswith("No setting passed")
    assert _rows(store, "SELECT COUNT(*) FROM answers") == [(len(answers) + 3 * 4,)]  # + calibration
    again = flyspec(*_args(setup, store, "--margin", "0.3", "--calibration-questions", "3", "--json"))
    assert _last_json(again.stdout)["settings"] == settings
    assert _rows(store, "SELECT COUNT(*) FROM answers") == [(len(answers) + 3 * 4,)]
    assert (
        flyspec("report", "--store", str(store), "--json")
        .stdout.strip()
        .endswith(json.dumps(chosen, default=str) + "}")
    )


def test_tune_order_is_fixed_from_calibration_before_any_grade(
    flyspec,  # noqa: F811
    setup: Setup,
    tmp_path: Path,
) -> None:
    """The registered test order is the calibration speed order (slowest first); the calibration questions
    are disjoint from the test questions; calibration answers are never graded; every calibration answer
    was stored before the tune run was registered, and the tune was registered before its first answer."""
    store = tmp_path / "order.db"
    done = flyspec(
        *_args(setup, store, "--margin", "0.3", "--calibration-questions", "3", "--max-questions", "4")
    )
    assert done.returncode == (0 if build_tune_report(store).chosen is not None else 1), done.stderr
    with GateStore(store) as opened:
        run = opened.get_run("tune")
        assert run is not None
        speeds = calibration_speeds(opened, "tune/calibration")
        calibration = {(q.dataset, q.question_id) for q in opened.questions("tune/calibration")}
        tests = {(q.dataset, q.question_id) for q in opened.questions("tune")}
        graded = [a for a in opened.answers("tune/calibration") if a.correct or a.extracted is not None]
        created = opened.get_run("tune").created_at  # type: ignore[union-attr]
    order = run.registration["order"]
    assert order["method"] == "speed" and order["by"] == "mean_acceptance_length"
    lengths = {sid: speeds[sid]["mean_acceptance_length"] for sid in ("s1", "s2", "s3")}
    assert order["values"] == lengths
    assert order["settings"] == sorted(lengths, key=lambda sid: (lengths[sid], sid))
    assert order["settings"][0] == "s1"  # theta 2.0 never forgives: the acceptance of standard verification
    assert len(calibration) == 3 and len(tests) == 4 and not calibration & tests
    assert sorted(map(tuple, run.registration["calibration"]["questions"])) == sorted(calibration)
    assert assert_registrations_round_trip(store) == ["calibration", "tune"]
    assert graded == []
    (last_calibration,) = _rows(
        store, "SELECT MAX(created_at) FROM answers WHERE run_id = 'tune/calibration'"
    )[0]
    (first_test,) = _rows(store, "SELECT MIN(created_at) FROM answers WHERE run_id = 'tune'")[0]
    assert last_calibration < created < first_test
    gate_report = flyspec("report", "--store", str(store), "--run", "tune/calibration")
    assert gate_report.returncode != 0 and "part of a gate tune" in gate_report.stderr


def test_tune_stops_at_the_first_setting_that_does_not_pass(
    flyspec,  # noqa: F811
    setup: Setup,
    tmp_path: Path,
) -> None:
    """With the order given and no calibration, a fixed test on 5 questions cannot show non-inferiority
    within 10 points for the first setting (it loses nothing, but 5 questions are too few): it is
    INCONCLUSIVE, the other two are NOT TESTED and have no answer at all, nothing is chosen, the words
    say to keep standard verification, and the command (and `gate report` of the tune) exits 1 because no
    setting passed."""
    store = tmp_path / "stop.db"
    args = ["--margin", "0.1", "--order", "given", "--calibration-questions", "0", "--fixed"]
    done = flyspec(*_args(setup, store, *args, "--max-questions", "5", "--json"))
    assert done.returncode == 1, done.stderr
    assert flyspec("report", "--store", str(store)).returncode == 1
    report = _last_json(done.stdout)
    assert [s["decision"] for s in report["settings"]] == ["INCONCLUSIVE", NOT_TESTED, NOT_TESTED]
    assert report["chosen"] is None and report["answer"].startswith("No setting passed")
    first = report["settings"][0]
    assert (first["n"], first["lost"], first["gained"]) == (5, 0, 0)
    assert report["speed_source"] == "test" and report["settings"][1]["tokens_per_s"] is None
    assert _rows(store, "SELECT DISTINCT arm FROM answers ORDER BY arm") == [("baseline",), ("s1",)]


def test_tune_bad_input_is_named(setup: Setup, tmp_path: Path) -> None:
    """A lossy baseline, a candidate that is not lossy, candidates and a grid given together, a grid axis
    without values or with a value its policy refuses, a repeated setting, an order by speed without
    calibration, judge questions and too many questions are each refused with a message naming them,
    before the store is touched."""
    store = tmp_path / "bad.db"
    fly_base = {**setup.baseline, "speculative_config": {**setup.baseline["speculative_config"]}}
    fly_base["speculative_config"]["rejection_sample_method"] = "fly"

    def options(**changes: object) -> TuneOptions:
        settings = {"store": store, "datasets": (str(setup.dataset),), "baseline": setup.baseline}
        return TuneOptions(**{**settings, "margin": 0.05, "candidates": SETTINGS, **changes})  # type: ignore[arg-type]

    with pytest.raises(ValueError, match="rejection_sample_method 'standard'"):
        tune(options(baseline=fly_base))
    with pytest.raises(ValueError, match="candidate 1: a candidate must verify with a lossy policy"):
        tune(options(candidates=[{"rejection_sample_method": "standard"}]))
    with pytest.raises(ValueError, match="give one of candidates, policies or a grid"):
        options(policies={"fly_window_size": [1, 2]})
    with pytest.raises(ValueError, match="--policies: grid 1: lossless_prefix_tokens lists no value"):
        tune(
            options(
                candidates=None, policies={"rejection_sample_method": "typical", "lossless_prefix_tokens": []}
            )
        )
    with pytest.raises(
        ValueError, match="candidate 2: typical_acceptance_sampler_posterior_alpha=2.0 is invalid"
    ):
        tune(options(candidates=None, policies=[{"typical_acceptance_sampler_posterior_alpha": [0.3, 2.0]}]))
    with pytest.raises(ValueError, match="candidate 2: the same setting as candidate 1"):
        tune(options(candidates=[SETTINGS[0], SETTINGS[0]]))
    with pytest.raises(ValueError, match="fly_window_size=3 is invalid"):
        tune(options(candidates=[{"fly_window_size": 3}]))
    with pytest.raises(ValueError, match="calibration_questions=0: the order by speed"):
        options(calibration_questions=0)
    with pytest.raises(ValueError, match="max_questions=99: 13 questions remain"):
        tune(options(calibration_questions=3, max_questions=99))
    judged = tmp_path / "judged.jsonl"
    judged.write_text(json.dumps({"id": "a", "prompt": "Say hi.", "grader": "judge"}) + "\n")
    with pytest.raises(ValueError, match="cannot use judge questions"):
        tune(options(datasets=(str(judged),)))
    assert not store.exists()


ENDPOINT_ACCEPTED = {"std": 8, "w3": 9, "w2": 10, "w1": 12}  # of 16 drafted in 4 steps, per answer


def _endpoint_app() -> FastAPI:
    """Four scripted servers in one: standard ("std") and three FLy windows, each reporting flyspec's
    spec_decode counters with its own acceptance; "w1" answers wrongly on even questions."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"data": [{"id": m, "root": m} for m in ENDPOINT_ACCEPTED]})

    @app.post("/v1/completions")
    async def complete(request: Request) -> JSONResponse:
        body = await request.json()
        i = int(body["prompt"].split()[-1])
        text = "no" if body["model"] == "w1" and i % 2 == 0 else "yes"
        counts = {
            "num_drafts": 4,
            "num_draft_tokens": 16,
            "num_accepted_tokens": ENDPOINT_ACCEPTED[body["model"]],
        }
        return JSONResponse(
            {
                "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 5},
                "spec_decode": {**counts, "num_forgiven_tokens": ENDPOINT_ACCEPTED[body["model"]] - 8},
            }
        )

    return app


def test_tune_with_endpoint_arms_orders_by_the_servers_counters(tmp_path: Path) -> None:
    """Endpoint arms, one server per setting, given out of order: the order is the servers' reported
    mean acceptance length on the calibration questions (W=3, W=2, W=1); the two windows that lose
    nothing PASS and W=1, which loses every even question, FAILs; W=2 is chosen, and its JSON config is
    the one the entry declared."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_endpoint_app(), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}/v1"
    dataset = tmp_path / "yes.jsonl"
    dataset.write_text(
        "".join(
            json.dumps({"prompt": f"Say yes {i}", "answer": "yes", "grader": "exact"}) + "\n"
            for i in range(40)
        )
    )
    spec = {
        "method": "draft_model",
        "model": "d",
        "num_speculative_tokens": 4,
        "rejection_sample_method": "fly",
    }
    candidates = [
        {"arm": {"base_url": url, "model": f"w{w}"}, "speculative_config": {**spec, "fly_window_size": w}}
        for w in (1, 3, 2)
    ]
    try:
        tune(
            TuneOptions(
                tmp_path / "ep.db",
                (str(dataset),),
                {"base_url": url, "model": "std"},
                0.3,
                candidates=candidates,
                calibration_questions=2,
                progress=False,
                population="finite",  # a claim about these 38 questions: the tiny pool decides
            )
        )
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    report = build_tune_report(tmp_path / "ep.db").to_dict()
    assert report["order"]["settings"] == ["s2", "s3", "s1"]
    assert report["order"]["values"] == {"s1": 4.0, "s2": 3.25, "s3": 3.5}
    assert [s["decision"] for s in report["settings"]] == ["PASS", "PASS", "FAIL"]
    assert report["chosen"] == {
        **spec,
        "fly_window_size": 2,
        "fly_entropy_threshold": 0.3,
        "fly_entropy_top_k": 3,
    }
    assert report["settings"][1]["forgiven_share"] == pytest.approx(2 / 10)
    assert report["baseline"]["mean_acceptance_length"] == 3.0


def test_tune_paused_by_its_time_budget_resumes_to_the_same_report(setup: Setup, tmp_path: Path) -> None:
    """A time budget far too small pauses the tune during its calibration (reason time_budget); the same
    call without the budget continues from the stored answers and completes with a report, and the
    calibration holds exactly one answer per arm and question."""
    options = TuneOptions(
        tmp_path / "pause.db", (str(setup.dataset),), setup.baseline, 0.3, candidates=SETTINGS,
        calibration_questions=2, max_questions=4, max_tokens=MAX_TOKENS, progress=False,
    )  # fmt: skip
    paused = tune(replace(options, max_minutes=1e-4))
    assert paused.reason == "time_budget"
    assert tune(options).reason == "complete"
    assert _rows(tmp_path / "pause.db", "SELECT COUNT(*), COUNT(DISTINCT arm || question_id) FROM answers "
                 "WHERE run_id = 'tune/calibration'") == [(8, 8)]  # fmt: skip
    report = build_tune_report(tmp_path / "pause.db").to_dict()
    assert report["complete"] and len(report["settings"]) == 3


GRID = [
    {
        "rejection_sample_method": "fly",
        "fly_window_size": 1,
        "fly_entropy_threshold": 0.0,
        "lossless_prefix_tokens": [0, 4],
    },
    {"rejection_sample_method": "typical", "lossless_prefix_tokens": [0, 32]},
]


def test_expand_grid_is_every_combination_in_order(setup: Setup) -> None:
    """A policy grid expands each block's list values into every combination (keys in order, the last
    fastest); a fragment naming no policy takes the policy whose fields it sets; the labels name each
    policy's settings and the prefix."""
    grid = expand_grid(json.dumps([{"fly_window_size": [2, 1], "fly_entropy_threshold": [0.6, 0.3]}, *GRID]))
    assert [(g.get("fly_window_size"), g.get("fly_entropy_threshold")) for g in grid[:4]] == [
        (2, 0.6), (2, 0.3), (1, 0.6), (1, 0.3),
    ]  # fmt: skip
    assert [g.get("lossless_prefix_tokens") for g in grid[4:]] == [0, 4, 0, 32]
    settings = parse_settings(
        parse_arm("baseline", setup.baseline),
        [*grid[4:], {"typical_acceptance_sampler_posterior_threshold": 0.2}],
    )
    assert [s.title for s in settings] == [
        "FLy W=1, theta=0",
        "FLy W=1, theta=0, prefix=4",
        "Typical acceptance eps=0.09, delta=0.3",
        "Typical acceptance eps=0.09, delta=0.3, prefix=32",
        "Typical acceptance eps=0.2, delta=0.3",
    ]
    assert settings[-1].speculative_config["rejection_sample_method"] == "typical"


def test_arms_share_an_engine_only_with_one_lossy_policy(setup: Setup) -> None:
    """Engine grouping asks the policy: a standard arm shares the engine of a typical-acceptance arm (as
    it does FLy's), a lossless prefix is a verifier setting like any other, and two different lossy
    settings (FLy and typical) run in engines of their own. The identity of an arm records its policy
    and settings in its canonical speculative_config."""
    spec = setup.baseline["speculative_config"]
    base = parse_arm("baseline", setup.baseline)
    typical = {**spec, "rejection_sample_method": "typical", "lossless_prefix_tokens": 8}
    typ = parse_arm("typ", {**setup.baseline, "speculative_config": typical})
    fly = parse_arm(
        "fly", {**setup.baseline, "speculative_config": {**spec, "rejection_sample_method": "fly"}}
    )
    assert [[a.name for a in g] for g in engine_groups([base, typ])] == [["typ", "baseline"]]
    assert [[a.name for a in g] for g in engine_groups([base, typ, fly])] == [["baseline"], ["typ"], ["fly"]]
    identity = typ.identity()["speculative_config"]
    assert identity["rejection_sample_method"] == "typical" and identity["lossless_prefix_tokens"] == 8
    assert identity["typical_acceptance_sampler_posterior_threshold"] == 0.09


def test_tune_mixed_policy_grid_end_to_end(flyspec, setup: Setup, tmp_path: Path) -> None:  # noqa: F811
    """`gate tune --policies` over FLy and typical acceptance, each with and without a lossless prefix,
    end to end: the four settings are ordered by calibration speed before any grade; typical acceptance
    with a prefix of 32 >= max_tokens is standard verification in effect (its calibration acceptance is
    the baseline's, it comes first, and if tested it loses and gains nothing); the decisions follow the
    fixed sequence; the JSON names each setting's policy, the report's answer names the chosen policy and
    setting, and its note says what each policy's forgiven share counts."""
    store = tmp_path / "grid.db"
    args = [
        "tune", "--store", str(store), "--dataset", str(setup.dataset), "--baseline",
        json.dumps(setup.baseline), "--policies", json.dumps(GRID), "--max-tokens", str(MAX_TOKENS),
        "--no-progress", "--margin", "0.3", "--calibration-questions", "3", "--population", "finite",
        "--json",
    ]  # fmt: skip
    done = flyspec(*args)
    assert done.returncode == 0, done.stderr
    report = _last_json(done.stdout)
    settings = {s["id"]: s for s in report["settings"]}
    assert {sid: s["policy"] for sid, s in settings.items()} == {
        "s1": "fly", "s2": "fly", "s3": "typical", "s4": "typical",
    }  # fmt: skip
    assert settings["s4"]["speculative_config"]["lossless_prefix_tokens"] == 32
    order = report["order"]
    assert order["method"] == "speed" and order["settings"][0] == "s4"
    assert order["values"]["s4"] == pytest.approx(report["baseline"]["mean_acceptance_length"])
    assert order["values"]["s1"] > order["values"]["s4"]
    with GateStore(store) as opened:
        run = opened.get_run("tune")
        assert run is not None
        statuses = []
        for setting_id in order["settings"]:
            statuses.append(setting_status(opened, run, setting_id))
            if statuses[-1].decision != PASS:
                break
    first = statuses[0]
    assert (first.lost, first.gained) == (0, 0)
    expected = fixed_sequence([s.decision for s in statuses] + [None] * (4 - len(statuses)))
    assert [s["decision"] for s in report["settings"]] == expected.labels
    if expected.chosen is not None:
        chosen = report["settings"][expected.chosen]
        assert report["chosen"] == chosen["speculative_config"]
        title = {"fly": "FLy", "typical": "Typical acceptance"}[chosen["policy"]]
        assert report["answer"].startswith(f"{title} {chosen['label']}: ")
    markdown = flyspec(*args[:-1]).stdout
    assert "| Typical acceptance eps=0.09, delta=0.3, prefix=32 |" in markdown
    assert (
        "forgiven share (FLy: accepted draft tokens that only FLy's rule kept; Typical acceptance: accepted "
        "draft tokens that only the typical-acceptance rule kept)" in markdown
    )
