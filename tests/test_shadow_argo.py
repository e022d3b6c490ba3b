"""The Argo Rollouts AnalysisTemplate of docs/shadow.md reads the real series: its Prometheus queries run
in `promtool test rules` on the series a real shadow process's /metrics exposes (a run that decided FAIL),
and Argo's success and failure conditions, applied to the results, give what the decision says."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from shadow_harness import arm, shadow_run, upstream

from flyspec.bench.peers import free_port
from flyspec.bench.scripted_openai import Script

DOC = Path(__file__).resolve().parent.parent / "docs" / "shadow.md"
PROMTOOL = shutil.which("promtool")
JOB = "flyspec-shadow"
_CONDITION = re.compile(r"^result\[0\] (==|>|<|>=|<=) (-?\d+(?:\.\d+)?)$")


def template() -> dict:
    """The AnalysisTemplate, as the docs show it."""
    blocks = re.findall(r"```text\n(.*?)```", DOC.read_text(), re.DOTALL)
    found = [yaml.safe_load(b) for b in blocks if "kind: AnalysisTemplate" in b]
    assert len(found) == 1
    return found[0]


def holds(condition: str, value: float) -> bool:
    """An Argo condition of the one form the template uses (``result[0] OP NUMBER``) on ``value``."""
    match = _CONDITION.match(condition)
    assert match, f"condition {condition!r} is not of the form result[0] OP NUMBER"
    op, number = match.group(1), float(match.group(2))
    return {
        "==": value == number,
        ">": value > number,
        "<": value < number,
        ">=": value >= number,
        "<=": value <= number,
    }[op]


def scraped(root: str) -> list[tuple[str, dict[str, str], float]]:
    """The samples of the shadow's /metrics, as Prometheus would store them (``_created`` left out)."""
    text = httpx.get(root + "/metrics").text
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    ]


def _series(name: str, labels: dict[str, str], value: float) -> dict[str, str]:
    every = {**labels, "job": JOB, "instance": "shadow:8100"}
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(every.items()))
    shown = "NaN" if value != value else repr(value)
    return {"series": f"{name}{{{inner}}}", "values": f"{shown}x30"}


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus)")
def test_the_analysis_template_reads_the_real_series(tmp_path: Path) -> None:
    down = f"http://127.0.0.1:{free_port()}/v1"  # a candidate that never answers: a FAIL without labels
    with upstream(Script("base")) as base:
        judge = {"base_url": base + "/v1", "model": "judge"}
        with shadow_run(tmp_path / "s.db", arm(base + "/v1", "base"), arm(down, "cand"), judge) as (root, _):
            client = OpenAI(base_url=root + "/v1", api_key="none", max_retries=0)
            deadline = time.monotonic() + 60
            while httpx.get(root + "/decision").json()["decision"] != "FAIL":
                assert time.monotonic() < deadline, "the run did not decide"
                client.completions.create(model="m", prompt="hello")
            samples = scraped(root)
    decision = next(v for n, _, v in samples if n == "flyspec_shadow_decision")
    assert decision == -1

    metrics = template()["spec"]["metrics"]
    assert {m["name"] for m in metrics} == {"flyspec-shadow-decision", "flyspec-shadow-stores-pairs"}
    queries = {m["name"]: m["provider"]["prometheus"]["query"].replace("{{args.job}}", JOB) for m in metrics}
    expected = {"flyspec-shadow-decision": decision, "flyspec-shadow-stores-pairs": 0.0}
    recorded = [{"record": "argo:" + name.replace("-", "_"), "expr": q} for name, q in queries.items()]
    rules = {"groups": [{"name": "argo", "rules": recorded}]}
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    tests = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [_series(*sample) for sample in samples],
                "promql_expr_test": [
                    {
                        "expr": queries[name],
                        "eval_time": "20m",
                        "exp_samples": [{"labels": "{}", "value": value}],
                    }
                    for name, value in expected.items()
                ],
            }
        ],
    }
    (tmp_path / "rules.test.yml").write_text(yaml.safe_dump(tests))
    for args in (["check", "rules", "rules.yml"], ["test", "rules", "rules.test.yml"]):
        done = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 0, done.stdout + done.stderr

    # Argo's reading of those results: the decision's metric fails (FAIL), the store's succeeds.
    by_name = {m["name"]: m for m in metrics}
    outcome = {
        name: (holds(by_name[name]["successCondition"], v), holds(by_name[name]["failureCondition"], v))
        for name, v in expected.items()
    }
    assert outcome == {"flyspec-shadow-decision": (False, True), "flyspec-shadow-stores-pairs": (True, False)}
    assert (
        holds(by_name["flyspec-shadow-decision"]["successCondition"], 1.0),
        holds(by_name["flyspec-shadow-decision"]["failureCondition"], 0.0),
    ) == (True, False)
