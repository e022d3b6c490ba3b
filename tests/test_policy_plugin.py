"""The policy seam (docs/architecture.md, "Adding a verification policy"): a verification policy defined
only in this file, and registered from here, runs through `verify()`, `SpeculativeConfig`, the engine
(`LLM.generate`), the OpenAI server over real HTTP, `gate tune` and `flyspec bench`, with no edit to any
package file.

The toy policy keeps a natively rejected draft token when the target's probability of it is at least
`toy_min_ratio` times the drafter's, P_i(d_i) / Q_i(d_i) >= r (Q_i(d_i) = 1 for greedy drafts and n-gram
lookup). It is lossy. With r = 1 it forgives nothing on greedy rows (a rejected greedy draft is not the
target's argmax, so P_i(d_i) < 1): output identical to standard speculative decoding. With r = 0.001
nearly every rejection is forgiven. Tiny random-weight models (tests/tiny_llm.py) carry the engine
mechanics; the rule itself is checked exactly on hand-made distributions.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
import torch
from tiny_llm import save_perturbed, save_tiny

from flyspec import LLM, SamplingParams, SpeculativeConfig
from flyspec.spec_decode.policies import register_policy, unregister_policy
from flyspec.spec_decode.policies.base import (
    Drafts,
    VerificationPolicy,
    config_field,
    integer_rule,
    number_rule,
)
from flyspec.spec_decode.verify import verify

if TYPE_CHECKING:
    from flyspec.engine.engine import LLMEngine


@dataclass(frozen=True)
class RatioPolicy(VerificationPolicy):
    """Forgive a native rejection when P_i(d_i) / Q_i(d_i) >= min_ratio."""

    name = "toy"
    title = "Toy ratio"
    forgives = "accepted draft tokens whose target/draft probability ratio reached toy_min_ratio"

    min_ratio: float = config_field(
        "toy_min_ratio",
        rule=number_rule("it must be a finite number in (0, 1]", lambda r: 0 < r <= 1),
        short="r",
        default=0.5,
    )

    def forgiven(self, drafts: Drafts) -> torch.Tensor:
        return drafts.candidates & (drafts.p_draft >= self.min_ratio * drafts.q_draft)


MAX_TOKENS = 8
K = 3
PROMPTS = [f"w{i} w{2 * i} w{3 * i}" for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module", autouse=True)
def toy() -> Iterator[type[RatioPolicy]]:
    """The toy policy registered for this file's tests only."""
    register_policy(RatioPolicy)
    yield RatioPolicy
    unregister_policy("toy")


@dataclass(frozen=True)
class Models:
    target: Path
    draft: Path
    target_only: list[list[int]]
    """The target's own greedy output for PROMPTS."""
    target_texts: list[str]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """A target that is often unsure and a draft close to it, so drafts are accepted and rejected."""
    root = tmp_path_factory.mktemp("toy_policy")
    target = save_tiny(root / "target", seed=3, std=0.25)
    draft = save_perturbed(target, root / "draft", seed=5, noise=0.003)
    outs = LLM(str(target), dtype="float32").generate(PROMPTS, GREEDY, use_tqdm=False)
    return Models(
        target, draft, [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs]
    )


def _spec(models: Models, **policy: object) -> dict:
    return {"model": str(models.draft), "num_speculative_tokens": K, **policy}


