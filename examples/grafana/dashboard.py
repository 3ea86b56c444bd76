"""eft's Grafana dashboard, built with Grafana's own SDK (grafana-foundation-sdk): writes eft.json.

    pip install grafana-foundation-sdk && python examples/grafana/dashboard.py > examples/grafana/eft.json

Import eft.json in Grafana (Dashboards > New > Import) and pick the Prometheus data source that
scrapes the agents (docs/metrics.md). ``tests/test_metrics_rules.py`` checks that eft.json is what
this script writes, and the Prometheus acceptance test runs every query below against a real run.
Panels: the job's progress and goodput, a per-GPU risk heat map, restarts with their phases,
checkpoint ages per tier, the memory tier's replication lag and bytes, etcd.
"""

from __future__ import annotations

import json

from grafana_foundation_sdk.builders import dashboard, heatmap, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
RUN = 'run=~"$run"'

# (title, unit, [(PromQL, legend)], width): one row of panels after another, 24 units wide.
TIMESERIES = [
    ("Iteration (newest, by node)", "none", [(f"max by (run, node) (eft_iteration{{{RUN}}})", "{{node}}")], 12),
    ("Iterations per second", "none", [(f"eft_iterations_per_second{{{RUN}}}", "{{node}}")], 12),
    ("GPU-seconds by cause (the job's, eft report's categories)", "s",
     [(f"eft_gpu_seconds{{{RUN}}}", "{{cause}}")], 12),
    ("World size and layout", "none", [(f"max by (run) (eft_world_size{{{RUN}}})", "world size"),
                                       (f"max by (run, dim) (eft_parallel_size{{{RUN}}})", "{{dim}}")], 12),
    ("Restarts by reason (per hour)", "none",
     [(f"sum by (run, reason) (increase(eft_job_restarts_total{{{RUN}}}[1h]))", "{{reason}}")], 8),
    ("Restart downtime by phase (mean)", "s",
     [(f"sum by (run, phase) (rate(eft_restart_phase_seconds_sum{{{RUN}}}[1h])) / "
       f"sum by (run, phase) (rate(eft_restart_phase_seconds_count{{{RUN}}}[1h]))", "{{phase}}")], 8),
    ("Restart budget left", "none", [(f"min by (run) (eft_restart_budget_remaining{{{RUN}}})", "budget left")], 8),
    ("Save stalls: a step's wait for a background save (p90, by tier)", "s",
     [(f"histogram_quantile(0.9, sum by (run, tier, le) (rate(eft_save_stall_seconds_bucket{{{RUN}}}[5m])))",
       "{{tier}}")], 8),
    ("Newest checkpoint's age by tier", "s",
     [(f"min by (run, tier) (eft_checkpoint_age_seconds{{{RUN}}})", "{{tier}}")], 8),
    ("Newest checkpoint's iteration by tier", "none",
     [(f"max by (run, tier) (eft_checkpoint_iteration{{{RUN}}})", "{{tier}}")], 8),
    ("Memory tier: replication lag (snapshots)", "none",
     [(f"eft_memory_replication_lag_snapshots{{{RUN}}}", "{{node}}"),
      (f"max by (run) (eft_memory_replication_lag_limit_snapshots{{{RUN}}})", "limit")], 8),
    ("Memory tier: bytes replicated per second", "Bps",
     [(f"sum by (run, node) (rate(eft_memory_replicated_bytes_total{{{RUN}}}[5m]))", "{{node}}")], 8),
    ("etcd reachable (1) by node", "none", [(f"eft_etcd_up{{{RUN}}}", "{{node}}")], 8),
    ("Agents scraped (up)", "none", [(f'up{{job="eft", {RUN}}}', "{{node}}")], 8),
]


def _query(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DATASOURCE)


def build() -> dict:
    board = (dashboard.Dashboard("eft: elastic fault-tolerant training").uid("eft-training").tags(["eft", "megatron"])
             .refresh("30s").time("now-6h", "now").timezone("browser")
             .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
             .with_variable(dashboard.QueryVariable("run").label("run").datasource(DATASOURCE)
                            .query("label_values(eft_world_size, run)").multi(True).include_all(True).refresh(2)))
    board = board.with_panel(stat.Panel().title("Goodput so far").unit("percentunit").decimals(1).span(6).height(4)
                             .with_target(_query(f"eft_goodput_ratio{{{RUN}}}", "{{run}}", "A"))
                             .datasource(DATASOURCE))
    board = board.with_panel(heatmap.Panel().title("GPU risk (per GPU; the trigger is the job's threshold)")
                             .span(18).height(8)
                             .with_target(_query(f"eft_gpu_risk{{{RUN}}}", "{{node}}/gpu{{gpu}}", "A"))
                             .datasource(DATASOURCE))
    for title, unit, queries, width in TIMESERIES:
        panel = timeseries.Panel().title(title).unit(unit).span(width).height(8).datasource(DATASOURCE)
        for index, (expr, legend) in enumerate(queries):
            panel = panel.with_target(_query(expr, legend, chr(ord("A") + index)))
        board = board.with_panel(panel)
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


def expressions(model: dict) -> list[str]:
    """Every PromQL query of a dashboard model (what the acceptance test runs)."""
    return [target["expr"] for panel in model.get("panels", []) for target in panel.get("targets", [])]


if __name__ == "__main__":
    print(json.dumps(build(), indent=2, sort_keys=True))
