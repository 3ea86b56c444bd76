"""Generate the GPU telemetry traces under tests/data/ (seeded: same files every run).

    PYTHONPATH=. python tests/data/make_traces.py [OUT_DIR]   (default: tests/data/)

An 8-GPU H100 node (700 W limit, 81559 MiB) running Megatron training: GPUs busy at
95-100 %, memory held near full by the caching allocator, power 80-90 % of the limit,
and every ~45 minutes an evaluation/checkpoint pause in which all GPUs idle and cool
down together. Temperatures follow power through a first-order lag (tau 2 min) plus a
per-GPU offset, a slow per-GPU wobble, the room's drift and sensor noise, and are
whole degrees as NVML reports them.

In every failing trace the failure row is the failing GPU's row in which every
metric is missing (the GPU fell off the bus); the GPU is absent afterwards.
Failure modes modelled, after NVIDIA's Xid catalogue and GPU debug guidelines:

- thermal_runaway.csv: GPU 5's cooling degrades (a failing cold plate/fan): it runs
  ever hotter, reaches HW thermal slowdown at 87 C, throttles in and out (power and
  utilisation swing while the other seven wait in NCCL), keeps heating, and shuts
  down at 95 C (Xid 79).
- ecc_fall_off_bus.csv: GPU 6's HBM degrades: corrected ECC errors climb for half an
  hour, then an uncorrectable error (Xid 94, row remap pending), then Xid 79.
- power_oscillation.csv: GPU 2's power delivery fails: the board's power brake
  flaps (HW power brake slowdown), power swings between excursions past the limit
  and the brake, utilisation sags, it heats up, and it falls off the bus.
- ecc_nvidia_smi.csv: nvidia-smi --query-gpu output (the exact query in
  docs/health.md) of a node whose GPU 3 reports uncorrectable ECC errors and then
  falls off the bus (a row of [N/A], then no more rows for it).
- healthy.csv: three hours, no failure; GPU 4 simply runs ~9 C hotter than the rest.

make_more_traces.py (called by ``main``) adds falling clocks, a memory leak to OOM,
a sudden fall-off with no warning and a job-wide throttle; its docstring says how.
"""

from __future__ import annotations

import bisect
import math
import random
import sys
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from elasticft.health.sample import GpuSample
from elasticft.health.trace import EFT_COLUMNS, write_trace

HERE = Path(__file__).resolve().parent
START = 1714564800.0  # 2024-05-01T12:00:00Z
LIMIT_W, TOTAL_MIB = 700.0, 81559.0
SLOWDOWN_C, SHUTDOWN_C = 87.0, 95.0  # the thresholds NVML reports for the simulated board
# uuids would double the file size; the thermal limits are written where they matter
# (thermal_runaway.csv) and left to the model's defaults elsewhere.
LIMIT_COLUMNS = [c for c in EFT_COLUMNS if c != "uuid"]
COLUMNS = [c for c in LIMIT_COLUMNS if c not in ("temp_slowdown_c", "temp_shutdown_c")]
SW_POWER_CAP, IDLE, HW_SLOWDOWN, HW_THERMAL, HW_POWER_BRAKE = 0x4, 0x1, 0x8, 0x40, 0x80


@dataclass
class Gpu:
    index: int
    offset: float  # C this GPU runs above the node's typical temperature
    wobble_period: float
    wobble_phase: float
    memory_mib: float
    temp: float = 0.0
    corrected: int = 0
    uncorrected: int = 0
    lost: bool = False
    extra: dict = field(default_factory=dict)


