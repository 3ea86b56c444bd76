"""Start real launchers (eft-run, torchrun) as separate process groups, and read what
their workers write: for the benches, and for the tests, which import it from here.

Nothing here imports ``tests``: a bench runs from a checkout with only ``bench/`` and
the repository root on the path. The worker scripts stay in tests/workers/ (shared with
the tests); they are run by path, never imported.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
WORKERS = ROOT / "tests" / "workers"


def eft_run() -> list[str]:
    """This interpreter's eft-run: its own console script, not another environment's on the PATH."""
    beside = Path(sys.executable).parent / "eft-run"
    return [str(beside)] if beside.is_file() else [sys.executable, "-m", "launcher.preflight"]


def torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run"]


def rdzv_command(launcher: list[str], *program: str, nnodes: str, nproc: int, backend: str, endpoint: str,
                 run_id: str, flags: list[str] = ()) -> list[str]:
    """One node's command line: ``launcher`` joining rendezvous ``run_id`` at ``endpoint``,
    then its other ``flags``, then the program and its arguments."""
    return [*launcher, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--rdzv-backend", backend,
            "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, *flags, *program]


class Launched:
    """One launcher process in its own process group (a simulated node)."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict | None = None):
        self.cmd = cmd
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )

    def processes(self) -> list[psutil.Process]:
        """The agent and every process under it (torch starts each worker in a session of
        its own: the agent's process group alone does not hold them)."""
        try:
            agent = psutil.Process(self.proc.pid)
            return [agent, *agent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill_node(self) -> None:
        """kill -9 the agent and its workers, as if the machine died.

        torch starts each worker in a session of its own, so killing the agent's
        process group alone would leave the workers running.
        """
        descendants = self.processes()[1:]
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for child in descendants:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()

    def signal_node(self, sig: int) -> None:
        """Send ``sig`` to the agent and every process it started (SIGSTOP: a frozen
        machine; SIGCONT: it wakes). Workers sit in sessions of their own, so each is
        signalled by pid, not through the agent's process group."""
        for process in self.processes():
            try:
                process.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.flush()

    def output(self) -> str:
        if not self._log.closed:  # (read after stop too)
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill_node()
        self._log.close()


# What an agent that crashed in gRPC's C core, or called into a closed channel, leaves in its log.
CRASH_SIGNS = ("Fatal Python error", "Segmentation fault", "Cannot invoke RPC on closed channel")


def shutdown_crash(log_text: str) -> str | None:
    """The first crash sign in an agent's log, or None."""
    return next((sign for sign in CRASH_SIGNS if sign in log_text), None)


def agent_of(worker_pid: int) -> int:
    """The pid of the launcher (agent) that started worker ``worker_pid``."""
    return psutil.Process(worker_pid).ppid()


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    """Return condition()'s first truthy value, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSON-lines file (worker events, notifications); none if it is absent."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def worker_events(out: Path, kind: str) -> list[dict]:
    """toy_train.py's events of one kind (resume, save, exit) from its output folder ``out``, oldest first."""
    return [e for e in read_jsonl(Path(out) / "events.jsonl") if e["event"] == kind]


def generation(path: Path, world_size: int, after: float = 0.0) -> list[dict] | None:
    """The worker starts with ``world_size`` since ``after``, once all ranks reported."""
    starts = [r for r in read_jsonl(path) if r["world_size"] == world_size and r["time"] >= after]
    ranks = {r["rank"] for r in starts}
    return starts if ranks == set(range(world_size)) else None


def time_recovery(nodes: list[Launched], victim: Launched, work: Path, world_size: int, give_up: float,
                  check: Callable[[list[dict]], None] = lambda starts: None,
                  freeze: bool = False) -> tuple[float, float] | None:
    """kill -9 ``victim`` (tests/workers/allreduce_loop.py's nodes, writing ``work``), or with
    ``freeze`` SIGSTOP it (a machine that hangs: no process exits, no port refuses): seconds from
    the fault to the last worker of the next generation of ``world_size`` started and to the last
    in gloo; None when none came within ``give_up``. ``check`` is given that generation's starts
    while its workers live; the others are then told to finish and awaited."""
    killed = time.time()
    if freeze:
        victim.signal_node(signal.SIGSTOP)
    else:
        victim.kill_node()
    try:
        second = wait_for(lambda: generation(work / "starts.jsonl", world_size, after=killed), give_up,
                          f"workers at world size {world_size}")
    except AssertionError:
        return None  # no recovery: the caller's row says so
    check(second)
    (work / "finish").touch()
    for node in nodes:
        if node is not victim:
            node.wait(120)
    return max(r["started"] for r in second) - killed, max(r["time"] for r in second) - killed
