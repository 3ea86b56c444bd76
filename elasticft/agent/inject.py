"""Fault injection for demos and tests: ``--eft-inject`` / ``EFT_INJECT``.

A comma-separated list of ``KIND:TARGET@ITERATION``:

* ``gpu_degrade:RANK@I`` — after iteration I, the GPU of global rank RANK starts to fail:
  its node's health sampler reads an uncorrectable ECC error and Xid 79 for it from
  then on (a critical event: risk 1.0), so the node asks for an emergency checkpoint;
* ``rank_killed:RANK@I`` — after iteration I, rank RANK dies (SIGKILL);
* ``rank_hung:RANK@I`` — after iteration I, rank RANK stops making progress;
* ``node_lost:NODE@I`` — after iteration I, the node whose agent has group rank NODE
  dies: its agent and all of its workers are SIGKILLed.

Workers call ``FaultInjector.after_iteration(i)`` once per iteration; only the target
acts. Each fault fires once per agent: a marker in the node's run directory remembers
it, so re-done iterations after a restart do not fire it again. Without ``EFT_RUN_DIR``
(not under eft-run) nothing fires. The agent side is ``InjectedGpuSource``.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from elasticft.config import ConfigError, flag_name
from elasticft.health.sample import GpuSample
from elasticft.contract.run_dir import write_atomically

KINDS = ("gpu_degrade", "rank_killed", "rank_hung", "node_lost")
_SPEC = re.compile(r"^(?P<kind>[a-z_]+):(?P<target>\d+)@(?P<iteration>\d+)$")
DEGRADE_MARKER = "inject-gpu-degrade"  # in the run dir; holds the degraded local rank


@dataclass(frozen=True)
class Fault:
    kind: str
    target: int
    iteration: int

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.target}-{self.iteration}"


def parse_faults(spec: str) -> list[Fault]:
    """``gpu_degrade:2@8,node_lost:1@10`` -> faults; a clear ConfigError otherwise."""
    faults = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        match = _SPEC.match(item)
        if not match or match["kind"] not in KINDS:
            raise ConfigError(
                f"{flag_name('inject')}: expected KIND:TARGET@ITERATION with KIND one of "
                f"{', '.join(KINDS)}, got {item!r}"
            )
        faults.append(Fault(match["kind"], int(match["target"]), int(match["iteration"])))
    return faults


class FaultInjector:
    """The worker side: call ``after_iteration`` every iteration on every rank."""

    def __init__(self, faults: list[Fault], run_dir: str | None, rank: int, local_rank: int, group_rank: int):
        self._faults = [f for f in faults if self._targets(f, rank, local_rank, group_rank)]
        self._run_dir = Path(run_dir) if run_dir else None
        self._local_rank = local_rank

    @classmethod
    def from_env(cls) -> "FaultInjector":
        env = os.environ
        return cls(
            parse_faults(env.get("EFT_INJECT", "")),
            env.get("EFT_RUN_DIR"),
            int(env.get("RANK", "0")),
            int(env.get("LOCAL_RANK", "0")),
            int(env.get("GROUP_RANK", "0")),
        )

    @staticmethod
    def _targets(fault: Fault, rank: int, local_rank: int, group_rank: int) -> bool:
        if fault.kind == "node_lost":  # one worker of the node pulls the plug
            return fault.target == group_rank and local_rank == 0
        return fault.target == rank

    def after_iteration(self, iteration: int) -> None:
        if self._run_dir is None:
            return
        for fault in self._faults:
            if fault.iteration != iteration:
                continue
            marker = self._run_dir / f"inject-fired-{fault.name}"
            if marker.exists():
                continue
            marker.touch()
            getattr(self, "_" + fault.kind)()

    def _gpu_degrade(self) -> None:
        write_atomically(self._run_dir / DEGRADE_MARKER, str(self._local_rank))

    @staticmethod
    def _rank_killed() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    @staticmethod
    def _rank_hung() -> None:
        while True:  # alive, silent, holding its peers in the next collective
            time.sleep(3600)

    @staticmethod
    def _node_lost() -> None:
        import psutil

        agent = psutil.Process(os.getppid())
        victims = agent.children(recursive=True) + [agent]
        for process in victims:
            if process.pid != os.getpid():
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
        os.kill(os.getpid(), signal.SIGKILL)


class InjectedGpuSource:
    """The agent side of ``gpu_degrade``: a synthetic health source for machines without
    NVML, healthy until a worker marks a local GPU degraded in the run directory.

    Healthy readings are steady (a loaded GPU at 60 °C); the degraded GPU then reports
    a new uncorrectable ECC error, a pending row remap and Xid 79 (fallen off the bus)
    at every read: the critical events that make its risk 1.0.
    """

    def __init__(self, node: str, gpus: int, run_dir: Path):
        self._node = node
        self._gpus = gpus
        self._marker = Path(run_dir) / DEGRADE_MARKER
        self._uncorrected = 0

    def degraded_gpu(self) -> int | None:
        try:
            return int(self._marker.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def read(self) -> list[GpuSample]:
        now = time.time()
        bad = self.degraded_gpu()
        samples = []
        for gpu in range(self._gpus):
            failing = gpu == bad
            if failing:
                self._uncorrected += 1
            samples.append(GpuSample(
                timestamp=now, node=self._node, gpu=gpu, uuid=f"GPU-injected-{self._node}-{gpu}",
                temperature_c=60.0, memory_used_mib=40000.0, memory_total_mib=81920.0,
                power_w=300.0, power_limit_w=700.0, utilization_pct=95.0,
                ecc_corrected=0, ecc_uncorrected=self._uncorrected if failing else 0,
                rows_pending=failing, throttle_reasons=0, xids=(79,) if failing else (),
            ))
        return samples

    def close(self) -> None:
        pass
