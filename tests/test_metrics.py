"""The agent's /metrics: what an operator's Prometheus reads, served over real HTTP from a real agent context.

The full story (two eft-run nodes, a dying GPU, a lost node, a real Prometheus) is in
tests/test_demo.py; here each part of what an agent exports is checked where it can fail alone.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.launch import wait_for
from elasticft.agent.decide import RestartReason
from elasticft.agent.metrics import KNOWN_LABELS, AgentParts, MetricsService
from elasticft.agent.restart_budget import RestartBudget
from elasticft.agent.segments import StopRecorder
from elasticft.agent.services import AgentServices
from elasticft.config import MetricsConfig, RestartConfig
from elasticft.contract.events import EventKind
from elasticft.contract.records import NodeRecord, NodeState
from elasticft.contract.restarts import RestartRecord
from elasticft.contract.run_dir import DEGRADE_MARKER
from elasticft.health import HealthSampler, RiskModel
from elasticft.health.injected import InjectedGpuSource
from elasticft.metrics.board import MetricsBoard
from elasticft.metrics.catalog import Metric, exposed_names
from elasticft.metrics.targets import file_sd
from elasticft.worker.progress import ProgressWriter
from launcher.metrics_docs import block_of, render

PAGE = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def scrape(address: str) -> dict[str, list[tuple[dict, float]]]:
    """Sample name -> [(labels, value)], as Prometheus' own text parser reads the page."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    samples: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((sample.labels, sample.value))
    return samples


def value(samples, name: str, **labels) -> float | None:
    found = [v for got, v in samples.get(name, []) if all(got.get(k) == str(want) for k, want in labels.items())]
    return found[0] if found else None


@pytest.fixture
def node(agent_context, tmp_path):
    """One agent's context, its health sampler (two GPUs, faults injected at the source) and its endpoint."""
    ctx = agent_context("n0")
    services = AgentServices()
    services.sampler = HealthSampler(InjectedGpuSource("n0", 2, ctx.run_dir), RiskModel())
    stops = StopRecorder(ctx.record, ctx.run_dir)
    service = MetricsService(MetricsConfig(metrics_port=0, metrics_host="127.0.0.1"), "127.0.0.1")
    service.connect(AgentParts(ctx, services, None, lambda: stops, lambda: 4, lambda: 2, lambda: True))
    yield ctx, services.sampler, stops, service
    service.close()


def test_an_agent_serves_its_gpus_risk_and_the_jobs_records(node, etcd):
    ctx, sampler, _, service = node
    sampler.sample_once()
    samples = scrape(service.address)
    assert value(samples, "eft_gpu_risk", run=ctx.keys.run_id, node="n0", gpu=0, uuid="GPU-injected-n0-0") < 0.8
    assert value(samples, "eft_gpu_risk_trigger", node="n0") == 0.8
    assert value(samples, "eft_etcd_up", node="n0") == 1
    assert value(samples, "eft_world_size", node="n0") == 4 and value(samples, "eft_local_workers") == 2
    # zeros before the first event: rules and increase() see the series from the start
    assert value(samples, "eft_restarts_total", reason="hang") == 0
    assert value(samples, "eft_stragglers_total") == 0

    (ctx.run_dir / DEGRADE_MARKER).write_text("1")  # GPU 1 starts failing (ECC errors, at the NVML layer)
    for _ in range(3):
        sampler.sample_once()
    etcd.put(ctx.keys.layout, json.dumps({"round": 3, "tp": 2, "pp": 1, "dp": 2, "world_size": 4}))
    etcd.put(ctx.keys.ckpt_latest, json.dumps({"iteration": 20, "time": time.time() - 30, "request_id": None}))
    etcd.put(ctx.keys.restarts, RestartRecord(charged=1, job_restarts_limit=3).to_json())
    samples = wait_for(lambda: (lambda s: s if value(s, "eft_restart_budget_remaining") is not None
                                and value(s, "eft_round") == 3 and value(s, "eft_checkpoint_iteration") else None)(
        scrape(service.address)), 10, "the watched records in the scrape")
    assert value(samples, "eft_gpu_risk", gpu=1) == 1.0 > value(samples, "eft_gpu_risk", gpu=0)  # critical: Xid 79
    assert {labels["factor"] for labels, _ in samples["eft_gpu_risk_factor"] if labels["gpu"] == "1"}
    assert [value(samples, "eft_parallel_size", dim=d) for d in ("tp", "pp", "dp")] == [2, 1, 2]
    assert value(samples, "eft_restart_budget_remaining") == 2
    assert value(samples, "eft_checkpoint_iteration", tier="disk") == 20
    assert 29 <= value(samples, "eft_checkpoint_age_seconds", tier="disk") < 60


