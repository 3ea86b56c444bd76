"""The power-instability factor (issue 45, part 2), measured as ``eft health eval`` measures.

In one run, the model as it is and the model before the factor (the same code with
``--eft-risk-weight-power-instability 0``, which is exactly the old score) are scored on:

- the corpus trace ``tests/data/power_instability.csv``: lead time and peak risk;
- a GPU swinging in each shape (sine, square, sawtooth, random levels), period, amplitude,
  power limit and sample interval of ``CASES``, on several seeds: the worst lead per case;
- a healthy fleet (``make_fleet.healthy_fleet``: checkpoint pauses on all GPUs together,
  job-wide power brakes, an always-hot GPU per node) of NODES x DAYS per power limit: false
  triggers per healthy GPU-day.

    PYTHONPATH=. python bench/power_instability.py [--nodes 16 --days 8] [--limits 700]

16 nodes x 8 days is 1,024 GPU-days per limit (about ten minutes a model on one core).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "data"))  # the trace generators import each other by bare name

from common import table  # noqa: E402
from make_fleet import healthy_fleet  # noqa: E402
from make_more_traces import PowerSwing  # noqa: E402
from make_traces import Node  # noqa: E402

from elasticft.config import RiskConfig  # noqa: E402
from elasticft.health import RiskModel, read_trace  # noqa: E402
from elasticft.health.evaluate import evaluate, score_trace  # noqa: E402

MODELS = {"new": RiskConfig(), "old": RiskConfig(risk_weight_power_instability=0.0)}
# (shape, period s, amplitude W, limit W, sample interval s); periods are not multiples of the
# interval's half, where a sampler in step with the swing would see a constant.
CASES = [
    ("sine", 120, 260, 700, 10), ("square", 60, 150, 1000, 10), ("sawtooth", 180, 150, 1000, 10),
    ("random", 40, 150, 1000, 10), ("sine", 10, 150, 1000, 4), ("square", 250, 150, 400, 10),
    ("sine", 300, 150, 1000, 10), ("random", 25, 150, 1000, 60), ("sawtooth", 90, 200, 700, 30),
    ("square", 13, 150, 1000, 10), ("random", 130, 150, 700, 60), ("random", 250, 150, 1000, 60),
]
SEEDS = 3


def failure(samples, config, name="trace", labels=None):
    """(lead s or None, peak risk before the failure) of the trace's one failure, at the default threshold."""
    scored = score_trace(name, samples, RiskModel(config), labels)
    outcome = evaluate([scored], [config.risk_threshold])[0].outcomes[0]
    peak = max(s for t, s in scored.series[(outcome.node, outcome.gpu)] if t < outcome.failed_at)
    return outcome.lead_s, peak


def swing_samples(case, seed):
    shape, period, amplitude, limit, step = case
    onset = 20 + 7 * seed  # the checkpoint pauses fall at other points of the swing
    node = Node(seed=1000 + 7 * seed + period, limit_w=limit)
    fault = PowerSwing(shape, period, amplitude, center=0.85, onset=onset, off_bus=onset + 35)
    return node.run(minutes=onset + 36, step_s=step, fault=fault)


def lead(value):
    return "no" if value is None else f"{value / 60:.1f} min"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--days", type=float, default=2.0)
    parser.add_argument("--limits", default="700", help="power limits (W) of the healthy fleets, comma-separated")
    args = parser.parse_args()

    corpus = ROOT / "tests" / "data" / "power_instability.csv"
    rows = []
    for name, config in MODELS.items():
        value, peak = failure(read_trace(corpus), config, corpus.stem)
        rows.append([name, corpus.name, lead(value), f"{peak:.3f}"])
    print(table(["model", "trace", "lead", "peak risk"], rows), "\n")

    rows = []
    for case in CASES:
        row = ["/".join(str(c) for c in case)]
        for config in MODELS.values():
            results = [failure(swing_samples(case, seed), config) for seed in range(SEEDS)]
            leads = [r[0] for r in results]
            row += ["no" if None in leads else lead(min(leads)), f"{max(r[1] for r in results):.3f}"]
        rows.append(row)
    print(f"shape/period s/amplitude W/limit W/interval s: worst of {SEEDS} seeds")
    print(table(["case", "new: lead", "new: peak", "old: lead", "old: peak"], rows), "\n")

    rows = []
    for limit in (float(x) for x in args.limits.split(",")):
        for name, config in MODELS.items():
            started = time.monotonic()
            traces = [score_trace(n, s, RiskModel(config)) for n, s in healthy_fleet(args.nodes, args.days, limit_w=limit)]
            result = evaluate(traces, [config.risk_threshold])[0]
            rows.append([name, f"{limit:.0f} W", f"{result.healthy_gpu_days:.1f}", result.false_triggers,
                         f"{time.monotonic() - started:.0f} s"])
    print("healthy fleet (make_fleet.healthy_fleet, one sample a minute), threshold 0.8")
    print(table(["model", "limit", "GPU-days", "false triggers", "time"], rows))


if __name__ == "__main__":
    main()
