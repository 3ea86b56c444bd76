"""What an agent's /metrics costs: a scrape with 8 GPUs and a week of events, and the workers' iteration.

One real agent context on an embedded etcd, its health sampler over 8 GPUs (faults injected at the
source), 8 ranks' heartbeat files, the three watched records, and a week of events through the
board (``--events``; counters and histograms are bounded by their labels, not by the events).
Baseline, measured in the same run: prometheus_client's own default registry (the process, GC
and platform collectors any Python exporter serves), over the same HTTP server. Then a worker-like
process times its iterations (a CPU matmul) with nobody scraping and with a scraper at
``--scrape-hz`` (Prometheus' default is one scrape per 15 s), alternated to cancel drift; and the
job's GPU-seconds by cause (the node of rank 0, once a minute, off the scrape's path) over the
event log etcd holds at most (``--eft-max-events``: 10,000).

  python bench/metrics_scrape.py [--scrapes 300] [--events 100000] [--scrape-hz 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from common import table

from elasticft.agent.context import AgentContext, EtcdTarget
from elasticft.agent.metrics import AgentParts, MetricsService
from elasticft.agent.segments import StopRecorder
from elasticft.agent.services import AgentServices
from elasticft.config import MetricsConfig
from elasticft.contract.events import EventKind
from elasticft.contract.keys import RunKeys
from elasticft.contract.restarts import RestartRecord
from elasticft.goodput.breakdown import breakdown
from elasticft.health import HealthSampler, RiskModel
from elasticft.health.injected import InjectedGpuSource
from elasticft.metrics.server import MetricsServer
from elasticft.store import EmbeddedEtcd, StoreOptions
from elasticft.worker.progress import ProgressWriter

GPUS = 8
WORKER = """
import sys, time, torch
torch.set_num_threads(1)
a = torch.randn(256, 256)
end = time.monotonic() + float(sys.argv[1])
times = []
while time.monotonic() < end:
    t = time.perf_counter()
    for _ in range(20):
        a = torch.tanh(a @ a)
    times.append(time.perf_counter() - t)
