"""What the health sampler costs the node agent: CPU time per GPU sample.

NVML is faked at the pynvml call level (bench/fake_pynvml.py: the same function
names, structs, units and NVMLError classes, some fields NotSupported), so this
measures eft's own code: the NVML source, the risk model, the JSON record, and with
``--etcd`` the client side of publishing to a real embedded etcd.

    PYTHONPATH=. python bench/sampler.py [--ticks N] [--gpus 8] [--etcd]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fake_pynvml import FakeNvml  # noqa: E402

from elasticft.health import (  # noqa: E402
    HealthSampler,
    NvmlSource,
    RiskModel,
    health_record,
    read_trace,
)
from elasticft.health.trace import batches  # noqa: E402


def make_fake(gpus: int) -> FakeNvml:
    fake = FakeNvml(count=gpus)
    for g in fake.gpus[: max(1, gpus // 4)]:  # an older board: no ECC, no row remapping
        g.unsupported |= {"nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetRemappedRows"}
    for g in fake.gpus:  # a driver before 535: only the old throttle-reasons call
        g.unsupported.add("nvmlDeviceGetCurrentClocksEventReasons")
    fake.nvmlInit()
    return fake


def jiggle(fake: FakeNvml, rng: random.Random) -> None:
    """Plausible, changing readings between ticks (not timed)."""
    for g in fake.gpus:
        g.temperature = int(rng.gauss(66, 2))
        g.power_mw = int(rng.gauss(600_000, 15_000))
        g.util = min(100, int(rng.gauss(97, 2)))
        g.ecc_corrected += rng.random() < 0.01
    if rng.random() < 0.01:
        fake.inject_xid(rng.randrange(len(fake.gpus)), 13)


def cpu_per_call(fn, ticks: int, between=None) -> float:
    """CPU seconds of ``fn()`` per call, averaged over ``ticks`` calls."""
    spent = 0.0
    for _ in range(ticks):
        if between is not None:
            between()
        start = time.process_time()
        fn()
        spent += time.process_time() - start
    return spent / ticks


def bench_model_throughput(rounds: int) -> float:
    """Samples per CPU second through RiskModel.update, on the healthy 8-GPU trace."""
    trace = list(batches(read_trace(ROOT / "tests" / "data" / "healthy.csv")))
    model = RiskModel()
    done, start = 0, time.process_time()
    while done < rounds:
        for round_ in trace:
            model.update(round_)
            done += 1
            if done >= rounds:
                break
    samples = done * len(trace[0])
    return samples / (time.process_time() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=2000, help="sampler ticks to time")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--etcd", action="store_true", help="also publish to an embedded etcd")
    args = parser.parse_args()
    rng = random.Random(0)
    n = args.gpus

    fake = make_fake(n)
    source = NvmlSource("bench", visible_devices=None, nvml=fake)
    read = cpu_per_call(source.read, args.ticks, lambda: jiggle(fake, rng)) / n

    samples = source.read()
    model = RiskModel()
    for _ in range(100):  # fill the baselines first
        model.update(source.read())
    score = cpu_per_call(lambda: model.update(samples), args.ticks) / n
    scores = model.update(samples)
    encode = cpu_per_call(
        lambda: [json.dumps(health_record(s, r)) for s, r in zip(samples, scores)], args.ticks
    ) / n

    publish, etcd_server = (lambda records: [json.dumps(health_record(*r)) for r in records]), None
    if args.etcd:
        from elasticft.contract.keys import RunKeys
        from elasticft.health import EtcdHealthPublisher
        from elasticft.store import EmbeddedEtcd, StoreOptions, connect

        etcd_server = EmbeddedEtcd().start()
        client = connect(StoreOptions(etcd_server.endpoint))
        publish = EtcdHealthPublisher(client, RunKeys("bench"), "bench", client.lease(30))
    sampler = HealthSampler(source, RiskModel(), interval=1.0, publish=publish)
    ticks = args.ticks if not args.etcd else min(args.ticks, 300)
    tick = cpu_per_call(sampler.sample_once, ticks, lambda: jiggle(fake, rng)) / n
    if etcd_server is not None:
        etcd_server.stop()

    throughput = bench_model_throughput(20_000 // n)
    what = "read + score + publish to etcd (client side)" if args.etcd else "read + score + JSON record"
    print(f"health sampler, {n} GPUs, NVML faked at the pynvml call level, {args.ticks} ticks")
    print(f"  NvmlSource.read        {read * 1e6:8.1f} us CPU per GPU sample")
    print(f"  RiskModel.update       {score * 1e6:8.1f} us CPU per GPU sample")
    print(f"  JSON health record     {encode * 1e6:8.1f} us CPU per GPU sample")
    print(f"  sampler tick           {tick * 1e6:8.1f} us CPU per GPU sample ({what})")
    print(f"  risk model throughput  {throughput:8.0f} samples per CPU second")
    print(f"  at 1 Hz for {n} GPUs: {tick * n * 100:.3f} % of one core "
          f"(at the default 10 s interval: {tick * n * 10:.4f} %)")


if __name__ == "__main__":
    main()
