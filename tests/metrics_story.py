"""What an operator's Prometheus sees of the demo's story (a dying GPU, then its node lost).

The demo's agents serve /metrics on free ports; ``eft metrics targets --watch`` keeps the targets
file that a real Prometheus (tests/prometheus_server.py) reads; every fact is then asked of
Prometheus' HTTP API, as a dashboard or an alert would ask it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.prometheus_server import RULES, PrometheusServer

ROOT = Path(__file__).resolve().parents[1]
# free ports (found through the node records), loopback only; the job's goodput every 2 s, not 60
METRICS_FLAGS = ["--eft-metrics-port", "0", "--eft-metrics-host", "127.0.0.1", "--eft-metrics-goodput-interval", "2"]


class TargetsWatch:
    """``eft metrics targets --watch`` for the demo's run, from its first look on; and the alerts seen firing."""

    def __init__(self, prometheus: PrometheusServer):
        self.prometheus = prometheus
        self.run_id: str | None = None
        self.started = time.time()
        self.firing: set[str] = set()
        self._proc: subprocess.Popen | None = None

    def during(self, endpoint: str, run_id: str, nodes: dict, done: int) -> None:
        """The demo's callback, every 0.2 s while it runs."""
        if self._proc is None:
            self.run_id = run_id
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "launcher.cli", "metrics", "targets", "--endpoint", endpoint, "--run-id", run_id,
                 "--watch", "--interval", "0.5", "--output", str(self.prometheus.targets / "eft.json")], cwd=ROOT)
        self.firing |= self.prometheus.firing()

    def __enter__(self) -> "TargetsWatch":
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(30)


def _values(prometheus: PrometheusServer, expr: str, start: float, end: float) -> dict[str, set[float]]:
    """Each series' distinct values over the run, by its node label."""
    found: dict[str, set[float]] = {}
    for series in prometheus.query_range(expr, start, end):
        found.setdefault(series["metric"].get("node", ""), set()).update(float(v) for _, v in series["values"])
    return found


def assert_prometheus_saw_the_story(prometheus: PrometheusServer, watch: TargetsWatch, result: dict,
                                    lost_at: int) -> None:
    """``lost_at``: the iteration at which the demo loses its node."""
    start, end, run = watch.started, time.time(), watch.run_id
    assert run is not None
    sel = f'run="{run}"'
    risk = _values(prometheus, f"max by (node) (eft_gpu_risk{{{sel}}})", start, end)
    assert max(risk["node1"]) >= 0.8 > max(risk["node0"]), risk  # the dying GPU crossed the trigger
    assert "EftGpuAtRisk" in watch.firing, watch.firing
    assert "EftNodeLost" in watch.firing, watch.firing  # the lost node's target went, the survivor alerts
    restarts = _values(prometheus, f'eft_restarts_total{{{sel}, node="node0", reason="membership"}}', start, end)
    assert max(restarts["node0"]) >= 1, restarts  # the loss's restart, with its reason
    job = _values(prometheus, f'sum by (run) (eft_job_restarts_total{{{sel}, reason="membership"}})', start, end)
    assert max(job[""]) >= 1, job  # ... counted once for the job
    for tier in ("disk", "memory"):  # both tiers' newest iterations: one made after the loss is shown
        seen = _values(prometheus, f'max by (node) (eft_checkpoint_iteration{{{sel}, tier="{tier}"}})', start, end)
        assert seen.get("node0") and max(seen["node0"]) > lost_at, (tier, lost_at, seen)
    pushed = _values(prometheus, f'eft_memory_replicated_bytes_total{{{sel}, node="node0"}}', start, end)
    assert max(pushed["node0"]) > 0, pushed  # the survivor's snapshots reached their replica holder
    up = _values(prometheus, f'up{{job="eft", {sel}}}', start, end)
    assert 0 in up["node1"] and 1 in up["node1"], up  # the lost node's target went down
    world = _values(prometheus, f'eft_world_size{{{sel}, node="node0"}}', start, end)
    assert {4, 2} <= world["node0"], world  # the survivor's world size changed
    _every_query_answers(prometheus, run, start, end)


def _every_query_answers(prometheus: PrometheusServer, run: str, start: float, end: float) -> None:
    """Every dashboard query returns data in this run; every rule was evaluated without error, and
    every metric it names has data (an alert's condition is true only when it fires)."""
    sys.path.insert(0, str(ROOT / "examples" / "grafana"))
    try:
        import dashboard  # examples/grafana/dashboard.py
    finally:
        sys.path.pop(0)
    model = json.loads((ROOT / "examples" / "grafana" / "eft.json").read_text())
    empty = [expr for expr in dashboard.expressions(model)
             if not prometheus.query_range(expr.replace("$run", run), start, end, step=1.0)]
    assert not empty, f"dashboard queries with no data: {empty}"
    groups = prometheus.api("rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == RULES.read_text().count("- alert:")
    assert all(rule["health"] == "ok" for rule in rules), [(r["name"], r.get("lastError")) for r in rules]
    names = {n for rule in rules for n in re.findall(r"\beft_[a-z0-9_]+", rule["query"])}
    missing = [n for n in sorted(names) if not prometheus.query_range(f'{n}{{run="{run}"}}', start, end, step=1.0)]
    assert not missing, f"rules name metrics with no data in the run: {missing}"