def test_verify_forgives_by_the_ratio_of_both_probabilities_of_the_drafted_token() -> None:
    """Four rows, each natively rejected at its one draft position (u = 0.99; row 3 greedy, its draft not
    the argmax). With draft probabilities: P/Q = 0.2/0.3 is forgiven although P < 0.5, 0.1/0.4 is not, a
    token the target forbids (P = 0) never is, and the greedy row's 0.4/0.25 is. Without them (Q = 1) the
    rule compares P itself. A forgiven position emits the draft token."""
    target = torch.zeros(4, 2, 4)
    draft = torch.zeros(4, 1, 4)
    for row, (p, q) in enumerate([(0.2, 0.3), (0.1, 0.4), (0.0, 0.5), (0.4, 0.25)]):
        target[row, 0] = torch.tensor([1 - p, p, 0.0, 0.0])
        draft[row, 0] = torch.tensor([1 - q, q, 0.0, 0.0])
    target[:, 1] = 0.25
    tokens = torch.ones(4, 1, dtype=torch.int64)
    kwargs = dict(
        greedy=torch.tensor([False, False, False, True]),
        uniform=torch.full((4, 1), 0.99, dtype=torch.float64),
        sample_uniform=torch.full((4,), 0.5, dtype=torch.float64),
    )
    assert verify(tokens, target, draft, **kwargs).num_accepted.tolist() == [0, 0, 0, 0]
    out = verify(tokens, target, draft, policy=RatioPolicy(0.5), **kwargs)
    assert out.num_forgiven.tolist() == [1, 0, 0, 1] and out.token_ids[:, 0].tolist() == [1, 0, 0, 1]
    for r, forgiven in ((0.5, [0, 0, 0, 0]), (0.15, [1, 0, 0, 1]), (0.05, [1, 1, 0, 1])):
        assert verify(tokens, target, None, policy=RatioPolicy(r), **kwargs).num_forgiven.tolist() == forgiven
    with pytest.raises(ValueError, match=r"min_ratio=0.0 is invalid: it must be a finite number in \(0, 1\]"):
        RatioPolicy(0.0)


def test_speculative_config_takes_the_toys_field_by_its_own_rules() -> None:
    """SpeculativeConfig knows the toy by name: its field's default and rule, the canonical form, the
    verifier object, the lossy flag and warning, and the error for its field under another policy. Its
    field reads as an attribute (None in a config of another policy), as the built-in policies' do."""
    cfg = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "toy"}
    )
    assert cfg.policy_settings == {"toy_min_ratio": 0.5} and cfg.is_lossy and cfg.lossless_prefix_tokens == 0
    assert cfg.toy_min_ratio == 0.5 and cfg.fly_window_size is None
    fly = SpeculativeConfig(method="ngram", num_speculative_tokens=2, rejection_sample_method="fly")
    assert fly.toy_min_ratio is None and fly.fly_window_size == 1
    assert cfg.verification_policy(100) == RatioPolicy(0.5)
    again = SpeculativeConfig.from_dict({**cfg.to_dict(), "toy_min_ratio": 1})
    assert again.to_dict()["toy_min_ratio"] == 1.0 and SpeculativeConfig.from_dict(again.to_dict()) == again
    with pytest.raises(ValueError, match="toy_min_ratio=2 is invalid: it must be a finite number in"):
        SpeculativeConfig.from_dict({**cfg.to_dict(), "toy_min_ratio": 2})
    with pytest.raises(ValueError, match="toy_min_ratio=0.5 is invalid: Toy ratio settings only apply"):
        SpeculativeConfig(
            method="ngram", num_speculative_tokens=2, rejection_sample_method="fly", toy_min_ratio=0.5
        )
    assert RatioPolicy.lossy_warning().startswith("Toy ratio verification is lossy")
    assert RatioPolicy.label({"toy_min_ratio": 0.25}) == "r=0.25"


def _forgiven(outs: list) -> int:
    return sum(o.metrics.counts.num_forgiven_tokens for o in outs)