def test_events_count_and_a_restart_is_timed_phase_by_phase_at_its_first_step(node):
    ctx, _, stops, service = node
    ctx.record(EventKind.HANG, rank=1, section="step", seconds=9.0)
    ctx.record(EventKind.CKPT_SAVED, request_id="abc", iteration=12, path="/ckpt", seconds=3.0, exit=False)
    ctx.record(EventKind.RESTART, reason="hang", remaining_restarts=2, max_restarts=3)
    stops.started()
    writer = ProgressWriter(ctx.run_dir, rank=0, local_rank=0)
    writer.add_stall("disk", 1.5)
    writer.step(13)
    writer.step(14)
    writer.write()  # the heartbeat as the rank rewrites it (every few seconds between steps)
    samples = scrape(service.address)
    assert value(samples, "eft_hangs_total", section="step") == 1
    assert value(samples, "eft_restarts_total", reason="hang") == 1
    assert value(samples, "eft_checkpoint_saves_total", kind="emergency") == 1
    assert value(samples, "eft_checkpoint_save_seconds_bucket", le="5.0") == 1
    assert value(samples, "eft_iteration", local_rank=0) == 14
    assert value(samples, "eft_save_stall_seconds_sum", tier="disk") == 1.5
    assert [value(samples, "eft_save_stall_seconds_bucket", tier="disk", le=le) for le in ("1.0", "2.5", "+Inf")] \
        == [0, 1, 1]
    assert value(samples, "eft_save_stall_seconds_count", tier="memory") == 0  # known tiers, from the start
    assert value(samples, "eft_restart_seconds_count") == 1  # observed once, however often it is scraped
    assert value(scrape(service.address), "eft_restart_seconds_count") == 1
    phases = {labels["phase"] for labels, _ in samples["eft_restart_phase_seconds_count"]}
    assert "first_step" in phases
    total = value(samples, "eft_restart_seconds_sum")
    assert sum(v for _, v in samples["eft_restart_phase_seconds_sum"]) == pytest.approx(total, abs=1e-6)


def test_a_scrape_while_workers_restart_neither_loses_the_restart_nor_counts_a_stall_twice(node):
    ctx, _, stops, service = node
    stops.started()
    old = ProgressWriter(ctx.run_dir, rank=0, local_rank=0)
    old.add_stall("memory", 0.2)
    old.step(1)
    old.write()
    ctx.record(EventKind.RESTART, reason="worker_failed")  # the agent's order: the event, then the stop
    stops.stopped("restart")
    samples = scrape(service.address)  # the stopped generation's heartbeat is still on disk
    assert value(samples, "eft_save_stall_seconds_count", tier="memory") == 1
    assert value(samples, "eft_restart_seconds_count") is None
    stops.started()
    new = ProgressWriter(ctx.run_dir, rank=0, local_rank=0)  # the next generation replaces it
    new.step(2)
    samples = scrape(service.address)
    assert value(samples, "eft_restart_seconds_count") == 1
    assert value(samples, "eft_save_stall_seconds_count", tier="memory") == 1


def test_every_restart_is_timed_at_its_first_step_scraped_or_not(node):
    """Two restarts, each with its first step, and no scrape in between: both are in the histograms
    (a scrape is not what observes them), the first one's once the second begins."""
    ctx, _, stops, service = node
    for iteration in (1, 2):
        ctx.record(EventKind.RESTART, reason="worker_failed")
        stops.stopped("restart")
        stops.started()
        writer = ProgressWriter(ctx.run_dir, rank=0, local_rank=0)
        writer.step(iteration)
        writer.write()
    timed = lambda: service.board.histograms()[Metric.RESTART_SECONDS].get(())  # noqa: E731
    wait_for(lambda: timed() is not None and timed().count == 2, 10, "both restarts timed with nobody scraping")
    samples = scrape(service.address)
    assert value(samples, "eft_restart_seconds_count") == 2
    assert value(samples, "eft_restart_phase_seconds_count", phase="first_step") == 2


def test_the_jobs_goodput_is_exported_by_the_node_of_rank_0_alone_and_moves_with_it(agent_context):
    """The job's figures come from one node at a time: when a re-plan moves rank 0, the old node
    stops showing them at once and the new one shows them within seconds (not an interval later)."""
    rank0, services = {"n0": True, "n1": False}, []
    for name in rank0:
        ctx = agent_context(name)
        ctx.record(EventKind.NODE_JOINED, host="host", gpus=1)
        stops = StopRecorder(ctx.record, ctx.run_dir)
        stops.started()
        writer = ProgressWriter(ctx.run_dir, rank=0 if rank0[name] else 1, local_rank=0)
        writer.step(1)
        writer.write()
        service = MetricsService(MetricsConfig(metrics_port=0, metrics_host="127.0.0.1"), "127.0.0.1")  # every 60 s
        services.append(service.connect(AgentParts(ctx, AgentServices(), None, lambda s=stops: s, lambda: 2,
                                                   lambda: 1, lambda n=name: rank0[n])))
    try:
        goodput = lambda service: value(scrape(service.address), "eft_goodput_ratio")  # noqa: E731
        wait_for(lambda: goodput(services[0]) is not None, 10, "n0's goodput")
        assert goodput(services[1]) is None
        rank0.update(n0=False, n1=True)  # the re-plan
        assert goodput(services[0]) is None
        wait_for(lambda: goodput(services[1]) is not None, 10, "the goodput from n1, the new holder of rank 0")
    finally:
        for service in services:
            service.close()


