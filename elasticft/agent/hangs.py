"""Hang detection: a rank that stays in one section longer than its timeout is hung.

torchrun only notices a worker that exits; a rank stuck in a collective, a deadlock or
a stopped process looks healthy to it forever. The worker hook keeps a heartbeat of the
section each rank is in (``worker/progress.py``); the agent compares how long each live
rank has been in its section with that section's timeout (``--eft-timeouts``, or the
learned ones of ``--eft-auto-timeouts``). An overrun rank's Python stacks go into the
log — py-spy when it is installed and may attach, else the rank's own faulthandler,
woken by ``--eft-stack-signal`` — and the agent restarts the worker group as a failure.

``find_overruns`` is the pure decision; ``dump_stacks`` is the I/O.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from typing import Iterable, Mapping

from elasticft.contract.progress import ProgressRecord

log = logging.getLogger(__name__)

PY_SPY_TIMEOUT = 20.0  # seconds one py-spy dump may take before we fall back
STALLED_FRACTION = 0.5  # of its timeout: a rank this long silent when another overruns is reported with it
FAULTHANDLER_GRACE = 1.0  # seconds a signalled rank gets to write its stacks before it is killed


@dataclass(frozen=True)
class Overrun:
    """A live rank that has been in ``section`` for ``seconds``: over ``timeout``, or over half
    of it while another rank overran (``find_overruns``)."""

    rank: int
    local_rank: int
    pid: int
    section: str
    seconds: float
    timeout: float
    iteration: int | None
    dump_signal: int | None

    def describe(self) -> str:
        where = f"after iteration {self.iteration}" if self.iteration is not None else "before the first iteration"
        return (f"rank {self.rank} (local rank {self.local_rank}, pid {self.pid}) has been in section "
                f"'{self.section}' for {self.seconds:.1f} s, {where} (timeout {self.timeout:g} s)")


def find_overruns(
    records: Iterable[ProgressRecord],
    alive: set[int],
    timeouts: Mapping[str, float],
    now: float,
) -> list[Overrun]:
    """The ranks in ``alive`` (pids) whose open section outlasted its timeout (0: no limit),
    and, once one has, every live rank silent for over half its own section's timeout.

    In a synchronous job one stuck rank soon blocks its peers in the next collective, and
    the heartbeats (rewritten at most every 50 ms) cannot say which stopped first: the
    culprit may be the second to overrun. All of them are reported, each with its stacks,
    which do tell. Heartbeats of processes not in ``alive`` are a previous generation's.
    """
    silent = []
    for record in records:
        timeout = timeouts.get(record.section, 0.0)
        seconds = now - record.since
        if record.pid in alive and timeout > 0 and seconds > timeout * STALLED_FRACTION:
            silent.append(Overrun(record.rank, record.local_rank, record.pid, record.section, seconds, timeout,
                                  record.iteration, record.dump_signal))
    if not any(o.seconds > o.timeout for o in silent):
        return []
    return sorted(silent, key=lambda o: o.rank)


def dump_stacks(overrun: Overrun, dumper: str = "auto") -> str:
    """Put the rank's Python stacks into the log; returns how ("py-spy", "faulthandler", "none").

    py-spy reads the stacks from outside (also of a stopped process) and its output goes
    into the agent's log. Otherwise the rank's faulthandler prints them to the rank's
    stderr, i.e. the worker's log; a stopped rank is continued so that it can.
    """
    if dumper == "off":
        return "none"
    if dumper in ("auto", "py-spy"):
        text = _py_spy(overrun.pid)
        if text is not None:
            log.error("stacks of rank %d (pid %d), by py-spy:\n%s", overrun.rank, overrun.pid, text.rstrip())
            return "py-spy"
        if dumper == "py-spy":
            log.warning("py-spy could not dump rank %d; trying its faulthandler", overrun.rank)
    if overrun.dump_signal is None:
        log.error("rank %d registered no stack-dump signal; no stacks to show", overrun.rank)
        return "none"
    try:
        os.kill(overrun.pid, overrun.dump_signal)
        os.kill(overrun.pid, signal.SIGCONT)  # a stopped rank handles the signal only once continued
    except ProcessLookupError:
        return "none"
    log.error("rank %d (pid %d) prints its stacks to its own log (%s)", overrun.rank, overrun.pid,
              signal.Signals(overrun.dump_signal).name)
    return "faulthandler"


def _py_spy(pid: int) -> str | None:
    exe = shutil.which("py-spy")
    if exe is None:
        return None
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=PY_SPY_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("py-spy dump of pid %d failed: %s", pid, exc)
        return None
    if done.returncode != 0:
        log.warning("py-spy dump of pid %d failed: %s", pid, (done.stderr or done.stdout).strip().splitlines()[:1])
        return None
    return done.stdout
