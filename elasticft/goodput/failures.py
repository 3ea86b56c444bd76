"""Failure models for ``eft simulate``: when nodes of a job fail, which failures are
predicted (and how early), and when the predictor raises a false alarm.

Two models of when a GPU fails:

- ``llama3``: the 419 unexpected interruptions of Llama 3 405B's 54-day pre-training on
  16,384 H100s (Dubey et al., "The Llama 3 Herd of Models", 2024, Table 5), taken as one
  Poisson process per GPU: the job's failures are exponential with rate N / GPU-MTBF, and
  each is given a cause drawn with the table's counts.
- ``titan``: GPU lifetimes of the Titan supercomputer (Ostrouchov et al., SC '20; the
  olcf/TitanGPULife data in ``../shared/data/titan``). See ``TitanLifetimes``.

A failure takes down the node holding the GPU (``gpu // gpus_per_node``).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DAY = 86400.0

# Llama 3 405B, Table 5: root causes of the 419 unexpected interruptions in 54 days on
# 16,384 GPUs. The paper's percentages are of all 466 interruptions (47 planned), so only
# the counts are used.
LLAMA3_CAUSES: dict[str, int] = {
    "faulty GPU": 148, "GPU HBM3 memory": 72, "software bug": 54, "network switch/cable": 35,
    "host maintenance": 32, "GPU SRAM memory": 19, "GPU system processor": 17, "NIC": 7,
    "NCCL watchdog timeouts": 7, "silent data corruption": 6, "GPU thermal interface + sensor": 6,
    "SSD": 3, "power supply": 3, "server chassis": 2, "IO expansion board": 2, "dependency": 2,
    "CPU": 2, "system memory": 2,
}
# Causes taken to lose the memory tier's copies too, so the job resumes from disk: a switch
# or cable takes out a group of nodes, replica holders included; silently corrupted state
# was replicated as it was. 41 of 419 (9.8 %). An assumption, not the paper's.
LOSES_MEMORY = frozenset({"network switch/cable", "silent data corruption"})
LLAMA3_GPUS = 16384
LLAMA3_DAYS = 54.0
LLAMA3_INTERRUPTIONS = sum(LLAMA3_CAUSES.values())  # 419
# One GPU's mean time between (job-interrupting) failures: 54 d * 16,384 / 419 = 50,676 h.
LLAMA3_GPU_MTBF_HOURS = LLAMA3_DAYS * 24 * LLAMA3_GPUS / LLAMA3_INTERRUPTIONS


def default_titan_csv(repo_root: Path) -> Path:
    """Where the Titan data lies next to a clone: ``<repo>/../shared/data/titan``."""
    return repo_root.resolve().parent / "shared" / "data" / "titan" / "gc_summary_loc.csv"


@dataclass(frozen=True)
class Prediction:
    """What the health model catches: a share of the failures, some time ahead."""

    predictable: float = 0.0
    """Share of failures announced before they happen, in [0, 1]."""
    mean_lead_seconds: float = 300.0
    """Mean of the (exponential) lead time of a caught failure."""
    false_alarms_per_gpu_day: float = 0.0
    """Alarms on GPUs that do not fail, per GPU-day of the job."""

    def __post_init__(self):
        if not 0 <= self.predictable <= 1:
            raise ValueError(f"predictable must be in [0, 1], got {self.predictable!r}")
        if not self.mean_lead_seconds >= 0 or not math.isfinite(self.mean_lead_seconds):
            raise ValueError(f"lead time must be >= 0, got {self.mean_lead_seconds!r}")
        if not self.false_alarms_per_gpu_day >= 0 or not math.isfinite(self.false_alarms_per_gpu_day):
            raise ValueError(f"false alarms per GPU-day must be >= 0, got {self.false_alarms_per_gpu_day!r}")


@dataclass(frozen=True)
class FailureTrace:
    """One job's failures over ``seconds`` of wall time, in time order."""

    seconds: float
    times: np.ndarray
    """Wall time of each failure, seconds from the start."""
    nodes: np.ndarray
    """The node each failure takes down."""
    leads: np.ndarray
    """Seconds between the prediction and the failure; NaN: not predicted."""
    causes: tuple[str, ...]
    """The cause of each failure."""
    alarms: np.ndarray
    """Wall times of false alarms (a prediction no failure follows)."""

    def __post_init__(self):
        if not (len(self.times) == len(self.nodes) == len(self.leads) == len(self.causes)):
            raise ValueError("times, nodes, leads and causes must have one entry per failure")

    @classmethod
    def fixed(cls, times, seconds: float, nodes=None, node_count: int = 1, leads=None) -> "FailureTrace":
        """A given failure list (replay): node i mod ``node_count`` unless ``nodes`` says."""
        times = np.asarray(sorted(float(t) for t in times), dtype=float)
        if len(times) and (times[0] < 0 or times[-1] > seconds or not np.all(np.isfinite(times))):
            raise ValueError(f"failure times must lie in [0, {seconds}]")
        nodes = np.arange(len(times)) % max(node_count, 1) if nodes is None else np.asarray(nodes, dtype=int)
        leads = np.full(len(times), np.nan) if leads is None else np.asarray(leads, dtype=float)
        return cls(seconds, times, nodes, leads, ("given",) * len(times), np.empty(0))

    def cause_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for cause in self.causes:
            counts[cause] = counts.get(cause, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: -item[1]))

    def loses_memory(self, index: int) -> bool:
        """Whether failure ``index`` also loses the memory tier's copies (by its cause)."""
        return self.causes[index] in LOSES_MEMORY

    def memory_loss_share(self) -> float:
        """The share of failures the memory tier cannot recover from (0 without failures)."""
        return sum(map(LOSES_MEMORY.__contains__, self.causes)) / len(self.causes) if self.causes else 0.0


