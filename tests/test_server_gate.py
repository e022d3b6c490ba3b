"""The quality gate's endpoint arms against the real flyspec server (docs/gate.md, docs/server.md).

One FLy server answers both arms, as a user would run it: the baseline arm adds
`verification="standard"` to each request (lossless), the candidate uses the server's FLy verification.
The reference answers are the target model's own greedy outputs, so the baseline must score 100% and
every question the candidate loses is one where FLy changed the output.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from test_server import perturbed_copy
from tiny_llm import save_tiny

from flyspec import LLM, SamplingParams
from flyspec.config import EngineConfig
from flyspec.engine.engine import LLMEngine
from flyspec.gate.data.store import GateStore
from flyspec.gate.report.build import build_report
from flyspec.gate.runs.run import run_gate
from flyspec.server.app import build_app
from flyspec.server.background import serve_in_background

KEY = "gate-key"
MAX_TOKENS = 12


def test_gate_endpoint_arms_against_the_flyspec_server(tmp_path: Path) -> None:
    """A gate run with two endpoint arms on one FLy server registers the served model's id and stores
    every answer with the server's acceptance counters; the baseline (verification="standard")
    reproduces target-only greedy output on every question and never forgives; the candidate's lost count
    equals the questions whose FLy output differs from the target's, and it gains none."""
    target = save_tiny(tmp_path / "target", seed=0)
    draft = perturbed_copy(target, tmp_path / "draft", noise=0.02, seed=1)
    prompts = [f"w{i} w{i + 3} w{2 * i + 1}" for i in range(10)]
    reference = LLM(str(target), dtype="float32", max_model_len=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    answers = [o.outputs[0].text for o in reference.generate(prompts, greedy, use_tqdm=False)]
    dataset = tmp_path / "echo.jsonl"
    dataset.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": p, "answer": a, "grader": "exact"}) + "\n"
            for i, (p, a) in enumerate(zip(prompts, answers, strict=True))
        )
    )
    spec = {
        "model": str(draft),
        "num_speculative_tokens": 3,
        "rejection_sample_method": "fly",
        "fly_window_size": 1,
        "fly_entropy_threshold": 0.0,
    }
    engine = LLMEngine(
        EngineConfig(model=str(target), speculative_config=spec, dtype="float32", max_model_len=64)
    )
    app = build_app(engine, served_model_name="tiny", api_key=KEY)
    with serve_in_background(app) as server:
        arm = {"base_url": server.base_url, "model": "tiny", "api_key": KEY, "concurrency": 3}
        store = tmp_path / "gate.sqlite"
        run_id = run_gate(
            store,
            str(dataset),
            baseline={**arm, "extra_body": {"verification": "standard"}},
            candidate=arm,
            margin=0.1,
            temperature=0.0,
            max_tokens=MAX_TOKENS,
            progress=False,
        )
        fly_texts = [
            httpx.post(
                f"{server.base_url}/v1/completions",
                json={"model": "tiny", "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.0},
                headers={"Authorization": f"Bearer {KEY}"},
                timeout=60,
            ).json()["choices"][0]["text"]
            for p in prompts
        ]

    changed = sum(t.strip() != a.strip() for t, a in zip(fly_texts, answers, strict=True))
    assert changed > 0  # the setting is chosen so that FLy does change some outputs
    pooled = build_report(store, run_id).pooled
    assert pooled is not None
    assert pooled.n == len(prompts) and pooled.baseline_accuracy == 1.0
    assert (pooled.lost, pooled.gained) == (changed, 0)
    with GateStore(store) as opened:
        records = opened.answers(run_id)
        run = opened.get_run(run_id)
    assert run is not None
    # The registration says which model each endpoint arm is, as the server's /v1/models reports it.
    assert {arm["served_model"]["id"] for arm in run.registration["arms"].values()} == {"tiny"}
    assert len(records) == 2 * len(prompts)
    base = [r for r in records if r.arm == "baseline"]
    cand = [r for r in records if r.arm == "candidate"]
    assert all(r.num_drafts and r.num_forgiven_tokens == 0 for r in base)
    assert sum(r.num_forgiven_tokens or 0 for r in cand) > 0
    assert all(r.completion_tokens == MAX_TOKENS or r.finish_reason == "stop" for r in records)


def test_an_arm_setting_the_server_ignores_stops_the_run_before_any_answer_is_stored(tmp_path: Path) -> None:
    """A misspelt extra_body key (`verfication` for `verification`) would make the baseline run lossy
    while registered as lossless; flyspec serve names ignored fields in a header and the gate refuses the
    arm, naming the key, with no answer stored for it."""
    target = save_tiny(tmp_path / "target", seed=0)
    dataset = tmp_path / "one.jsonl"
    dataset.write_text(json.dumps({"id": "q0", "prompt": "w1 w2", "answer": "w3", "grader": "exact"}) + "\n")
    engine = LLMEngine(EngineConfig(model=str(target), dtype="float32", max_model_len=64))
    app = build_app(engine, served_model_name="tiny")
    store = tmp_path / "gate.sqlite"
    with serve_in_background(app) as server:
        arm = {"base_url": server.base_url, "model": "tiny"}
        try:
            run_gate(
                store,
                str(dataset),
                baseline={**arm, "extra_body": {"verfication": "standard"}},
                candidate=arm,
                margin=0.1,
                temperature=0.0,
                max_tokens=4,
                progress=False,
            )
        except ValueError as exc:
            message = str(exc)
        else:
            raise AssertionError("the run went on with an ignored arm setting")
    assert "verfication" in message and "ignored" in message
    with GateStore(store) as opened:
        run = opened.runs()[0]
        assert not [r for r in opened.answers(run.run_id) if r.arm == "baseline"]