def test_engine_runs_the_toy_by_name(models: Models, caplog: pytest.LogCaptureFixture) -> None:
    """LLM.generate with rejection_sample_method="toy": the engine logs the toy's lossy warning; at r = 1
    nothing is forgiven and the output is the target's own greedy output; at r = 0.001 tokens are
    forgiven, and a request that asks for verification="standard" is still the target's output."""

    def toy_llm(ratio: float) -> LLM:
        spec = _spec(models, rejection_sample_method="toy", toy_min_ratio=ratio)
        return LLM(str(models.target), speculative_config=spec, dtype="float32")

    with caplog.at_level(logging.WARNING):
        strict = toy_llm(1.0)
    assert any("Toy ratio verification is lossy" in r.getMessage() for r in caplog.records)
    outs = strict.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == models.target_only and _forgiven(outs) == 0
    loose = toy_llm(0.001)
    named = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, verification="toy")
    assert _forgiven(loose.generate(PROMPTS, named, use_tqdm=False)) > 0
    lossless = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, verification="standard")
    outs = loose.generate(PROMPTS, lossless, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == models.target_only and _forgiven(outs) == 0


@pytest.fixture(scope="module")
def toy_server(models: Models) -> Iterator[tuple[str, LLMEngine]]:
    from flyspec.config import EngineConfig
    from flyspec.engine.engine import LLMEngine
    from flyspec.server.app import build_app
    from flyspec.server.background import serve_in_background

    spec = _spec(models, rejection_sample_method="toy", toy_min_ratio=0.001)
    engine = LLMEngine(EngineConfig(model=str(models.target), speculative_config=spec, dtype="float32"))
    with serve_in_background(build_app(engine, served_model_name="tiny")) as server:
        yield server.base_url, engine


def test_server_serves_the_toy_over_http(toy_server: tuple[str, LLMEngine], models: Models) -> None:
    """An in-process flyspec server on loopback, real HTTP: `verification: "toy"` is accepted and forgives
    (counted in /metrics), "standard" gives the target's own greedy text, naming another policy than the
    engine's (fly) is a 400 on the verification field, and the lossy gauge reads 1."""
    url, _ = toy_server
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
    toy_reply = httpx.post(f"{url}/v1/completions", json={**body, "verification": "toy"}, timeout=60)
    assert toy_reply.status_code == 200, toy_reply.text
    std = httpx.post(f"{url}/v1/completions", json={**body, "verification": "standard"}, timeout=60).json()
    assert std["choices"][0]["text"] == models.target_texts[0]
    wrong = httpx.post(f"{url}/v1/completions", json={**body, "verification": "fly"}, timeout=60)
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "verification"
    for _ in range(5):  # enough drafts for a forgiveness to show in the counter
        httpx.post(f"{url}/v1/completions", json={**body, "prompt": PROMPTS[1]}, timeout=60)
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'flyspec:lossy_verification_enabled{model_name="tiny"} 1.0' in metrics
    forgiven = [
        line
        for line in metrics.splitlines()
        if line.startswith("flyspec:spec_decode_num_forgiven_tokens_total")
    ]
    assert forgiven and float(forgiven[0].split()[-1]) > 0


def _dataset(models: Models, path: Path) -> Path:
    """Exact-match questions whose references are the target's greedy answers (standard SD gets them all
    right; a setting loses a question exactly where it changes the answer)."""
    llm = LLM(str(models.target), dtype="float32")
    outs = llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False)
    lines = [
        json.dumps({"id": f"q{i}", "prompt": p, "answer": o.outputs[0].text, "grader": "exact"})
        for i, (p, o) in enumerate(zip(PROMPTS * 2, outs, strict=True))
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_gate_tune_orders_and_tests_toy_settings(models: Models, tmp_path: Path) -> None:
    """`gate tune` (Python API) over a --policies grid of toy settings: the baseline and a toy arm share
    one engine (they differ only in the verifier), the settings are labelled by the toy's own short
    names, r = 1 (no forgiveness) is ordered first by calibration speed with the baseline's acceptance,
    and the registered settings carry the toy's config to paste."""
    from flyspec.gate.arms import parse_arm
    from flyspec.gate.arms.engine import engine_groups
    from flyspec.gate.report.tune_report import build_tune_report
    from flyspec.gate.runs.tune import TuneOptions, tune

    engine = {"kind": "engine", "model": str(models.target), "dtype": "float32", "max_num_seqs": 4}
    baseline = {**engine, "speculative_config": _spec(models, rejection_sample_method="standard")}
    toy_arm = {**baseline, "speculative_config": _spec(models, rejection_sample_method="toy")}
    assert len(engine_groups([parse_arm("b", baseline), parse_arm("t", toy_arm)])) == 1
    options = TuneOptions(
        store=tmp_path / "tune.db",
        datasets=(str(_dataset(models, tmp_path / "words.jsonl")),),
        baseline=baseline,
        margin=0.5,
        policies={"rejection_sample_method": "toy", "toy_min_ratio": [0.001, 1.0]},
        calibration_questions=3,
        max_questions=4,
        max_tokens=MAX_TOKENS,
        sequential=False,
        progress=False,
    )
    assert tune(options).reason == "complete"
    report = build_tune_report(options.store).to_dict()
    settings = {s["id"]: s for s in report["settings"]}
    assert {sid: (s["policy"], s["label"]) for sid, s in settings.items()} == {
        "s1": ("toy", "r=0.001"), "s2": ("toy", "r=1"),
    }  # fmt: skip
    assert settings["s2"]["speculative_config"]["toy_min_ratio"] == 1.0
    order = report["order"]
    assert order["settings"][0] == "s2"
    assert order["values"]["s2"] == pytest.approx(report["baseline"]["mean_acceptance_length"])
    assert order["values"]["s1"] > order["values"]["s2"]
    strict = settings["s2"]
    assert (strict["lost"], strict["gained"]) == (0, 0)


def test_flyspec_bench_measures_toy_settings(models: Models, tmp_path: Path) -> None:
    """`flyspec bench --methods target,standard,toy --policies GRID` in-process: the toy at its default
    and at each grid setting, labelled by the settings off its defaults, each compared with standard SD;
    r = 1 forgives nothing and reproduces target-only output, r = 0.001 forgives; the Markdown records
    each arm's resolved settings and the command that re-measures the r = 1 arm names it in a grid."""
    from typer.testing import CliRunner

    from flyspec.cli import app

    out_json, out_md = tmp_path / "bench.json", tmp_path / "BENCH.md"
    grid = {"rejection_sample_method": "toy", "toy_min_ratio": [1.0, 0.001]}
    args = [
        "bench", "--model", str(models.target), "--draft", str(models.draft), "--batch-sizes", "1",
        "--k", "2", "--methods", "target,standard,toy", "--policies", json.dumps(grid), "--peer", "none",
        "--num-prompts", "2", "--max-tokens", "6", "--warmup-tokens", "2", "--dtype", "float32",
        "--json", str(out_json), "--markdown", str(out_md),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(out_json.read_text())
    rows = {r["label"]: r for r in report["results"]}
    assert list(rows) == [
        "flyspec target-only b=1",
        "flyspec standard K=2 b=1",
        "flyspec toy K=2 b=1",
        "flyspec toy K=2 r=1 b=1",
        "flyspec toy K=2 r=0.001 b=1",
    ]
    strict, loose = rows["flyspec toy K=2 r=1 b=1"], rows["flyspec toy K=2 r=0.001 b=1"]
    assert strict["settings"] == {"toy_min_ratio": 1.0} and strict["forgiven_share"] == 0.0
    assert strict["prefix_match"] == 1.0 and loose["forgiven_share"] > 0
    names = {r["name"] for r in report["ratios"]}
    assert {f"{label} / standard" for label in rows if "toy" in label} <= names
    markdown = out_md.read_text()
    assert "`toy K=2 r=0.001`: toy_min_ratio 0.001" in markdown
    assert '--policies \'{"rejection_sample_method":"toy","toy_min_ratio":1.0}\'' in markdown


def test_register_policy_refuses_what_could_not_work() -> None:
    """register_policy names what is wrong with a class it cannot register: not a frozen dataclass, no
    title, a name another class holds, a field another policy owns; registering the same class twice
    changes nothing, and the built-in policies cannot be unregistered."""

    class Loose(VerificationPolicy):
        name, title = "loose", "Loose"

    @dataclass(frozen=True)
    class Untitled(VerificationPolicy):
        name = "untitled"

    @dataclass(frozen=True)
    class Impostor(VerificationPolicy):
        name, title = "fly", "Not FLy"

    @dataclass(frozen=True)
    class Thief(VerificationPolicy):
        name, title = "thief", "Thief"
        window: int = config_field("fly_window_size", rule=integer_rule(1), short="W", default=1)

    for cls, message in (
        (Loose, "must be a frozen dataclass"),
        (Untitled, "needs a title"),
        (Impostor, "'fly' is already FlyParams"),
        (Thief, "'fly_window_size' already belongs to 'fly'"),
    ):
        with pytest.raises(ValueError, match=message):
            register_policy(cls)
    assert register_policy(RatioPolicy) is RatioPolicy
    with pytest.raises(ValueError, match="'fly' is built in"):
        unregister_policy("fly")