print(sorted(times)[len(times) // 2])
"""


def week_of_events(count: int, start: float) -> list[dict]:
    """``count`` events of every kind the board counts, spread over a week."""
    kinds = [({"kind": EventKind.RESTART, "reason": r}) for r in ("membership", "worker_failed", "hang")]
    kinds += [{"kind": EventKind.CKPT_SAVED, "request_id": None, "seconds": 12.0},
              {"kind": EventKind.CKPT_SAVED, "request_id": "r", "seconds": 3.0},
              {"kind": EventKind.HANG, "section": "step"}, {"kind": EventKind.STRAGGLER},
              {"kind": EventKind.ROLLBACK, "fault": "spike"}, {"kind": EventKind.WATCHDOG, "check": "disk_space"},
              {"kind": EventKind.NODE_LOST, "nodes": ["n5"]}, {"kind": EventKind.ETCD_UNAVAILABLE, "seconds": 4.0},
              {"kind": EventKind.WORKERS_STOPPED, "stalls": {"disk": 0.5, "memory": 0.1}}]
    step = 7 * 86400 / count
    return [{**kinds[i % len(kinds)], "time": start + i * step, "source": "n0"} for i in range(count)]


def run_log(generations: int, nodes: int, padding: int, start: float) -> list[dict]:
    """An event log as a week of training leaves it in etcd: a generation an hour on ``nodes`` nodes."""
    events = [{"kind": EventKind.NODE_JOINED, "time": start, "source": f"n{n}", "gpus": GPUS} for n in range(nodes)]
    for g in range(generations):
        begin = start + 3600 * g + 60
        for n in range(nodes):
            events.append({"kind": EventKind.WORKERS_STOPPED, "time": begin + 3590, "source": f"n{n}", "why": "restart",
                           "rank": n * GPUS, "iteration": 100 * (g + 1), "first_iteration": 100 * g, "started": begin,
                           "first_step": begin + 30, "last_beat": begin + 3580, "steps": 100,
                           "totals": {"setup": 30.0, "step": 3500.0, "checkpointing": 40.0}, "stalls": {"disk": 5.0}})
            events.append({"kind": EventKind.RESTART, "time": begin + 3585, "source": f"n{n}", "reason": "membership"})
    events += [{"kind": EventKind.CKPT_REQUEST_JOINED, "time": start + i, "source": "n0"} for i in range(padding)]
    return events


def scrape_ms(address: str, scrapes: int) -> tuple[float, float, int]:
    times, size = [], 0
    for _ in range(scrapes):
        begin = time.perf_counter()
        size = len(urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read())
        times.append((time.perf_counter() - begin) * 1000)
    times.sort()
    return statistics.median(times), times[int(len(times) * 0.99) - 1], size


def worker_iteration(seconds: float, address: str | None, hz: float) -> float:
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(1 / hz):
            urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read()

    scraper = threading.Thread(target=scrape, daemon=True) if address else None
    if scraper:
        scraper.start()
    done = subprocess.run([sys.executable, "-c", WORKER, str(seconds)], capture_output=True, text=True, check=True)
    stop.set()
    return float(done.stdout) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--scrape-hz", type=float, default=10.0)
    parser.add_argument("--worker-seconds", type=float, default=8.0)
    args = parser.parse_args()
    with EmbeddedEtcd() as etcd, tempfile.TemporaryDirectory() as tmp:
        keys = RunKeys("bench-metrics")
        ctx = AgentContext.join(EtcdTarget(StoreOptions(etcd.endpoint), keys), "n0", "127.0.0.1", GPUS, 10.0, Path(tmp))
        services = AgentServices()
        services.sampler = HealthSampler(InjectedGpuSource("n0", GPUS, Path(tmp)), RiskModel())
        services.sampler.sample_once()
        stops = StopRecorder(ctx.record, tmp)
        writers = [ProgressWriter(tmp, rank=r, local_rank=r) for r in range(GPUS)]
        for writer in writers:
            writer.step(1)
            writer.step(2)
        service = MetricsService(MetricsConfig(metrics_port=0, metrics_host="127.0.0.1"), "127.0.0.1")
        service.connect(AgentParts(ctx, services, None, lambda: stops, lambda: 64, lambda: GPUS, lambda: False))
        ctx.client.put(keys.layout, json.dumps({"round": 7, "tp": 8, "pp": 4, "dp": 2, "world_size": 64}))
        ctx.client.put(keys.ckpt_latest, json.dumps({"iteration": 5000, "time": time.time()}))
        ctx.client.put(keys.restarts, RestartRecord(charged=3, job_restarts_limit=10).to_json())
        begin = time.perf_counter()
        for event in week_of_events(args.events, time.time() - 7 * 86400):
            service.board.observe(event)
        observe_us = (time.perf_counter() - begin) / args.events * 1e6
        from prometheus_client import REGISTRY

        baseline = MetricsServer(REGISTRY, "127.0.0.1", 0)
        rows = []
        for name, address in (("prometheus_client's default registry (baseline)", f"127.0.0.1:{baseline.port}"),
                              (f"eft agent: {GPUS} GPUs, {GPUS} ranks, {args.events:,} events", service.address)):
            p50, p99, size = scrape_ms(address, args.scrapes)
            rows.append([name, p50, p99, size])
        print(table(["/metrics of", "p50 ms", "p99 ms", "bytes"], rows))
        print(f"\nan event through the board: {observe_us:.2f} µs")
        quiet, scraped = [], []
        for _ in range(2):
            quiet.append(worker_iteration(args.worker_seconds, None, args.scrape_hz))
            scraped.append(worker_iteration(args.worker_seconds, service.address, args.scrape_hz))
        q, s = statistics.median(quiet), statistics.median(scraped)
        print(f"worker iteration (median): {q:.2f} ms unscraped, {s:.2f} ms scraped at {args.scrape_hz:g}/s: "
              f"ratio {s / q:.3f}")
        log = run_log(168, 8, max(0, 10_000 - 168 * 16 - 8), time.time() - 7 * 86400)
        begin = time.perf_counter()
        report = breakdown(log)
        print(f"GPU-seconds by cause over {len(log):,} events (rank 0's node, every 60 s, off the scrape): "
              f"{(time.perf_counter() - begin) * 1000:.0f} ms (goodput {report.goodput:.3f})")
        service.close()
        baseline.close()
        ctx.leave(clean=True)


if __name__ == "__main__":
    main()