def uuid_of(rng: random.Random) -> str:
    h = "%032x" % rng.getrandbits(128)
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class Node:
    """Simulates one node; ``fault(gpu, minute, sample)`` lets a trace break one GPU."""

    def __init__(
        self, seed: int, gpus: int = 8, hot_gpu: int | None = None, name: str = "node-a", days: float = 1.0,
        limit_w: float = LIMIT_W,
    ):
        self.rng = random.Random(seed)
        self.name = name
        self.limit_w = limit_w  # the board's power limit: loads and the heat they make scale with it
        self.gpus = []
        for i in range(gpus):
            offset = self.rng.uniform(-3.0, 3.0) + (9.0 if i == hot_gpu else 0.0)
            self.gpus.append(
                Gpu(i, offset, self.rng.uniform(20, 45), self.rng.uniform(0, 2 * math.pi),
                    self.rng.uniform(77600, 79400))
            )
        self.pauses = []  # (start minute, end minute) of evaluation/checkpoint pauses
        minute = self.rng.uniform(25, 40)
        while minute < days * 24 * 60:
            length = self.rng.uniform(3, 5)
            self.pauses.append((minute, minute + length))
            minute += length + self.rng.uniform(38, 50)
        self.uuids = [uuid_of(self.rng) for _ in range(gpus)]

    def paused(self, minute: float) -> bool:
        # The pauses are sorted and disjoint: only the last one starting by now can hold it.
        i = bisect.bisect_right(self.pauses, (minute, math.inf)) - 1
        return i >= 0 and minute < self.pauses[i][1]

    def target_temp(self, gpu: Gpu, minute: float, power: float) -> float:
        room = 24.0 + 1.5 * math.sin(2 * math.pi * minute / 150.0)
        wobble = 1.5 * math.sin(2 * math.pi * minute / gpu.wobble_period + gpu.wobble_phase)
        return room + 5.0 + gpu.offset + wobble + 48.0 * power / self.limit_w

    def run(self, minutes: float, step_s: float, fault=None) -> list[GpuSample]:
        rng, out = self.rng, []
        for gpu in self.gpus:
            gpu.temp = self.target_temp(gpu, 0.0, 0.85 * self.limit_w)
        for n in range(int(minutes * 60 / step_s)):
            t = n * step_s
            minute = t / 60.0
            pause = self.paused(minute)
            for gpu in self.gpus:
                if gpu.lost:
                    continue
                if pause:
                    power, util, reasons = rng.gauss(115, 8), rng.uniform(0, 6), IDLE
                else:
                    power = min(self.limit_w, rng.gauss(0.85 * self.limit_w, 0.025 * self.limit_w))
                    util = min(100.0, rng.gauss(97.5, 1.5))
                    reasons = SW_POWER_CAP if power > 0.9 * self.limit_w else 0
                if rng.random() < 0.0007:  # a stray single-bit error, as healthy HBM has
                    gpu.corrected += 1
                sample = GpuSample(
                    timestamp=START + t, node=self.name, gpu=gpu.index, uuid=self.uuids[gpu.index],
                    temperature_c=0.0, memory_used_mib=round(gpu.memory_mib + rng.gauss(0, 40)),
                    memory_total_mib=TOTAL_MIB, power_w=round(power, 1), power_limit_w=self.limit_w,
                    utilization_pct=round(max(0.0, util)), ecc_corrected=gpu.corrected,
                    ecc_uncorrected=gpu.uncorrected, rows_pending=False, throttle_reasons=reasons,
                    sm_clock_mhz=345.0 if pause else 1980.0, mem_clock_mhz=2619.0,
                    temp_slowdown_c=SLOWDOWN_C, temp_shutdown_c=SHUTDOWN_C,
                )
                heat = 0.0
                if fault is not None:
                    sample, heat = fault(self, gpu, minute, sample)
                    if sample is None:
                        continue
                target = self.target_temp(gpu, minute, sample.power_w or 0.0) + heat
                gpu.temp += (target - gpu.temp) * (1 - math.exp(-step_s / 120.0))
                if sample.temperature_c == 0.0:
                    sample = replace(sample, temperature_c=float(round(gpu.temp + rng.gauss(0, 0.4))))
                out.append(sample)
        return out


def lost_row(sample: GpuSample) -> GpuSample:
    """What the failure row holds: the GPU answers nothing any more."""
    return GpuSample(sample.timestamp, sample.node, sample.gpu, sample.uuid, xids=(79,))


def thermal_runaway(node: Node, gpu: Gpu, minute: float, s: GpuSample):
    onset = 30.0
    if gpu.index != 5 or minute < onset:
        return s, 0.0
    if gpu.lost:
        return None, 0.0
    if gpu.temp >= 95.0:  # thermal shutdown
        gpu.lost = True
        return lost_row(s), 0.0
    heat = 0.012 * (minute - onset) ** 2  # the cooling loses ground ever faster
    if gpu.temp >= 87.0:
        throttled = node.rng.random() < 0.55  # the clocks drop and recover, over and over
        power = node.rng.uniform(180, 260) if throttled else node.rng.uniform(560, 640)
        util = node.rng.uniform(30, 55) if throttled else node.rng.uniform(60, 80)
        s = replace(s, power_w=round(power, 1), utilization_pct=round(util),
                    throttle_reasons=HW_SLOWDOWN | HW_THERMAL, sm_clock_mhz=990.0 if throttled else 1650.0)
        heat += 25.0 if throttled else 0.0  # dead cooling: even throttled it heats
    return s, heat


def ecc_fall_off_bus(node: Node, gpu: Gpu, minute: float, s: GpuSample):
    onset, uncorrectable, off_bus = 20.0, 52.0, 54.0
    if gpu.index != 6 or minute < onset:
        return s, 0.0
    if gpu.lost:
        return None, 0.0
    if minute >= off_bus:
        gpu.lost = True
        return lost_row(s), 0.0
    rate = 0.05 * math.exp((minute - onset) / 6.0)  # corrected errors per sample, climbing
    gpu.corrected += sum(1 for _ in range(20) if node.rng.random() < min(1.0, rate / 20))
    gpu.corrected += int(rate) if rate > 20 else 0
    xids, pending = (), False
    if minute >= uncorrectable:
        if not gpu.extra.get("dbe"):
            gpu.uncorrected += 1
            gpu.extra["dbe"] = True
            xids = (94,)
        pending = True
    s = replace(s, ecc_corrected=gpu.corrected, ecc_uncorrected=gpu.uncorrected,
                rows_pending=pending, xids=xids)
    return s, 0.0


