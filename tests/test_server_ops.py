"""The operations files in ops/: Prometheus alert rules (checked and unit-tested with promtool) and the
Grafana dashboard, both reading only metrics the server really exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flyspec.server.metrics import ServerMetrics

OPS = Path(__file__).resolve().parent.parent / "ops"
RULES = OPS / "prometheus" / "flyspec-alerts.yml"
RULE_TESTS = OPS / "prometheus" / "flyspec-alerts.test.yml"
DASHBOARD = OPS / "grafana" / "flyspec-dashboard.json"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian: apt-get install prometheus)"
)
_METRIC = re.compile(r"flyspec:[A-Za-z0-9_:]+")


def _rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def _recorded_names() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["record"] for group in groups for rule in group["rules"] if "record" in rule}


def _dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel["targets"]]


@needs_promtool
def test_alert_rules_pass_promtool_check_and_unit_tests() -> None:
    """`promtool check rules` accepts the rules file, and `promtool test rules` shows each alert firing on
    the series it is meant for (lossy on, acceptance drop, forgiven share rise, admission plateau, engine
    errors) and staying quiet on healthy series."""
    for args in (["check", "rules", str(RULES)], ["test", "rules", str(RULE_TESTS)]):
        result = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=RULES.parent)
        assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_dashboard_queries_are_valid_promql(tmp_path: Path) -> None:
    """Every dashboard query parses as PromQL: promtool checks them as recording rules (Grafana's
    variables replaced by match-all regexes)."""
    exprs = [e.replace("$model_name", ".*").replace("$instance", ".*") for e in _dashboard_exprs()]
    rules = {
        "groups": [
            {"name": "dashboard", "rules": [{"record": f"q{i}", "expr": e} for i, e in enumerate(exprs)]}
        ]
    }
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_and_dashboard_read_only_exported_metrics() -> None:
    """Every flyspec metric the alert rules and the dashboard query is in what the server exports (its
    metrics registry, rendered as /metrics renders it) or recorded by the rules themselves, so no panel or
    alert silently reads nothing; the dashboard's panels all carry a datasource and at least one query."""
    text = generate_latest(
        ServerMetrics("m", num_speculative_tokens=2, lossy=True, max_running=8).registry
    ).decode()
    exported = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    used = {m for expr in _rule_exprs() + _dashboard_exprs() for m in _METRIC.findall(expr)}
    missing = sorted(used - exported - _recorded_names())
    assert not missing, missing
    assert {"flyspec:max_running_requests", "flyspec:lossy_verification_enabled"} <= used
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert panels and all(p["datasource"] and p["targets"] for p in panels)