def exponential_failures(gpus: int, gpus_per_node: int, seconds: float, gpu_mtbf_hours: float,
                         rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Failure times and nodes of ``gpus`` independent GPUs failing at 1 / ``gpu_mtbf_hours``."""
    if gpu_mtbf_hours <= 0 or not math.isfinite(gpu_mtbf_hours):
        raise ValueError(f"GPU MTBF must be > 0 hours, got {gpu_mtbf_hours!r}")
    count = rng.poisson(gpus * seconds / (gpu_mtbf_hours * 3600.0))
    times = np.sort(rng.uniform(0.0, seconds, count))
    return times, rng.integers(0, gpus, count) // gpus_per_node


class TitanLifetimes:
    """GPU lifetimes from Titan's records, sampled by inverse transform of their Kaplan–Meier curve.

    Each row is one GPU: ``days`` in service, ``dead`` (died of double-bit errors or fell off
    the bus, ``dead_dbe``/``dead_otb``) or not (still running or taken out alive: censored).
    The Kaplan–Meier estimate ``F(t)`` of the lifetime distribution steps at each death.
    A job's GPU starts at an age drawn uniformly from [0, the longest service seen] (a fleet
    in steady replacement) and fails at a lifetime ``L`` drawn from ``F`` given ``L > age``;
    when ``F`` stops below 1 (GPUs outliving the records) the draw may be "never". A failed
    GPU is replaced by a new one (age 0) whose lifetime is drawn again.
    """

    def __init__(self, death_days: np.ndarray, cdf: np.ndarray, longest_days: float):
        self.death_days = death_days
        self.cdf = cdf
        self.longest_days = longest_days

    @classmethod
    def from_csv(cls, path: Path) -> "TitanLifetimes":
        """Raises OSError when unreadable, ValueError when it is not Titan's table."""
        days, dead = [], []
        with open(path, newline="") as handle:
            reader = csv.DictReader(handle)
            missing = {"days", "dead"} - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: not the Titan table (no column {', '.join(sorted(missing))})")
            for row in reader:
                try:
                    days.append(float(row["days"]))
                except ValueError:
                    raise ValueError(f"{path}: line {reader.line_num}: days is not a number") from None
                dead.append(row["dead"].strip().upper() == "TRUE")
        if not any(dead):
            raise ValueError(f"{path}: no dead GPU, so no lifetime to sample")
        order = np.lexsort((~np.asarray(dead), np.asarray(days)))  # by time, deaths before censoring
        days_sorted, dead_sorted = np.asarray(days)[order], np.asarray(dead)[order]
        at_risk = len(days_sorted) - np.arange(len(days_sorted))
        survival = np.cumprod(np.where(dead_sorted, 1.0 - 1.0 / at_risk, 1.0))
        return cls(days_sorted[dead_sorted], 1.0 - survival[dead_sorted], float(days_sorted.max()))

    def _lifetimes(self, ages: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Lifetimes in days given survival to ``ages``; inf where beyond the records."""
        below = np.searchsorted(self.death_days, ages, side="right")
        floor = np.where(below > 0, self.cdf[np.maximum(below - 1, 0)], 0.0)
        draws = rng.uniform(floor, 1.0)
        index = np.searchsorted(self.cdf, draws, side="left")
        lifetimes = np.full(len(ages), np.inf)
        known = index < len(self.cdf)
        lifetimes[known] = np.maximum(self.death_days[index[known]], ages[known])
        return lifetimes

    def failures(self, gpus: int, gpus_per_node: int, seconds: float,
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """Failure times and nodes of ``gpus`` GPUs over ``seconds``, replacements included."""
        horizon = seconds / DAY
        ages = rng.uniform(0.0, self.longest_days, gpus)
        start = np.zeros(gpus)  # job day at which each slot's current GPU started its life here
        slots = np.arange(gpus)
        times, where = [], []
        while len(slots):
            fail_day = start + self._lifetimes(ages, rng) - ages
            hit = fail_day < horizon
            times.append(fail_day[hit])
            where.append(slots[hit])
            slots, start = slots[hit], fail_day[hit]
            ages = np.zeros(len(slots))
        all_times = np.concatenate(times) * DAY
        order = np.argsort(all_times, kind="stable")
        return all_times[order], np.concatenate(where)[order] // gpus_per_node


def draw_trace(gpus: int, gpus_per_node: int, seconds: float, rng: np.random.Generator,
               prediction: Prediction = Prediction(), gpu_mtbf_hours: float = LLAMA3_GPU_MTBF_HOURS,
               titan: TitanLifetimes | None = None) -> FailureTrace:
    """A job's failures from Titan's lifetimes if given, else exponential with the Llama 3 mix."""
    if titan is not None:
        times, nodes = titan.failures(gpus, gpus_per_node, seconds, rng)
        causes = ("GPU death (Titan)",) * len(times)
    else:
        times, nodes = exponential_failures(gpus, gpus_per_node, seconds, gpu_mtbf_hours, rng)
        names = list(LLAMA3_CAUSES)
        weights = np.asarray(list(LLAMA3_CAUSES.values()), dtype=float)
        causes = tuple(names[i] for i in rng.choice(len(names), len(times), p=weights / weights.sum()))
    caught = rng.random(len(times)) < prediction.predictable
    leads = np.where(caught, rng.exponential(prediction.mean_lead_seconds or 1e-300, len(times)), np.nan)
    alarm_count = rng.poisson(prediction.false_alarms_per_gpu_day * gpus * seconds / DAY)
    alarms = np.sort(rng.uniform(0.0, seconds, alarm_count))
    return FailureTrace(seconds, times, nodes, leads, causes, alarms)
