"""The alert rules and the Grafana dashboard: valid, unit-tested, and made only of metrics eft exports.

Whether each query returns data in a real run is checked against a real Prometheus in
tests/test_demo.py; here, what can be checked without a run.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from elasticft.metrics.catalog import exposed_names

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "examples" / "prometheus" / "eft-rules.yml"
DASHBOARD = ROOT / "examples" / "grafana" / "eft.json"
NAME = re.compile(r"\beft_[a-z0-9_]+")


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool is missing: install Debian's prometheus package (.ci/setup does)"
    return found


def dashboard_module():
    spec = importlib.util.spec_from_file_location("eft_dashboard", DASHBOARD.parent / "dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rule_expressions() -> list[str]:
    return re.findall(r"^\s+expr: (.+)$", RULES.read_text(), flags=re.MULTILINE)


def test_promtool_checks_the_rules_and_their_unit_tests_pass():
    for args in (["check", "rules", RULES.name], ["test", "rules", "eft-rules.test.yml"]):
        done = subprocess.run([promtool(), *args], cwd=RULES.parent, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_dashboard_file_is_what_its_builder_writes():
    built = dashboard_module().build()
    assert json.loads(DASHBOARD.read_text()) == built, \
        "examples/grafana/eft.json is stale: python examples/grafana/dashboard.py > examples/grafana/eft.json"


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_every_metric_a_query_names_is_one_eft_exports(source):
    expressions = rule_expressions() if source == "rules" else \
        dashboard_module().expressions(json.loads(DASHBOARD.read_text()))
    named = {name for expr in expressions for name in NAME.findall(expr)}
    assert expressions and named
    assert named <= exposed_names(), f"not exported: {sorted(named - exposed_names())}"