def power_oscillation(node: Node, gpu: Gpu, minute: float, s: GpuSample):
    onset, off_bus = 48.0, 60.0
    if gpu.index != 2 or minute < onset:
        return s, 0.0
    if gpu.lost:
        return None, 0.0
    if minute >= off_bus:
        gpu.lost = True
        return lost_row(s), 0.0
    braked = node.rng.random() < 0.4  # the brake line flaps; between, the VRM overshoots
    power = node.rng.uniform(90, 160) if braked else node.rng.uniform(730, 800)
    util = node.rng.uniform(20, 45) if braked else node.rng.uniform(50, 75)
    s = replace(s, power_w=round(power, 1), utilization_pct=round(util),
                throttle_reasons=HW_SLOWDOWN | HW_POWER_BRAKE, sm_clock_mhz=345.0 if braked else 1980.0)
    heat = 22.0 * min(1.0, (minute - onset) / 6.0)  # the overheating VRMs heat the board
    return s, heat


NVSMI_HEADER = (
    "timestamp, index, uuid, temperature.gpu, power.draw [W], power.limit [W], "
    "utilization.gpu [%], memory.used [MiB], memory.total [MiB], "
    "ecc.errors.uncorrected.volatile.total"
)


def write_nvidia_smi(path: Path, samples: list[GpuSample]) -> None:
    """Write rows as nvidia-smi --query-gpu=... --format=csv prints them."""

    def na(value, fmt):
        return "[N/A]" if value is None else fmt.format(value)

    with open(path, "w", newline="") as handle:
        handle.write(NVSMI_HEADER + "\n")
        for s in samples:
            moment = datetime.fromtimestamp(s.timestamp, tz=timezone.utc)
            stamp = moment.strftime("%Y/%m/%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d}"
            cells = [
                stamp, str(s.gpu), s.uuid, na(s.temperature_c, "{:.0f}"),
                na(s.power_w, "{:.2f} W"), na(s.power_limit_w, "{:.2f} W"),
                na(s.utilization_pct, "{:.0f} %"), na(s.memory_used_mib, "{:.0f} MiB"),
                na(s.memory_total_mib, "{:.0f} MiB"), na(s.ecc_uncorrected, "{}"),
            ]
            handle.write(", ".join(cells) + "\n")


def ecc_nvidia_smi(node: Node, gpu: Gpu, minute: float, s: GpuSample):
    if gpu.index != 3 or minute < 38.0:
        return s, 0.0
    if gpu.lost:
        return None, 0.0
    if minute >= 41.0:
        gpu.lost = True
        return lost_row(s), 0.0
    gpu.uncorrected = 2
    return replace(s, ecc_uncorrected=gpu.uncorrected), 0.0


def jitter_ms(samples: list[GpuSample], rng: random.Random) -> list[GpuSample]:
    """nvidia-smi stamps each row as it reads it: a few ms apart."""
    return [replace(s, timestamp=s.timestamp + s.gpu * 0.004 + rng.uniform(0, 0.002)) for s in samples]


def main(out: Path = HERE) -> None:
    comment = "generated by tests/data/make_traces.py; see its docstring for the model"
    healthy = Node(seed=1, hot_gpu=4).run(minutes=180, step_s=60)
    write_trace(out / "healthy.csv", healthy, COLUMNS, [comment, "no failure; GPU 4 runs ~9 C hotter"])
    traces = {
        "thermal_runaway.csv": (Node(seed=2), thermal_runaway, "GPU 5 overheats and shuts down"),
        "ecc_fall_off_bus.csv": (Node(seed=3), ecc_fall_off_bus, "GPU 6: ECC errors, then off the bus"),
        "power_oscillation.csv": (Node(seed=4), power_oscillation, "GPU 2: power brake flapping"),
    }
    for name, (node, fault, what) in traces.items():
        samples = node.run(minutes=80, step_s=30, fault=fault)
        columns = LIMIT_COLUMNS if name == "thermal_runaway.csv" else COLUMNS
        write_trace(out / name, samples, columns, [comment, what + "; failure row: all metrics empty"])
    node = Node(seed=5)
    samples = node.run(minutes=60, step_s=60, fault=ecc_nvidia_smi)
    write_nvidia_smi(out / "ecc_nvidia_smi.csv", jitter_ms(samples, node.rng))
    from make_fleet import write_steady_overheat  # they import this module: no cycle at load
    from make_more_traces import main as more

    more(out)
    write_steady_overheat(out)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