def test_a_restart_of_the_job_counts_once_however_many_nodes_restart_for_it(agent_context):
    """Three nodes restart for one lost peer: a panel summing over nodes shows one restart of the job
    (every node still counts its own workers' restart)."""
    contexts = [agent_context(f"n{i}") for i in range(3)]
    boards = [MetricsBoard(KNOWN_LABELS) for _ in contexts]
    budgets = [RestartBudget(ctx, RestartConfig(), max_restarts=100).start() for ctx in contexts]
    for ctx, board in zip(contexts, boards):
        ctx.events.observers.append(board.observe)
    for round_ in (0, 1):  # two restarts of the job
        for ctx, budget in zip(contexts, budgets):
            budget.joined(round_)
            opened = budget.before_restart(RestartReason.MEMBERSHIP, lambda: None)  # as the agent restarts
            ctx.record(EventKind.RESTART, reason=RestartReason.MEMBERSHIP, job_restart=opened)
    reason = (str(RestartReason.MEMBERSHIP),)
    assert sum(board.counters()[Metric.JOB_RESTARTS][reason] for board in boards) == 2
    assert sum(board.counters()[Metric.RESTARTS][reason] for board in boards) == 6


def test_a_rank_keeps_its_series_across_a_re_plan(node):
    """A re-plan gives the node's workers other global ranks: a dashboard's line goes on, not a new series each time."""
    ctx, _, stops, service = node
    series: dict[str, set] = {"eft_iteration": set(), "eft_heartbeat_age_seconds": set()}
    for global_rank, iteration in ((4, 7), (2, 8)):  # local rank 0, before and after the re-plan
        stops.started()
        writer = ProgressWriter(ctx.run_dir, rank=global_rank, local_rank=0)
        writer.step(iteration)
        writer.write()
        samples = scrape(service.address)
        for name, seen in series.items():
            seen |= {tuple(sorted(labels.items())) for labels, _ in samples[name]}
    assert value(samples, "eft_iteration", local_rank=0) == 8
    assert all(len(seen) == 1 for seen in series.values()), series


def test_a_port_in_use_is_one_line_and_the_agent_runs_on(node, caplog):
    _, _, _, service = node
    port = int(service.address.rsplit(":", 1)[1])
    with caplog.at_level(logging.WARNING):
        other = MetricsService(MetricsConfig(metrics_port=port, metrics_host="127.0.0.1"), "127.0.0.1")
    assert other.server is None and other.address == ""
    (line,) = [r.getMessage() for r in caplog.records if "metrics" in r.getMessage()]
    assert f"--eft-metrics-port {port}" in line and "runs on without them" in line


def test_the_metrics_page_lists_exactly_what_the_catalog_exports():
    page = PAGE.read_text()
    assert block_of(page) == render(), "docs/metrics.md is stale: paste `eft metrics docs` between its markers"
    assert all(f"`{m.spec.exposed[0] if m.spec.kind == 'counter' else m.spec.name}`" in page for m in Metric)


def test_every_name_a_scrape_shows_is_in_the_catalog(node):
    ctx, sampler, _, service = node
    sampler.sample_once()
    ctx.record(EventKind.RESTART, reason="membership")
    shown = set(scrape(service.address)) - {"eft_gpu_seconds", "eft_goodput_ratio"}
    assert shown and shown <= exposed_names()


def test_targets_follow_the_node_records_and_leave_out_the_nodes_that_left(etcd, run_keys, etcd_server, tmp_path):
    records = {(run_keys.run_id, "n0"): NodeRecord("n0", "h0", "h0", 1, metrics="h0:9470"),
               (run_keys.run_id, "n1"): NodeRecord("n1", "h1", "h1", 2, metrics="h1:9470", state=NodeState.EXITED),
               (run_keys.run_id, "n2"): NodeRecord("n2", "h2", "h2", 3)}
    assert file_sd(records) == [{"targets": ["h0:9470"], "labels": {"run": run_keys.run_id, "node": "n0"}}]
    for (_, node_id), record in records.items():
        etcd.put(run_keys.node(node_id), record.to_json())
    out = tmp_path / "targets.json"
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "metrics", "targets", "--endpoint",
                           etcd_server.endpoint, "--run-id", run_keys.run_id, "--output", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text()) == file_sd(records)
    bad = subprocess.run([sys.executable, "-m", "launcher.cli", "metrics", "targets", "--endpoint",
                          etcd_server.endpoint, "--run-id", run_keys.run_id, "--watch"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--watch: expected --output" in bad.stderr


def test_targets_of_a_run_whose_agents_serve_no_metrics_say_why_they_are_empty(etcd, run_keys, etcd_server):
    # the README's demo before it served metrics: an empty list, and nothing to tell a port was missing
    etcd.put(run_keys.node("n0"), NodeRecord("n0", "h0", "h0", 1).to_json())
    done = subprocess.run([sys.executable, "-m", "launcher.cli", "metrics", "targets", "--endpoint",
                           etcd_server.endpoint, "--run-id", run_keys.run_id], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and json.loads(done.stdout) == [], done.stderr
    assert "1 running agent(s), none serves /metrics" in done.stderr and "--eft-metrics-port" in done.stderr
